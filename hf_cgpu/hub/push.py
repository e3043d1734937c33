"""Upload of a finished output folder to the Hub (``hf-cgpu push DIR REPO_ID``), and ``--push_to_hub`` of a training
run (``HubPusher``): the folder verified against its manifest, its card rendered for the repo, then exactly the files
its manifest seals, the manifest and the card, sent one by one, with no path of this machine in them.

What goes up (``upload_plan``): a sealed folder's manifest files, ``manifest.json`` and ``README.md``; with
``include_gguf`` also the GGUF files ``hf-cgpu export`` sealed in ``gguf/``. Anything else in the folder (a pickle
``.bin``, notes, an unsealed GGUF) stays local and is named in one line. The JSON files hf_cgpu writes with local
paths in them (``PUBLIC_COPIES``) go up as public copies: local-only settings dropped, paths cut to their last
component, the adapter's base named by its Hub id; the uploaded manifest seals those copies. Before anything is sent,
every text file going up is searched for this folder's path and the cache roots: one found refuses the push.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentParser, IntegrityError, about
from ..integrity import MANIFEST, FileEntry, read_manifest, verify_folder
from .cards import base_model_of, detect_kind, public_json, read_json, render_model_card
from .checks import HubError, one_line

UPLOAD_IGNORE_PATTERNS = [
    "checkpoints/*",
    "best/*",  # the best-by-validation copy; with load_best_at_end the top-level model is that copy
    "tokenizer/*",  # the training copy of the tokenizer (resume reads it); the model folder has its own
    "teacher_cache/*",  # a distilled run's cache of its teacher's predictions (--teacher_top_k), training state
    "*/checkpoints/*",
    "__pycache__/*",
    "*/__pycache__/*",
    "*.pyc",
    ".git/*",
    ".cache/*",
    "*.tmp",
    ".DS_Store",
    ".hf_cgpu.lock",
]
"""Never uploaded, sealed or not: training state (optimizer moments are 2-3x the model), caches and editor litter.
Patterns are huggingface_hub's (fnmatch, ``*`` crosses ``/``)."""

GGUF_DIR = "gguf"
"""Where ``hf-cgpu export DIR --gguf`` writes, sealed by its own manifest: uploaded only with ``include_gguf``."""

PUBLIC_COPIES = ("all_results.json", "base_model.json", "adapter_config.json")
"""Files hf_cgpu (and peft) write with paths of the training machine in them (the settings, where the base was
loaded from): uploaded as ``public_copy`` makes them."""

TEXT_SUFFIXES = (".json", ".md", ".txt", ".py", ".jinja", ".yaml", ".yml", ".csv")
"""Files searched for local paths before an upload (weights and pictures are not)."""


