"""The command as users meet it: `hf-cgpu --help`, `hf-cgpu train NAME` with the recipes' settings and --help, every
subcommand's bad inputs ending in one line and exit code 2, imports kept lazy, accelerate's launcher kept quiet."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_cgpu.cli import COMMANDS
from hf_cgpu.cli import main as cli_main
from hf_cgpu.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------------------------------------- lazy imports
HEAVY = ("torch", "transformers", "diffusers", "accelerate", "datasets", "peft")


@pytest.mark.parametrize("call", [
    "import hf_cgpu",
    "from hf_cgpu.cli import main; main(['--help'])",
    "from hf_cgpu.cli import main; main(['train', '--help'])",
    "from hf_cgpu.cli import main; main(['budget', '--preset', '350m', '--autofit', '--memory_cap', '12GB'])",
    "from hf_cgpu.cli import main; main(['budget', '--preset', 'pythia-1.4b', '--tier', 'qlora'])",
])
def test_help_and_budget_import_no_framework(call):
    """`hf-cgpu --help` and `hf-cgpu budget` are arithmetic and text: none of torch/transformers/... is imported."""
    done = python(f"import sys\n{call}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # two fresh interpreters importing transformers: the slow tier
def test_auto_registration_waits_for_transformers():
    """`import hf_cgpu` registers the GPT with the Auto classes once transformers is imported, in either order."""
    for order in ("import hf_cgpu\nimport transformers", "import transformers\nimport hf_cgpu"):
        done = python(f"{order}\nfrom transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
                      "from transformers import AutoModelForCausalLM\n"
                      "from hf_cgpu import CgptConfig\n"
                      "print('cgpt' in CONFIG_MAPPING, type(AutoModelForCausalLM.from_config(CgptConfig(n_layer=1, "
                      "n_embd=8, n_head=2, vocab_size=16, n_positions=8))).__name__)")
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", "CgptForCausalLM"]


# ---------------------------------------------------------------------------------------------------- help
def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _recipe_help(script: str, argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [script, *argv, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "recipes" / script), run_name="__main__")
    assert e.value.code == 0
    return capsys.readouterr().out


def _settings_groups(text: str) -> str:
    """The settings part of a --help (task settings and TrainSettings), without usage, description and launch."""
    start = min(i for i in (text.find("GPTSettings:"), text.find("FlowSettings:"), text.find("FinetuneSettings:"),
                            text.find("ClassifierSettings:"), text.find("Toy2DSettings:"),
                            text.find("FlowDistillSettings:"), text.find("DPOSettings:")) if i >= 0)
    ends = [i for i in (text.find("LaunchSettings:"), text.find("\npresets:")) if i >= 0]  # the command's own parts
    return text[start:min(ends) if ends else None].rstrip()


@pytest.mark.parametrize("name", list(RECIPES))
def test_command_help_is_the_recipe_help(name, capsys, monkeypatch):
    recipe = RECIPES[name]
    argv = ["train", name] if name != "flow2d" else [name]  # the toy's own command: hf-cgpu flow2d
    cli = _help([*argv, "--help"], capsys)
    script = _recipe_help(recipe.script, [], capsys, monkeypatch)
    assert _settings_groups(cli) == _settings_groups(script)
    assert "(default: None)" not in cli and "(default: None)" not in script
    assert "--config_file" in cli and "--num_processes" in cli  # the command's own launch options


def test_help_shows_the_defaults_the_run_uses(capsys):
    text = " ".join(_help(["train", "gpt", "--preset", "tiny", "--help"], capsys).split())
    assert "--n_layer INT Transformer blocks. (default: 4; preset tiny)" in text  # from the preset
    assert "--mlp_ratio INT MLP width = mlp_ratio * n_embd. (default: 4)" in text  # from the dataclass
    assert "(default: 12)" in " ".join(_help(["train", "gpt", "--help"], capsys).split())
    lora = " ".join(_help(["train", "lora", "--help"], capsys).split())
    assert "(default: lora)" in lora and "(default: 2e-4; preset lora)" in lora.replace("0.0002", "2e-4")


@pytest.mark.parametrize("argv", [["generate", "--help"], ["sample", "--help"], ["eval", "--help"],
                                  ["budget", "--help"], ["push", "--help"], ["bench", "--help"]])
def test_every_option_has_help_text(argv, capsys):
    text = _help(argv, capsys)
    assert "(default: None)" not in text
    lines = text.splitlines() + [""]
    options = [i for i, line in enumerate(lines) if line.startswith("  --") and "--help" not in line]
    # argparse prints the help beside the flag, or on the next line indented under the help column
    bare = [lines[i] for i in options if len(lines[i].split()) <= 2 and not lines[i + 1].startswith(" " * 10)]
    assert options and not bare, bare


def test_top_level_help_lists_every_command(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    train = next(line for line in out.splitlines() if line.startswith("  train "))
    assert set(RECIPES) <= set(train.replace(",", " ").split()), train  # every registered recipe, none missed
    assert cli_main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- bad inputs
def _not_a_model(tmp):
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def _gpt_folder(tmp):
    (tmp / "gpt").mkdir()
    (tmp / "gpt" / "config.json").write_text('{"model_type": "cgpt"}')
    return str(tmp / "gpt")


def _config_file(tmp):
    return str(Path(_gpt_folder(tmp)) / "config.json")


def _adapter_folder(tmp):
    (tmp / "adapter").mkdir()
    (tmp / "adapter" / "adapter_config.json").write_text("{}")
    return str(tmp / "adapter")


def _flow_folder(tmp):
    (tmp / "flow").mkdir()
    (tmp / "flow" / "model_index.json").write_text("{}")
    return str(tmp / "flow")


def _gpt2_config(tmp) -> str:
    """A GPT-2 config.json (1024 learned positions) in ``tmp``."""
    path = tmp / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 100,
                                "n_positions": 1024}))
    return str(path)


# (argv with {tmp} placeholders or a callable, the fix the message names); a new subcommand needs its cases here
BAD: dict[str, list[tuple]] = {
    "train": [
        (["train", "gtp"], "choose one of gpt, flow, flow-distill, lora, dpo, classifier"),
        (["train", "gpt", "--bogus", "1"], "unrecognized arguments: --bogus"),
        (["train", "gpt", "--max_steps", "ten"], "invalid int value"),
        (["train", "gpt", "--preset", "huge"], "unknown preset 'huge'"),
        (["train", "gpt", "--preset", "{tmp}/missing.json"], "not found"),
        (["train", "gpt", "--n_embd", "100", "--n_head", "3"], "not divisible by n_head"),
        (["train", "gpt", "--tier", "qlora"], "fine-tuning tier"),
        (["train", "gpt", "--dataset", "{tmp}/my_corpus", "--output_dir", "{tmp}/run"], "not found"),
        (["train", "gpt", "--config_file", "{tmp}/none.yaml"], "accelerate config"),
        (["train", "gpt", "--hub_strategy", "every_step"], "choose end or checkpoint"),
        (["train", "flow", "--time_sampling", "cosine"], "uniform or logit_normal"),
        (["train", "flow", "--guidance_interval", "-0.1:0.5"], "must lie in [0, 1]"),
        (["train", "flow-distill", "--guidance_interval", "-0.2:0.8"], "must lie in [0, 1]"),
        (["train", "flow", "--dataset", "./cifar", "--output_dir", "{tmp}/run"], "not found"),
        (["train", "lora", "--tier", "turbo"], "unknown tier"),
        (["train", "lora", "--model", "./no-such-base", "--output_dir", "{tmp}/run"], "base model './no-such-base'"),
        (["train", "lora", "--model", _not_a_model, "--output_dir", "{tmp}/run"], "holds no config.json (nothing)"),
        (["train", "lora", "--model", _config_file, "--output_dir", "{tmp}/run"], "pass the folder that holds it"),
        (["train", "lora", "--model", _gpt_folder, "--output_dir", "{tmp}/run"], "holds config.json but no weights"),
        (["train", "lora", "--model", _adapter_folder, "--output_dir", "{tmp}/run"], "pass the base it was trained"),
        (["train", "classifier", "--widths", "1,2"], "four comma-separated"),
        (["train", "gpt", "--log_steps", "0", "--output_dir", "{tmp}/run"], "--log_steps must be >= 1"),
        (["train", "gpt", "--resume_from_checkpoint", "{tmp}/no/step_9", "--output_dir", "{tmp}/run"],
         "an existing step_N directory"),
        (["train", "lora", "--lora_r", "0", "--output_dir", "{tmp}/run"], "--lora_r must be >= 1"),
        (["train", "gpt", "--preset", "auto", "--max_minutes", "0", "--output_dir", "{tmp}/run"],
         "add --max_minutes M"),
        (["train", "gpt", "--preset", "tiny", "--attn_implementation", "flash", "--output_dir", "{tmp}/run"],
         "choose one of sdpa, flex_attention, eager"),
        (["train", "gpt", "--preset", "tiny", "--attn_implementation", "flex_attention", "--output_dir", "{tmp}/run"],
         "trains on CUDA only"),
    ],
    "flow2d": [(["flow2d", "--nfe_budgets", "2;5"], "comma-separated"),
               (["flow2d", "--time_sampling", "cosine"], "uniform or logit_normal")],
    "budget": [(["budget", "--preset", "13b"], "choose one of tiny"),
               (["budget", "--config", _gpt2_config, "--seq_len", "4096"], "use --seq_len 1024"),  # a position table
               (["budget", "--config", "{tmp}/none.json"], "no config.json"),
               (["budget", "--memory_cap", "16XB"], "e.g. 16GB"),
               (["budget", "--preset", "auto"], "or --dataset PATH"),
               (["budget", "--preset", "tiny", "--corpus_tokens", "1000"], "add --preset auto or drop it")],
    "bench": [(["bench"], "no CUDA device"), (["bench", "--iters", "x"], "invalid int value")],
    "generate": [(["generate", "{tmp}/nope", "hello"], "not found"),
                 (["generate", _not_a_model, "hello"], "holds no config.json"),
                 (["generate", _flow_folder, "hello"], "use `hf-cgpu sample"),
                 (["generate", "{tmp}/x"], "the following arguments are required"),
                 (["generate", "{tmp}/x", "hello", "--temperature", "0"], "--greedy decodes without sampling"),
                 (["generate", "{tmp}/x", "hello", "--chat", "maybe"], "choose auto, true or false")],
    "sample": [(["sample", "{tmp}/nope"], "not found"),
               (["sample", _gpt_folder], "use `hf-cgpu generate"),
               (["sample", _not_a_model], "holds no model_index.json"),
               (["sample", "{tmp}", "--scheduler", "dpm"], "choose euler or heun"),
               (["sample", "{tmp}", "--guidance_interval", "-0.1:0.5"], "must lie in [0, 1]")],
    "eval": [(["eval", "{tmp}/nope", "--dataset", "builtin"], "not found"),
             (["eval", _not_a_model, "--dataset", "builtin"], "holds no config.json"),
             (["eval", "{tmp}", "--dataset", "builtin", "--batch_size", "0"], "--batch_size must be >= 1"),
             (["eval", "{tmp}", "--dataset", "builtin", "--device", "cuda"], "no CUDA GPU"),
             (["eval", _flow_folder, "--guidance_interval", "-0.1:0.5"], "must lie in [0, 1]"),
             (["eval", _flow_folder, "--sweep", "--sweep_guidance_intervals", "full,-0.1:0.5"], "must lie in [0, 1]")],
    "push": [(["push", "{tmp}/nope", "someone/x"], "not a directory")],
    "export": [(["export", "{tmp}/nope", "--gguf"], "is no folder"),
               (["export", _not_a_model, "--gguf"], "holds no config.json or adapter_config.json"),
               (["export", _gpt_folder, "--gguf"], "writes the llama family only"),
               (["export", "{tmp}"], "add --gguf"),
               (["export", "{tmp}", "--gguf", "--outtype", "q4_k"], "choose bf16, f16, q8_0")],
}
CASES = [(cmd, argv, fix) for cmd, cases in BAD.items() for argv, fix in cases]


def test_every_subcommand_has_bad_input_cases():
    assert set(COMMANDS) - {"verify"} <= set(BAD), "add the new subcommand's bad inputs to BAD"


@pytest.mark.parametrize("command, argv, fix", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(command, argv, fix, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [a(tmp_path) if callable(a) else a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error:") and captured.err.count("\n") == 1, captured.err
    assert fix in captured.err, captured.err
    assert not (tmp_path / "run").exists()  # a failed run leaves no empty output folder


# ---------------------------------------------------------------------------------------------------- the launcher
@pytest.mark.slow
def test_launched_run_reports_the_child_error_in_one_line(tmp_path):
    """`hf-cgpu train ... --config_file`: accelerate's launcher starts the run; a user error in the child is its one
    line and exit code 2, without the launcher's CalledProcessError traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "hf_cgpu.cli", "train", "gpt", "--config_file",
         str(ROOT / "accelerate_config.yaml"), "--cpu", "--dataset", str(tmp_path / "corpus"),
         "--output_dir", str(tmp_path / "run")],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("error: dataset") and "not found" in errors[-1]
    assert "Traceback" not in done.stderr and "CalledProcessError" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_recipe_under_accelerate_launch_quiet_is_one_line(tmp_path):
    """The README's advice for the recipes: `accelerate launch -q` keeps the child's line alone (exit 1 is
    accelerate's)."""
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "-q", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(ROOT / "recipes" / "train_gpt.py"), "--n_embd", "100", "--n_head", "3"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()  # accelerate may note its CPU thread default first
    assert lines[-1] == "error: n_embd=100 is not divisible by n_head=3; use n_head in [1, 2, 4, 5, 10, 20, 25]"
    assert "Traceback" not in done.stderr and sum(line.startswith("error:") for line in lines) == 1


