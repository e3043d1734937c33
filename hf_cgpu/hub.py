"""Model cards and Hub upload for trained output directories (``hf-cgpu push DIR REPO_ID``).

A card is rendered from a Jinja2 template (``model_cards/<kind>.md``) with YAML front matter built by
``huggingface_hub.ModelCardData``; the numbers come from the directory itself (``all_results.json``, the config
files, the safetensors headers), so a card always describes the weights beside it.

Where the templates live: one copy only, ``model_cards/`` at the repository root, where they are reviewed like
docs; setup.py maps that folder to the package ``hf_cgpu.model_cards``, so an installed hf_cgpu reads them with
``importlib.resources`` (``template_dir()``). No copy inside ``hf_cgpu/``, no symlink (symlinks are dropped or
duplicated by sdists and wheels, and break on Windows checkouts).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArgumentParser, IntegrityError, UserError
from .integrity import MANIFEST, atomic_output, verify_folder

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

KINDS: dict[str, dict[str, str]] = {
    "gpt": {"library_name": "transformers", "pipeline_tag": "text-generation"},
    "flow": {"library_name": "diffusers", "pipeline_tag": "unconditional-image-generation"},
    "lora": {"library_name": "peft", "pipeline_tag": "text-generation"},
}
# Never uploaded: training state (optimizer moments are 2-3x the model), caches and editor litter. Patterns are
# huggingface_hub's (fnmatch, ``*`` crosses ``/``), so ``upload_file_list`` shows exactly what upload_folder sends.
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
# config.json keys that say nothing about the model.
_CONFIG_NOISE = {"architectures", "auto_map", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}


class HubError(UserError, RuntimeError):
    """A push or card problem, with a one-line message naming the fix."""


# ----------------------------------------------------------------------------------------------------------------
# Hub ids on the command line


def check_hub_model(repo_id: str, what: str = "model", filename: str = "config.json",
                    repo_type: str = "model") -> None:
    """Before a loader retries for a minute: a Hub id must be in the local cache or answer one request.

    A typo, a private repo without a token or no network then ends in one line naming the fix. Offline
    (HF_HUB_OFFLINE) the loader is left to its cache.
    """
    from huggingface_hub import constants, repo_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str):
        return
    try:
        repo_info(repo_id, repo_type=repo_type, timeout=10)
    except GatedRepoError:
        raise HubError(f"{what} {repo_id!r} is gated; accept its terms on the Hub and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {repo_id!r} is no local path and no Hub repo you can read; check the spelling "
                       "(a local path must exist) or log in for a private repo (`hf auth login`)") from None
    except Exception as e:  # no network, DNS, proxy, timeout
        raise HubError(f"{what} {repo_id!r} is no local path and the Hub cannot be reached ({_one_line(e)}); "
                       "pass a local path, check the network, or set HF_HUB_OFFLINE=1 to use the cache") from None


def check_dataset(spec: str | None, builtin: str = "builtin") -> None:
    """``--dataset``: ``builtin``, an existing local path, or a Hub dataset id that answers (see ``check_hub_model``)."""
    if not spec or spec == builtin or Path(spec).expanduser().exists():
        return
    if spec.startswith((".", "/", "~")) or Path(spec.split("/")[0]).is_dir() or spec.count("/") > 1:
        raise HubError(f"dataset {spec!r} not found; pass an existing folder or file, a Hub dataset id, or builtin")
    check_hub_model(spec, "dataset", filename="README.md", repo_type="dataset")


# ----------------------------------------------------------------------------------------------------------------
# Templates


def template_dir() -> Traversable:
    """Directory holding ``gpt.md``, ``flow.md`` and ``lora.md``: ``$HF_CGPU_MODEL_CARDS`` if set, else
    ``<checkout>/model_cards`` when this hf_cgpu runs from a source checkout (its own templates, also when another
    checkout is installed editable), else the package ``hf_cgpu.model_cards`` through ``importlib.resources`` (a
    wheel or an editable install maps the top-level ``model_cards/`` folder to it, see setup.py)."""
    candidates = []
    if os.environ.get("HF_CGPU_MODEL_CARDS"):
        candidates.append(Path(os.environ["HF_CGPU_MODEL_CARDS"]).expanduser())
    candidates.append(Path(__file__).resolve().parent.parent / "model_cards")  # absent in a wheel's site-packages
    try:
        from importlib.resources import files

        candidates.append(files("hf_cgpu.model_cards"))
    except (ModuleNotFoundError, TypeError):  # a source checkout: the mapping exists only once installed
        pass
    for directory in candidates:
        if (directory / "gpt.md").is_file():
            return directory
    raise HubError(
        f"model card templates not found (looked in {', '.join(map(str, candidates))}); reinstall hf_cgpu or set "
        f"HF_CGPU_MODEL_CARDS to a directory holding gpt.md, flow.md and lora.md"
    )


# ----------------------------------------------------------------------------------------------------------------
# Reading a trained directory


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HubError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); repair or delete it") from None
    return data if isinstance(data, dict) else {}


def detect_kind(output_dir: str | os.PathLike) -> str:
    """``lora`` (adapter_config.json), ``flow`` (model_index.json) or ``gpt`` (config.json)."""
    d = Path(output_dir)
    if (d / "adapter_config.json").is_file():
        return "lora"
    if (d / "model_index.json").is_file():
        return "flow"
    if (d / "config.json").is_file():
        return "gpt"
    raise HubError(
        f"{d} holds no config.json, model_index.json or adapter_config.json; point at a finished run's output_dir"
    )


def _model_config(kind: str, d: Path) -> dict[str, Any]:
    """The config that describes the network: config.json, the pipeline's denoiser config, or the adapter's."""
    if kind == "lora":
        return _read_json(d / "adapter_config.json")
    if kind == "flow":
        index = _read_json(d / "model_index.json")
        for name in ("unet", "transformer", *index):
            if not name.startswith("_") and (d / name / "config.json").is_file():
                return {"_component": name, **_read_json(d / name / "config.json")}
        return {}
    return _read_json(d / "config.json")


def count_parameters(output_dir: str | os.PathLike) -> int:
    """Parameters stored in the directory's safetensors files, read from their headers (no weights loaded)."""
    total = 0
    for path in sorted(Path(output_dir).rglob("*.safetensors")):
        if "checkpoints" in path.relative_to(output_dir).parts:
            continue
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_value(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _format_count(n: int) -> str:
    """1.41B, 124.4M, 205: the precision people quote model sizes with."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n:,}"


LOCAL_ONLY = {"output_dir", "cache_dir", "resume_from_checkpoint", "dequantized_to", "load_from"}
"""Settings that only mean something on the training machine: left out of a card rendered for the Hub."""


def _looks_local(value: Any) -> bool:
    """A string that names a file or folder on this machine (absolute, home- or dot-relative, or existing)."""
    if not isinstance(value, str) or not value or "\n" in value or len(value) > 4096:
        return False
    if value.startswith(("/", "~", "./", "../")) or (len(value) > 2 and value[1] == ":" and value[2] in "\\/"):
        return True
    return ("/" in value or os.sep in value) and Path(value).expanduser().exists()


def public_value(value: Any) -> Any:
    """A local path as its last component (``/home/me/data/zh-poetry`` -> ``zh-poetry``); anything else as is."""
    if isinstance(value, (list, tuple)):
        return type(value)(public_value(v) for v in value)
    return Path(value).expanduser().name if _looks_local(value) else value


def _rows(mapping: dict[str, Any], skip: set[str] = frozenset(), public: bool = False) -> list[tuple[str, str]]:
    """Scalar (and short list) entries as table rows; nested objects and None are left out. ``public``: no local
    paths (``LOCAL_ONLY`` keys dropped, other paths cut to their last component)."""
    rows = []
    for key, value in mapping.items():
        if key in skip or key.startswith("_") or value is None or isinstance(value, dict):
            continue
        if isinstance(value, (list, tuple)) and (len(value) > 8 or any(isinstance(v, (dict, list)) for v in value)):
            continue
        if public:
            if key in LOCAL_ONLY:
                continue
            value = public_value(value)
        rows.append((key, _format_value(value)))
    return rows


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    return next((mapping[k] for k in keys if mapping.get(k) is not None), None)


def _by_suffix(mapping: dict[str, Any], suffix: str) -> tuple[str, Any] | None:
    """The loop names some results by its unit: ``toks_seen``, ``tok_per_s``, ``imgs_seen``."""
    return next(((k, v) for k, v in mapping.items() if k.endswith(suffix) and v is not None), None)


_UNIT_NAMES = {"tok": "tokens", "token": "tokens", "img": "images", "image": "images"}


def _summary(results: dict[str, Any], n_params: int, kind: str = "gpt") -> str:
    """One sentence with the headline figures that exist."""
    parts = []
    if n_params:
        parts.append(f"{_format_count(n_params)} {'adapter ' if kind == 'lora' else ''}parameters")
    steps = _first(results, "steps", "global_step")
    if steps is not None:
        parts.append(f"{_format_value(steps)} optimizer steps")
    seen = _by_suffix(results, "s_seen")
    if seen is not None:
        unit = seen[0][: -len("s_seen")]
        parts.append(f"{_format_value(seen[1])} {_UNIT_NAMES.get(unit, unit + 's')} seen")
    train_loss = _first(results, "train_loss", "final_loss")
    if train_loss is not None:
        parts.append(f"final train loss {_format_value(train_loss)}")
    val_loss = _first(results, "val_loss", "eval_loss", "validation_loss")
    if val_loss is not None:
        base = results.get("base_val_loss")
        parts.append(f"validation loss {_format_value(val_loss)}"
                     + (f" ({_format_value(base)} before fine-tuning)" if base is not None else ""))
    rate = _by_suffix(results, "_per_s")
    if rate is not None:
        parts.append(f"{_format_value(rate[1])} {rate[0][: -len('_per_s')]}/s on average")
    return "; ".join(parts) + "." if parts else "No results recorded (all_results.json missing)."


def _is_hub_id(name: str | None) -> bool:
    """A Hub dataset id looks like ``owner/name`` and is no existing local path."""
    return bool(name) and name.count("/") == 1 and not Path(name).expanduser().exists() and " " not in name


def _dataset_label(dataset: str | None) -> str:
    """How the card names the training data in prose."""
    if not dataset:
        return "an unrecorded dataset"
    if dataset == "builtin":
        return "Python's own reference documentation (`pydoc_data.topics`, hf_cgpu's `builtin` corpus)"
    if _is_hub_id(dataset):
        return f"[{dataset}](https://huggingface.co/datasets/{dataset})"
    return f"`{Path(dataset).name or dataset}`"


# The run's own figures in the card's model-index: (results key, metric type, metric name), by kind.
METRICS: dict[str, list[tuple[str, str, str]]] = {
    "gpt": [("val_loss", "loss", "validation loss (nats/token)"), ("val_perplexity", "perplexity", "validation perplexity"),
            ("val_bpc", "bpc", "validation bits per character")],
    "lora": [("val_loss", "loss", "validation loss (nats/token)"), ("val_bpc", "bpc", "validation bits per character")],
    "flow": [("val_loss", "mse", "validation flow-matching loss (velocity MSE)")],
}


def _eval_results(kind: str, results: dict[str, Any], dataset: str | None) -> list:
    """model-index entries (``huggingface_hub.EvalResult``) for the figures this run measured on held-out data."""
    from huggingface_hub import EvalResult

    if dataset == "builtin":
        dataset_type = dataset_name = "pydoc_data.topics"
    elif dataset:
        dataset_type = dataset if _is_hub_id(dataset) else (Path(dataset).name or dataset)
        dataset_name = dataset_type
    else:
        return []
    out = []
    for key, metric_type, name in METRICS.get(kind, []):
        value = results.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append(EvalResult(task_type=KINDS[kind]["pipeline_tag"], dataset_type=dataset_type,
                                  dataset_name=dataset_name, dataset_split="validation", metric_type=metric_type,
                                  metric_name=name, metric_value=float(value)))
    return out


def _figures(d: Path, results: dict[str, Any]) -> list[tuple[str, str]]:
    """(caption, relative path) of the pictures the run left beside the weights: curves and the last sample grid."""
    figures = []
    if (d / "training_curves.png").is_file():
        figures.append(("Training curves: loss, learning rate, gradient norm, throughput", "training_curves.png"))
    grid = results.get("sample_grid")
    if not grid:
        grids = sorted((d / "samples").glob("step_*.png")) if (d / "samples").is_dir() else []
        grid = grids[-1].relative_to(d).as_posix() if grids else None
    if grid and (d / grid).is_file():
        figures.append((f"Samples of the saved weights ({Path(grid).stem.replace('_', ' ')}), one row per class",
                        grid))
    return figures


def _file_size(path: Path) -> str:
    n = path.stat().st_size if path.is_file() else 0
    if not n:
        return ""
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


# ----------------------------------------------------------------------------------------------------------------
# Rendering


def render_model_card(kind: str, output_dir: str | os.PathLike, **fields: Any) -> str:
    """Render ``model_cards/<kind>.md`` for ``output_dir``, write it as ``output_dir/README.md``, return the text.

    Read from the directory: ``all_results.json`` (results table and summary; its ``settings`` entry, if any,
    becomes the settings table), the model config and the safetensors headers (parameter count).
    ``fields`` override or add: ``repo_id`` (used in the loading snippet), ``model_name``, ``description``,
    ``dataset`` (a Hub id also goes into the front matter), ``license`` (default apache-2.0), ``language``,
    ``base_model`` (lora; default from adapter_config.json), ``settings`` (dict of training settings),
    ``tags`` (extra tags).
    """
    from huggingface_hub import ModelCard, ModelCardData

    if kind not in KINDS:
        raise HubError(f"unknown model card kind {kind!r}; choose one of {', '.join(KINDS)}")
    d = Path(output_dir)
    if not d.is_dir():
        raise HubError(f"{d} is not a directory; pass a trained run's output_dir")
    results = _read_json(d / "all_results.json")
    config = _model_config(kind, d)
    settings = fields.pop("settings", None) or results.get("settings") or {}
    n_params = fields.pop("num_parameters", None) or count_parameters(d)
    repo_id = fields.pop("repo_id", None)
    dataset = fields.pop("dataset", None) or settings.get("dataset") or config.get("dataset")
    public = repo_id is not None  # rendered for the Hub: the repo id to load from, no path of this machine
    recorded = _read_json(d / "base_model.json")  # written by the fine-tuning task: the Hub id, the GGUF it came from
    base_model = fields.pop("base_model", None) or (
        (recorded.get("base_model") or config.get("base_model_name_or_path")) if kind == "lora" else None)
    if public and base_model and not _is_hub_id(base_model):
        base_model = public_value(base_model)
    if recorded.get("gguf_file") and "description" not in fields:
        fields["description"] = (f"The base was de-quantised from the GGUF checkpoint `{Path(recorded['gguf_file']).name}` "
                                 "(`from_pretrained(..., gguf_file=...)`); load it that way before the adapter.")
    extra_tags = list(fields.pop("tags", None) or [])
    model_name = fields.pop("model_name", None) or (repo_id.split("/")[-1] if repo_id else d.resolve().name)
    eval_results = _eval_results(kind, results, dataset)
    card_data = ModelCardData(
        license=fields.pop("license", "apache-2.0"),
        language=fields.pop("language", None),
        library_name=KINDS[kind]["library_name"],
        pipeline_tag=KINDS[kind]["pipeline_tag"],
        tags=["hf_cgpu", kind, *extra_tags],
        datasets=[dataset] if _is_hub_id(dataset) else None,
        base_model=base_model if kind == "lora" and (not public or _is_hub_id(base_model)) else None,
        model_name=model_name if eval_results else None,
        eval_results=eval_results or None,
    )
    template = template_dir() / f"{kind}.md"
    if not template.is_file():
        raise HubError(f"template {template} is missing; reinstall hf_cgpu or set HF_CGPU_MODEL_CARDS")
    card = ModelCard.from_template(
        card_data,
        template_str=template.read_text(encoding="utf-8"),
        model_name=model_name,
        load_path=repo_id or str(d),
        device=fields.pop("device", None) or results.get("device") or "",
        figures=_figures(d, results),
        adapter_size=_file_size(d / "adapter_model.safetensors"),
        new_tokens=min(60, max(1, int(config.get("n_positions") or 120) // 2)),  # the snippet stays in the context
        description=fields.pop("description", ""),
        dataset_name=_dataset_label(dataset),
        summary=_summary(results, n_params, kind),
        num_parameters=n_params,
        results_rows=_rows(results, skip={"settings", "samples", "sample_grid"}, public=public),
        samples=[str(x) for x in results.get("samples") or []],
        settings_rows=_rows(settings, public=public),
        config_rows=_rows(config, skip=_CONFIG_NOISE, public=public),
        base_model_name=base_model or "BASE_MODEL",
        base_model_label=(f"[{base_model}](https://huggingface.co/{base_model})" if _is_hub_id(base_model)
                          else f"`{base_model}`" if base_model else "its base model"),
        **fields,
    )
    with atomic_output(d / "README.md") as tmp:
        card.save(str(tmp))
    return str(card)


# ----------------------------------------------------------------------------------------------------------------
# Upload


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


def check_before_push(output_dir: Path, log=print) -> None:
    """A folder with a manifest must verify (a corrupted model is never published); one without is pushed with a
    warning (written before manifests, or by hand)."""
    if (output_dir / MANIFEST).is_file():
        try:
            verify_folder(output_dir)
        except IntegrityError as err:
            raise HubError(f"refusing to push: {err}; retrain or repair the folder (hf-cgpu verify DIR)") from None
    else:
        log(f"warning: {output_dir} has no {MANIFEST}; its files cannot be checked before the upload")


def commit_operations(d: Path, repo_id: str, card_kind: str | None):
    """The upload of a finished run as commit operations: the folder verified first, the card rendered for the
    repo (when ``card_kind``), then ``upload_file_list`` file by file (no symlink is followed)."""
    from huggingface_hub import CommitOperationAdd

    check_before_push(d)
    if card_kind:
        render_model_card(card_kind, d, repo_id=repo_id)  # loads from the repo id, names no local path
    return [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(d / rel)) for rel in upload_file_list(d)]


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def push_to_hub(
    output_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload model trained with hf_cgpu",
    render_card: bool = True,
) -> str:
    """Create ``repo_id`` if needed and upload ``output_dir`` without its checkpoints; returns the commit URL.

    Only ``upload_file_list`` goes up, file by file (no symlink is followed). The folder must pass its manifest
    (``hf-cgpu verify``) first. The card is rendered for the repo (its id in the loading code, no local path)
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
    operations = commit_operations(d, repo_id, detect_kind(d) if render else None)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.create_commit(repo_id=repo_id, repo_type="model", operations=operations,
                                   commit_message=commit_message)
    except Exception as e:  # network, auth, name clash: one line, the traceback stays on __cause__
        raise HubError(
            f"push to {repo_id} failed ({_one_line(e)}); check the network, the repo id and that the token can "
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
            raise HubError(f"cannot create the Hub repo {repo_id!r} ({_one_line(e)}); check --hub_model_id, the "
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
            self.log(f"warning: checkpoint upload failed ({_one_line(e)})")
        self.future = None

    def finish(self, kind: str | None) -> str:
        """Upload the finished run (card rendered for the repo id first); returns the commit URL."""
        self.wait()
        operations = commit_operations(self.output_dir, self.repo_id, kind)
        try:
            commit = self.api.create_commit(repo_id=self.repo_id, repo_type="model", operations=operations,
                                            commit_message="Upload model trained with hf_cgpu")
        except Exception as e:
            raise HubError(f"push to {self.repo_id} failed ({_one_line(e)}); the run is saved in {self.output_dir}: "
                           f"push it later with `hf-cgpu push {self.output_dir} {self.repo_id}`") from e
        url = str(getattr(commit, "commit_url", commit))
        self.log(f"push_to_hub: {url}")
        return url


def main(argv: list[str] | None = None) -> int:
    """``hf-cgpu push DIR REPO_ID [--private] [--token T] [--commit_message M]``."""
    parser = ArgumentParser(
        prog="hf-cgpu push", description="Upload a trained output directory to the Hub with a model card."
    )
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
    args = parser.parse_args(argv)
    print(push_to_hub(args.output_dir, args.repo_id, args.private, args.token, args.commit_message,
                      render_card=not args.keep_card))
    return 0


if __name__ == "__main__":
    from .errors import run_main

    sys.exit(run_main(main))


__all__ = [
    "HubError",
    "KINDS",
    "UPLOAD_IGNORE_PATTERNS",
    "count_parameters",
    "detect_kind",
    "main",
    "HubPusher",
    "check_dataset",
    "check_hub_model",
    "push_to_hub",
    "render_model_card",
    "template_dir",
    "public_value",
    "upload_file_list",
]