def folder_files(output_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the regular files inside ``output_dir`` except ``UPLOAD_IGNORE_PATTERNS`` (checkpoints...)
    and hidden ones (temporaries, the run lock). Symbolic links are never followed or listed, neither files nor
    folders: a link may point anywhere on the machine."""
    from huggingface_hub.utils import filter_repo_objects

    d = Path(output_dir)
    root = d.resolve()
    files = []
    for current, dirs, names in os.walk(d, followlinks=False):
        here = Path(current)
        dirs[:] = [n for n in dirs if not n.startswith(".") and not (here / n).is_symlink()]
        for name in names:
            p = here / name
            if name.startswith(".") or p.is_symlink() or not p.is_file():  # links, fifos, sockets: never
                continue
            if not p.resolve().is_relative_to(root):
                continue
            files.append(p.relative_to(d).as_posix())
    return sorted(filter_repo_objects(sorted(files), ignore_patterns=UPLOAD_IGNORE_PATTERNS))


@dataclass(frozen=True)
class UploadPlan:
    """What a push sends from a folder, and what it leaves there."""

    files: list[str]
    """Relative paths uploaded."""
    left_out: list[str] = field(default_factory=list)
    """Files of ``folder_files`` that stay local: outside the manifest, or GGUF files without ``include_gguf``."""
    include_gguf: bool = False

    def note(self) -> str:
        """The one line that names what stays local (empty when nothing does)."""
        if not self.left_out:
            return ""
        gguf = [f for f in self.left_out if f.startswith(f"{GGUF_DIR}/")]
        other = [f for f in self.left_out if f not in gguf]
        why = (f"not in {GGUF_DIR}/{MANIFEST}: export it again" if self.include_gguf
               else "--include_gguf uploads what hf-cgpu export wrote")
        parts = ([f"{_names(other)} (not in {MANIFEST})"] if other else []) + (
            [f"{_names(gguf)} ({why})"] if gguf else [])
        return "left out: " + "; ".join(parts)


def _names(paths: list[str]) -> str:
    """``paths`` for one line: a folder holding more than one of them as ``folder/ (N files)``."""
    groups: dict[str, list[str]] = {}
    for rel in paths:
        groups.setdefault(rel.split("/", 1)[0] if "/" in rel else rel, []).append(rel)
    return ", ".join(rels[0] if len(rels) == 1 else f"{top}/ ({len(rels)} files)" for top, rels in groups.items())


def upload_plan(output_dir: str | os.PathLike, include_gguf: bool = False) -> UploadPlan:
    """The files of a push: a sealed folder's manifest files, ``manifest.json`` and ``README.md`` (the card), plus,
    with ``include_gguf``, the files of ``gguf/manifest.json`` (what ``hf-cgpu export`` sealed) and that manifest.
    A folder without a manifest (pushed with ``allow_unsealed``) sends every file of ``folder_files`` but ``gguf/``
    (without ``include_gguf``). Nothing outside ``folder_files``, ever."""
    d = Path(output_dir)
    present = folder_files(d)
    gguf_files = [f for f in present if f.startswith(f"{GGUF_DIR}/")]
    if (d / MANIFEST).is_file():
        wanted = {*read_manifest(d).files, MANIFEST, "README.md"}
    else:
        wanted = set(present) - set(gguf_files)
    if include_gguf:
        if not (d / GGUF_DIR / MANIFEST).is_file():
            raise HubError(f"--include_gguf: {d / GGUF_DIR} holds no {MANIFEST}, so no GGUF that `hf-cgpu export "
                           f"{d} --gguf` wrote and checked; export it, or leave --include_gguf out")
        wanted |= {f"{GGUF_DIR}/{rel}" for rel in [*read_manifest(d / GGUF_DIR).files, MANIFEST]}
    return UploadPlan([f for f in present if f in wanted], [f for f in present if f not in wanted], include_gguf)


def upload_file_list(output_dir: str | os.PathLike, include_gguf: bool = False) -> list[str]:
    """Relative paths that ``push_to_hub`` uploads (``upload_plan``)."""
    return upload_plan(output_dir, include_gguf).files


def public_copy(d: Path, rel: str) -> bytes | None:
    """The bytes to upload for ``rel`` in place of the file (None: the file as it is): a ``PUBLIC_COPIES`` file
    without local paths (``public_json``; of all_results.json its ``settings``, the results themselves are kept as
    measured), an adapter's ``base_model_name_or_path`` as its card names it (``base_model_of``)."""
    path = d / rel
    if path.name not in PUBLIC_COPIES:
        return None
    data = read_json(path)
    if path.name == "all_results.json":
        public = {**data, "settings": public_json(data["settings"])} if isinstance(data.get("settings"), dict) else data
    else:
        public = public_json(data)
    if path.name == "adapter_config.json" and data.get("base_model_name_or_path"):
        public["base_model_name_or_path"] = base_model_of(path.parent, public=True)
    return None if public == data else json.dumps(public, indent=2, ensure_ascii=False).encode("utf-8")


def local_roots(d: Path) -> list[str]:
    """Paths of this machine that must not be published: the folder's (as given and resolved), hf_cgpu's cache
    root and the Hugging Face cache's."""
    from huggingface_hub import constants

    from ..paths import cache_dir

    roots = {str(p) for base in (d.absolute(), cache_dir(), Path(constants.HF_HOME))
             for p in (base, base.resolve())}
    return sorted(roots, key=len, reverse=True)


def _sealed_copy(manifest_path: Path, copies: dict[str, bytes], prefix: str = "") -> bytes | None:
    """The manifest at ``manifest_path`` with the entries of the files replaced by ``copies`` re-hashed (None: none
    of them is listed there), so the repo verifies as uploaded."""
    manifest = read_manifest(manifest_path.parent)
    changed = {rel[len(prefix):]: data for rel, data in copies.items()
               if rel.startswith(prefix) and rel[len(prefix):] in manifest.files}
    if not changed:
        return None
    for rel, data in changed.items():
        manifest.files[rel] = FileEntry(len(data), hashlib.sha256(data).hexdigest())
    return manifest.to_json().encode("utf-8")


def check_before_push(output_dir: Path, allow_unsealed: bool = False, log=print) -> None:
    """The folder must verify against its manifest (a corrupted or half-saved model is never published); one without
    a manifest is refused unless ``allow_unsealed`` (files put together by hand), then pushed with a warning."""
    if (output_dir / MANIFEST).is_file():
        try:
            verify_folder(output_dir)
        except IntegrityError as err:
            raise HubError(f"refusing to push: {err}; retrain or repair the folder (hf-cgpu verify DIR)") from None
    elif allow_unsealed:
        log(f"warning: {output_dir} has no {MANIFEST}; its files cannot be checked before the upload")
    else:
        raise HubError(f"refusing to push {output_dir}: unsealed, no {MANIFEST} (a save cut off before it, or files "
                       "put there by hand); resume the run that wrote it to save it again, or pass --allow_unsealed "
                       "for a folder you assembled yourself")


def commit_operations(d: Path, repo_id: str, card_kind: str | None, allow_unsealed: bool = False,
                      include_gguf: bool = False, log=print):
    """The upload of a finished run as commit operations: the folder verified first (and ``gguf/`` with
    ``include_gguf``), the card rendered for the repo (when ``card_kind``), then ``upload_plan``'s files one by one
    (no symlink is followed), ``PUBLIC_COPIES`` as their public copies and the manifest sealing those; what stays
    local is named in one line. A text file still naming a local path refuses the push."""
    from huggingface_hub import CommitOperationAdd

    check_before_push(d, allow_unsealed, log)
    if include_gguf and (d / GGUF_DIR / MANIFEST).is_file():
        try:
            verify_folder(d / GGUF_DIR)
        except IntegrityError as err:
            raise HubError(f"refusing to push: {err}; export it again (hf-cgpu export {d} --gguf)") from None
    if card_kind:
        render_model_card(card_kind, d, repo_id=repo_id)  # loads from the repo id, names no local path
    plan = upload_plan(d, include_gguf)
    if plan.left_out:
        log(plan.note())
    contents: dict[str, str | bytes] = {rel: str(d / rel) for rel in plan.files}
    copies = {rel: data for rel in plan.files if (data := public_copy(d, rel)) is not None}
    contents.update(copies)
    for rel in plan.files:
        if Path(rel).name == MANIFEST and copies:
            prefix = rel[: -len(MANIFEST)]
            sealed = _sealed_copy(d / rel, copies, prefix)
            if sealed is not None:
                contents[rel] = sealed
    _refuse_local_paths(d, contents)
    return [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=data) for rel, data in contents.items()]


