"""Upload of a finished output folder to the Hub (``hf-cgpu push DIR REPO_ID``), and ``--push_to_hub`` of a training
run (``HubPusher``): the folder verified against its manifest, its card rendered for the repo, the files sent one by
one without checkpoints, caches or links."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArgumentParser, IntegrityError, about
from ..integrity import MANIFEST, verify_folder
from .cards import detect_kind, render_model_card
from .checks import HubError, one_line

UPLOAD_IGNORE_PATTERNS = [
    "checkpoints/*",
    "best/*",  # the best-by-validation copy; with load_best_at_end the top-level model is that copy
    "tokenizer/*",  # the training copy of the tokenizer (resume reads it); the model folder has its own
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
"""Never uploaded: training state (optimizer moments are 2-3x the model), caches and editor litter. Patterns are
huggingface_hub's (fnmatch, ``*`` crosses ``/``), so ``upload_file_list`` shows exactly what upload_folder sends."""


def upload_file_list(output_dir: str | os.PathLike) -> list[str]:
    """Relative paths that ``push_to_hub`` uploads: the regular files inside ``output_dir`` except
    ``UPLOAD_IGNORE_PATTERNS`` (checkpoints...) and hidden ones (temporaries, the run lock). Symbolic links are
    never followed or uploaded, neither files nor folders: a link may point anywhere on the machine."""
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


def commit_operations(d: Path, repo_id: str, card_kind: str | None, allow_unsealed: bool = False):
    """The upload of a finished run as commit operations: the folder verified first, the card rendered for the
    repo (when ``card_kind``), then ``upload_file_list`` file by file (no symlink is followed)."""
    from huggingface_hub import CommitOperationAdd

    check_before_push(d, allow_unsealed)
    if card_kind:
        render_model_card(card_kind, d, repo_id=repo_id)  # loads from the repo id, names no local path
    return [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(d / rel)) for rel in upload_file_list(d)]


def push_to_hub(
    output_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload model trained with hf_cgpu",
    render_card: bool = True,
    allow_unsealed: bool = False,
) -> str:
    """Create ``repo_id`` if needed and upload ``output_dir`` without its checkpoints; returns the commit URL.

    Only ``upload_file_list`` goes up, file by file (no symlink is followed). The folder must pass its manifest
    (``hf-cgpu verify``) first; a folder without one only with ``allow_unsealed``. The card is rendered for the repo (its id in the loading code, no local path)
    unless ``render_card`` is False and a README.md exists (a card edited by hand). The token is checked before
    any request, so a missing login fails at once instead of after a timeout.
    """
    from huggingface_hub import HfApi, get_token

    d = Path(output_dir)
    if not d.is_dir():
        raise HubError(f"{d} is not a directory; pass a trained run's output_dir")
    if not upload_file_list(d):
        raise HubError(f"{d} has nothing to upload outside checkpoints/; train first or point at the output_dir")
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login`, set HF_TOKEN, or pass --token")
    render = render_card or not (d / "README.md").is_file()
    operations = commit_operations(d, repo_id, detect_kind(d) if render else None, allow_unsealed)
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
        operations = commit_operations(self.output_dir, self.repo_id, kind)
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
    args = parser.parse_args(argv)
    print(push_to_hub(args.output_dir, args.repo_id, args.private, args.token, args.commit_message,
                      render_card=not args.keep_card, allow_unsealed=args.allow_unsealed))
    return 0


__all__ = ["HubPusher", "UPLOAD_IGNORE_PATTERNS", "check_before_push", "main", "push_to_hub", "upload_file_list"]