def test_max_new_tokens_beyond_the_context_says_so():
    from hf_cgpu.data.tokenizer import train_tokenizer
    from hf_cgpu.generate import continue_texts
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    tok = train_tokenizer(["some text to learn a few merges from, again and again"] * 20, vocab_size=300,
                          show_progress=False)
    torch.manual_seed(0)
    model = CgptForCausalLM(CgptConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=16,
                                       eos_token_id=tok.eos_token_id))
    model.generation_config.suppress_tokens = [tok.eos_token_id]  # no early end: the cut is what is measured
    notes = []
    out = continue_texts(model, tok, ["some text"], max_new_tokens=40, log=notes.append, do_sample=False)
    n_prompt = len(tok("some text").input_ids)
    assert out[0].startswith("some text")  # generated up to the context, no position-table overflow
    assert notes == [f"note: prompt 1 has {n_prompt} tokens and the model's context is 16: --max_new_tokens 40 is "
                     f"cut to {16 - n_prompt} (at most 16 tokens in all)"]
    assert continue_texts(model, tok, ["some text"], max_new_tokens=2, log=notes.append, do_sample=False)
    assert len(notes) == 1  # within the context: nothing to say


def test_generate_puts_prompts_in_the_chat_template_and_says_when_the_model_ends_at_once():
    from hf_cgpu.data.tokenizer import train_tokenizer
    from hf_cgpu.errors import SettingsError
    from hf_cgpu.generate import GenerateSettings, continue_texts
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    tok = train_tokenizer(["user says hello, the assistant answers"] * 20, vocab_size=300, show_progress=False)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    torch.manual_seed(0)
    model = CgptForCausalLM(CgptConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=64,
                                       eos_token_id=tok.eos_token_id))
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"]) if not seen else None,
                                    with_kwargs=True)
    model.generation_config.suppress_tokens = [tok.eos_token_id]
    notes = []
    out = continue_texts(model, tok, ["hello"], max_new_tokens=3, do_sample=False, chat=True, log=notes.append)
    templated = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert seen[0][0].tolist() == list(templated)  # the model saw the template, not the bare prompt
    assert out[0].startswith("hello\n") and "<|" not in out[0] and notes == []  # the answer only, after the prompt

    model.generation_config.suppress_tokens = [i for i in range(len(tok)) if i != tok.eos_token_id]  # EOS first
    out = continue_texts(model, tok, ["hello"], max_new_tokens=3, do_sample=False, log=notes.append)
    assert out == ["hello"] and len(notes) == 1 and "ended at once" in notes[0] and "--chat true" in notes[0]
    with pytest.raises(SettingsError, match="--top_p"):
        GenerateSettings(top_p=2)
    with pytest.raises(SettingsError, match="--temperature"):
        GenerateSettings(temperature=0)


def test_every_preset_is_described_in_one_line_in_help_and_budget(capsys):
    from hf_cgpu.settings import list_presets, preset_description

    for family, command in (("gpt", "gpt"), ("flow", "flow"), ("finetune", "lora"), ("classifier", "classifier")):
        text = _help(["train", command, "--help"], capsys)
        for name in list_presets(family):
            description = preset_description(name, family)
            assert description and "\n" not in description and len(description) <= 120, (family, name)
            assert f"  {name}" in text and description in text, (family, name)
    assert cli_main(["budget", "--preset", "350m"]) == 0
    assert f"preset 350m: {preset_description('350m', 'gpt')}" in capsys.readouterr().out