def _refuse_local_paths(d: Path, contents: dict[str, str | bytes]) -> None:
    roots = [root.encode("utf-8") for root in local_roots(d)]
    for rel, data in contents.items():
        if Path(rel).suffix.lower() not in TEXT_SUFFIXES:
            continue
        text = data if isinstance(data, bytes) else Path(data).read_bytes()
        found = next((root for root in roots if root in text), None)
        if found is not None:
            raise HubError(f"refusing to push: {rel} names {found.decode()}, a path of this machine; remove it "
                           "from the file (or leave the file out of the folder) and push again")


def push_to_hub(
    output_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload model trained with hf_cgpu",
    render_card: bool = True,
    allow_unsealed: bool = False,
    include_gguf: bool = False,
    log=print,
) -> str:
    """Create ``repo_id`` if needed and upload ``output_dir`` (``commit_operations``); returns the commit URL.

    The folder must pass its manifest (``hf-cgpu verify``) first; a folder without one only with ``allow_unsealed``.
    Exactly ``upload_plan``'s files go up, file by file (no symlink is followed); the GGUF files of ``gguf/`` only
    with ``include_gguf``. The card is rendered for the repo (its id in the loading code, no local path) unless
    ``render_card`` is False and a README.md exists (a card edited by hand). The token is checked before any
    request, so a missing login fails at once instead of after a timeout.
    """
    from huggingface_hub import HfApi, get_token

    d = Path(output_dir)
    if not d.is_dir():
        raise HubError(f"{d} is not a directory; pass a trained run's output_dir")
    if not folder_files(d):
        raise HubError(f"{d} has nothing to upload outside checkpoints/; train first or point at the output_dir")
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login`, set HF_TOKEN, or pass --token")
    render = render_card or not (d / "README.md").is_file()
    operations = commit_operations(d, repo_id, detect_kind(d) if render else None, allow_unsealed, include_gguf, log)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.create_commit(repo_id=repo_id, repo_type="model", operations=operations,
                                   commit_message=commit_message)
    except Exception as e:  # network, auth, name clash: one line, the traceback stays on __cause__
        raise HubError(
            f"push to {repo_id} failed ({one_line(e)}); check the network, the repo id and that the token can "
            f"write (`hf auth whoami`)"
        ) from e
    return str(getattr(commit, "commit_url", commit))


class HubPusher:
    """``--push_to_hub`` of a training run, the HF Trainer's way: the repo is created before training (a missing
    token or a bad repo id fails at once, not after hours), each checkpoint can go to ``last-checkpoint/`` in the
    background (``hub_strategy checkpoint``; a new one is skipped while the last upload runs), and the finished
    ``output_dir`` is uploaded at the end with its card rendered for the repo id."""

    def __init__(self, repo_id: str, output_dir: str | os.PathLike, private: bool = False,
                 strategy: str = "end", token: str | None = None, log=print):
        from huggingface_hub import HfApi, get_token

        self.output_dir, self.strategy, self.log = Path(output_dir), strategy, log
        self.future = None
        token = token or get_token()
        if not token:
            raise HubError("--push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN "
                           "(or drop --push_to_hub and run `hf-cgpu push` later)")
        self.api = HfApi(token=token)
        try:
            self.repo_id = self.api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        except Exception as e:
            raise HubError(f"cannot create the Hub repo {repo_id!r} ({one_line(e)}); check --hub_model_id, the "
                           "network and that the token can write (`hf auth whoami`)") from e
        log(f"push_to_hub: {self.api.endpoint}/{self.repo_id} ({'private' if private else 'public'}; "
            f"{'each checkpoint and ' if strategy == 'checkpoint' else ''}the finished run)")

    def checkpoint(self, folder: Path, step: int) -> None:
        """Upload ``folder`` (a checkpoint) to ``last-checkpoint/`` in the background (``run_as_future``)."""
        if self.strategy != "checkpoint":
            return
        if self.future is not None and not self.future.done():
            self.log(f"push_to_hub: the previous checkpoint upload is still running; step {step} is not pushed")
            return
        self.future = self.api.upload_folder(
            repo_id=self.repo_id, folder_path=str(folder), path_in_repo="last-checkpoint",
            commit_message=f"Training in progress, step {step}", run_as_future=True,
            delete_patterns=["*"],  # last-checkpoint/ holds one checkpoint, never a mix of two
        )

    def wait(self) -> None:
        """Let a background checkpoint upload finish; its failure is a warning (the final push follows)."""
        if self.future is None:
            return
        try:
            self.future.result()
        except Exception as e:
            self.log(f"warning: checkpoint upload failed ({one_line(e)})")
        self.future = None

    def finish(self, kind: str | None) -> str:
        """Upload the finished run (card rendered for the repo id first); returns the commit URL."""
        self.wait()
        operations = commit_operations(self.output_dir, self.repo_id, kind, log=self.log)
        try:
            commit = self.api.create_commit(repo_id=self.repo_id, repo_type="model", operations=operations,
                                            commit_message="Upload model trained with hf_cgpu")
        except Exception as e:
            raise HubError(f"push to {self.repo_id} failed ({one_line(e)}); the run is saved in {self.output_dir}: "
                           f"push it later with `hf-cgpu push {self.output_dir} {self.repo_id}`") from e
        url = str(getattr(commit, "commit_url", commit))
        self.log(f"push_to_hub: {url}")
        return url


def main(argv: list[str] | None = None) -> int:
    """``hf-cgpu push DIR REPO_ID [--private] [--token T] [--commit_message M]``."""
    parser = ArgumentParser(
        prog="hf-cgpu push", description=about("Upload a trained output directory to the Hub with a model card.",
                                               "hf-cgpu push runs/zh your-name/cgpt-zh-poetry --private"))
    parser.add_argument("output_dir", help="a finished run's output directory")
    parser.add_argument("repo_id", help="target model repo, e.g. your-name/cgpt-zh-poetry")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or `hf auth login`)")
    parser.add_argument("--commit_message", default="Upload model trained with hf_cgpu",
                        help="the Hub commit's message (default: %(default)s)")
    parser.add_argument("--render_card", action="store_true",
                        help="re-render README.md for the repo (the default; kept for old scripts)")
    parser.add_argument("--keep_card", action="store_true",
                        help="upload the existing README.md as it is (a card edited by hand)")
    parser.add_argument("--allow_unsealed", action="store_true",
                        help="push a folder without manifest.json (one assembled by hand; its files are not checked)")
    parser.add_argument("--include_gguf", action="store_true",
                        help="also upload the GGUF files `hf-cgpu export DIR --gguf` wrote into DIR/gguf/ (checked "
                             "against gguf/manifest.json)")
    args = parser.parse_args(argv)
    print(push_to_hub(args.output_dir, args.repo_id, args.private, args.token, args.commit_message,
                      render_card=not args.keep_card, allow_unsealed=args.allow_unsealed,
                      include_gguf=args.include_gguf))
    return 0


__all__ = ["GGUF_DIR", "HubPusher", "PUBLIC_COPIES", "UPLOAD_IGNORE_PATTERNS", "UploadPlan", "check_before_push",
           "folder_files", "main", "public_copy", "push_to_hub", "upload_file_list", "upload_plan"]
