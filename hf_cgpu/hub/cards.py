"""Model cards: the card registry (``CARDS``, one ``CardSpec`` per kind of trained folder) and their rendering.

A card is rendered from a Jinja2 template with YAML front matter built by ``huggingface_hub.ModelCardData``; the
numbers come from the folder itself (``all_results.json``, the config files, the safetensors headers), so a card
always describes the weights beside it. A task names its card kind (``Task.card``); ``hf-cgpu push`` finds the kind
of a finished folder from what it holds (``detect_kind``).

Where the built-in templates live: one copy only, ``model_cards/`` at the repository root, where they are reviewed like
docs; setup.py maps that folder to the package ``hf_cgpu.model_cards``, so an installed hf_cgpu reads them with
``importlib.resources`` (``template_dir()``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..integrity import atomic_output
from ..registry import Registry
from .checks import HubError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def read_config(name: str) -> Callable[[Path], dict[str, Any]]:
    """A reader of the JSON file ``name`` of a folder (empty when it is missing)."""
    return lambda d: read_json(d / name)


def pipeline_component_config(d: Path) -> dict[str, Any]:
    """The config of a diffusers pipeline's denoiser (unet, or transformer), with its component's name."""
    index = read_json(d / "model_index.json")
    for name in ("unet", "transformer", *index):
        if not name.startswith("_") and (d / name / "config.json").is_file():
            return {"_component": name, **read_json(d / name / "config.json")}
    return {}


@dataclass(frozen=True)
class CardSpec:
    """One kind of trained folder and its card."""

    name: str
    """What a task's ``card`` names; also a tag of the card."""
    template: str
    """The Jinja2 template: a file name in ``template_dir()``, or a path."""
    library_name: str
    """The card's ``library_name`` (transformers, diffusers, peft): how the Hub offers to load it."""
    pipeline_tag: str
    """The card's ``pipeline_tag`` (text-generation, unconditional-image-generation, ...)."""
    marker: str
    """The file at the top of a folder that says it holds this kind (``detect_kind`` tries kinds in order)."""
    config: Callable[[Path], dict[str, Any]]
    """The config that describes the network, read from the folder."""
    weights: tuple[str, ...]
    """Glob patterns of the weights its parameter count reads (the model's own, not a best/ or merged/ copy)."""
    metrics: tuple[tuple[str, str, str], ...] = ()
    """The run's own figures in the card's model-index: (all_results.json key, metric type, metric name)."""
    adapter: bool = False
    """Weights that load on a base model (the card names it as ``base_model``)."""
    counted: tuple[str, ...] = ()
    """Parts of the tensor names the parameter count keeps (empty: every tensor): an adapter's own tensors, not the
    copies of base layers peft may save beside them."""

    def template_path(self) -> Path | Traversable:
        path = Path(self.template).expanduser()
        return path if path.is_absolute() or path.parent != Path(".") else template_dir() / self.template


CARDS: Registry[CardSpec] = Registry("card", HubError)
"""Every kind of card, by name, in the order ``detect_kind`` tries them (``CARDS.add(name, spec, first=True)`` to be
tried first)."""


def card_spec(kind: str) -> CardSpec:
    return CARDS.lookup(kind)


CONFIG_NOISE = {"architectures", "auto_map", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}
"""config.json keys that say nothing about the model."""

LM_METRICS = (("val_loss", "loss", "validation loss (nats/token)"),
              ("val_perplexity", "perplexity", "validation perplexity"),
              ("val_bpc", "bpc", "validation bits per character"))

for _spec in (
    CardSpec("lora", "lora.md", "peft", "text-generation", "adapter_config.json", read_config("adapter_config.json"),
             ("adapter_model.safetensors",), (LM_METRICS[0], LM_METRICS[2]), adapter=True,
             counted=("lora_", "modules_to_save")),
    CardSpec("flow", "flow.md", "diffusers", "unconditional-image-generation", "model_index.json",
             pipeline_component_config, ("*/diffusion_pytorch_model*.safetensors",),
             (("val_loss", "mse", "validation flow-matching loss (velocity MSE)"),)),
    CardSpec("flow-distill", "flow_distill.md", "diffusers", "unconditional-image-generation", "model_index.json",
             pipeline_component_config, ("*/diffusion_pytorch_model*.safetensors",),
             (("val_loss", "mse", "validation shortcut-distillation loss"),)),
    CardSpec("gpt", "gpt.md", "transformers", "text-generation", "config.json", read_config("config.json"),
             ("model*.safetensors",), LM_METRICS),
):
    CARDS.add(_spec.name, _spec)


def detect_kind(output_dir: str | os.PathLike) -> str:
    """The card kind of a finished folder: the one its run recorded in all_results.json (``card``), else the first
    kind whose marker file it holds."""
    d = Path(output_dir)
    recorded = read_json(d / "all_results.json").get("card")
    if isinstance(recorded, str) and recorded in CARDS:
        return recorded
    for spec in CARDS.values():
        if (d / spec.marker).is_file():
            return spec.name
    markers = ", ".join(spec.marker for spec in CARDS.values())
    raise HubError(f"{d} holds none of {markers}; point at a finished run's output_dir")


def count_parameters(output_dir: str | os.PathLike, kind: str | None = None) -> int:
    """Parameters of the folder's own weights (its card kind's ``weights`` files, the tensors named by ``counted``),
    read from the safetensors headers; a tied tensor saved twice (the input embedding and the head, both
    ``vocab_size`` rows, same bytes) counts once, as ``num_parameters()`` counts it."""
    d = Path(output_dir)
    spec = card_spec(kind or detect_kind(d))
    vocab = spec.config(d).get("vocab_size")
    total = 0
    for path in sorted({p for pattern in spec.weights for p in d.glob(pattern)}):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            tensors = {k: t for k, t in header.items() if k != "__metadata__"
                       and (not spec.counted or any(part in k for part in spec.counted))}
            tied = _tied_copies(f, 8 + size, [t for t in tensors.values() if t["shape"][:1] == [vocab]])
        total += sum(math.prod(t["shape"]) for t in tensors.values()) - tied
    return total


def _tied_copies(f, start: int, tensors: list[dict[str, Any]]) -> int:
    """Parameters of the ``tensors`` (safetensors header entries of file ``f``, data from byte ``start``) that repeat
    an earlier one byte for byte."""
    seen, repeated = set(), 0
    for t in tensors:
        begin, end = t["data_offsets"]
        f.seek(start + begin)
        key = (t["dtype"], tuple(t["shape"]), hashlib.sha256(f.read(end - begin)).hexdigest())
        repeated += math.prod(t["shape"]) if key in seen else 0
        seen.add(key)
    return repeated


def template_dir() -> Traversable:
    """Directory holding the built-in templates (``gpt.md``, ``flow.md``, ``lora.md``): ``$HF_CGPU_MODEL_CARDS`` if set, else
    ``<checkout>/model_cards`` when this hf_cgpu runs from a source checkout (its own templates, also when another
    checkout is installed editable), else the package ``hf_cgpu.model_cards`` through ``importlib.resources`` (a
    wheel or an editable install maps the top-level ``model_cards/`` folder to it, see setup.py)."""
    candidates = []
    if os.environ.get("HF_CGPU_MODEL_CARDS"):
        candidates.append(Path(os.environ["HF_CGPU_MODEL_CARDS"]).expanduser())
    candidates.append(Path(__file__).resolve().parents[2] / "model_cards")  # absent in a wheel's site-packages
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



def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HubError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); repair or delete it") from None
    return data if isinstance(data, dict) else {}


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


def public_json(value: Any) -> Any:
    """A JSON document as it may be published: ``LOCAL_ONLY`` keys dropped, local paths cut to their last component,
    at every depth."""
    if isinstance(value, dict):
        return {k: public_json(v) for k, v in value.items() if k not in LOCAL_ONLY}
    if isinstance(value, list):
        return [public_json(v) for v in value]
    return public_value(value)


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


def _summary(results: dict[str, Any], n_params: int, adapter: bool = False) -> str:
    """One sentence with the headline figures that exist."""
    parts = []
    if n_params:
        parts.append(f"{_format_count(n_params)} {'adapter ' if adapter else ''}parameters")
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
    parts += _time_parts(results)
    return "; ".join(parts) + "." if parts else "No results recorded (all_results.json missing)."


def _time_parts(results: dict[str, Any]) -> list[str]:
    """How long it trained, and what the ledger had predicted a step would take on that card."""
    seconds = results.get("train_seconds")
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        return []
    minutes = seconds / 60
    parts = [f"trained in {minutes:.1f} minutes" if minutes < 120 else f"trained in {minutes / 60:.1f} hours"]
    led = results.get("ledger") or {}
    if isinstance(led, dict) and led.get("emulated"):
        return [f"emulated: the {results.get('steps', '?')} steps the ledger (`hf-cgpu budget`) gives "
                f"{led.get('card', 'the card')} in {led.get('minutes', '?')} minutes, trained on another GPU in "
                f"{minutes:.1f} minutes"]
    if isinstance(led, dict) and led.get("measured_step_seconds") and led.get("step_seconds"):
        parts.append(f"{led['measured_step_seconds']:.3g} s a step, where the ledger (`hf-cgpu budget`) predicted "
                     f"{led['step_seconds']:.3g} s on {led.get('card', 'this card')}")
    return parts


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


def _eval_results(spec: CardSpec, results: dict[str, Any], dataset: str | None) -> list:
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
    for key, metric_type, name in spec.metrics:
        value = results.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append(EvalResult(task_type=spec.pipeline_tag, dataset_type=dataset_type,
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
        rows = ", one row per class" if (read_json(d / "unet" / "config.json") or {}).get("num_classes") else ""
        figures.append((f"Samples of the saved weights ({Path(grid).stem.replace('_', ' ')}){rows}", grid))
    return figures


def _file_size(path: Path) -> str:
    n = path.stat().st_size if path.is_file() else 0
    if not n:
        return ""
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def base_model_of(d: Path, public: bool = False) -> str | None:
    """The base of the adapter folder ``d`` as its card names it: ``base_model.json``'s ``base_model`` (the Hub id
    ``--base_model_name`` gave, else ``--model``), else adapter_config.json's ``base_model_name_or_path``; ``public``:
    a local path cut to its last component."""
    base = read_json(d / "base_model.json").get("base_model") or read_json(d / "adapter_config.json").get(
        "base_model_name_or_path")
    return public_value(base) if public and base and not _is_hub_id(base) else base


def _gguf_base(d: Path, base_model: str | None, public: bool) -> tuple[str, str, str]:
    """(file name, where the card's snippet loads it from, a sentence saying how the base was made) for an adapter
    trained on a de-quantised GGUF checkpoint (``base_model.json``'s ``gguf_file``); three empty strings otherwise.
    The snippet loads the GGUF as training did where it can be named: from its Hub repo, or (a card for this
    machine) its folder. A local file in a card for the Hub cannot be: the snippet loads the Hub base given by
    ``--base_model_name`` instead, and the sentence says that its weights are not the de-quantised ones."""
    recorded = read_json(d / "base_model.json").get("gguf_file")
    if not recorded:
        return "", "", ""
    source = Path(recorded)
    name, folder = source.name, source.parent.as_posix()
    if _is_hub_id(folder):
        return name, folder, (f"Trained on the weights of the GGUF checkpoint `{name}` of [{folder}]"
                              f"(https://huggingface.co/{folder}), de-quantised by transformers: the snippet loads "
                              "them the same way (`gguf_file=`).")
    if not public:
        return name, folder, (f"Trained on the weights of the GGUF checkpoint `{source}`, de-quantised by "
                              "transformers: the snippet loads them the same way (`gguf_file=`).")
    if base_model and _is_hub_id(base_model):
        return name, "", (f"Trained on the weights of the GGUF checkpoint `{name}` (a file of the machine that "
                          f"trained it), de-quantised by transformers. The snippet loads {base_model}, named as the "
                          "base by `--base_model_name`: its weights differ from the trained-on ones by the GGUF's "
                          "quantisation. For the base exactly as trained, load that file the way training did: "
                          f'`AutoModelForCausalLM.from_pretrained(FOLDER, gguf_file="{name}")`.')
    return name, "FOLDER_HOLDING_THE_GGUF", (
        f"Trained on the weights of the GGUF checkpoint `{name}` (a file of the machine that trained it, no Hub id "
        "recorded: `--base_model_name`), de-quantised by transformers: the snippet loads it the same way from a folder "
        "holding that file.")


def render_model_card(kind: str, output_dir: str | os.PathLike, **fields: Any) -> str:
    """Render the template of the card ``kind`` (``CARDS``) for ``output_dir``, write it as ``output_dir/README.md``, return the text.

    Read from the directory: ``all_results.json`` (results table and summary; its ``settings`` entry, if any,
    becomes the settings table), the model config and the safetensors headers (parameter count).
    ``fields`` override or add: ``repo_id`` (used in the loading snippet), ``model_name``, ``description``,
    ``dataset`` (a Hub id also goes into the front matter), ``license`` (default apache-2.0), ``language``,
    ``base_model`` (adapter cards; default from adapter_config.json), ``settings`` (dict of training settings),
    ``tags`` (extra tags).
    """
    from huggingface_hub import ModelCard, ModelCardData

    spec = card_spec(kind)
    d = Path(output_dir)
    if not d.is_dir():
        raise HubError(f"{d} is not a directory; pass a trained run's output_dir")
    results = read_json(d / "all_results.json")
    config = spec.config(d)
    settings = fields.pop("settings", None) or results.get("settings") or {}
    n_params = fields.pop("num_parameters", None) or count_parameters(d, kind)
    repo_id = fields.pop("repo_id", None)
    dataset = fields.pop("dataset", None) or settings.get("dataset") or config.get("dataset")
    public = repo_id is not None  # rendered for the Hub: the repo id to load from, no path of this machine
    base_model = fields.pop("base_model", None) or (base_model_of(d, public) if spec.adapter else None)
    base_gguf, base_gguf_from, base_note = _gguf_base(d, base_model, public) if spec.adapter else ("", "", "")
    extra_tags = list(fields.pop("tags", None) or [])
    model_name = fields.pop("model_name", None) or (repo_id.split("/")[-1] if repo_id else d.resolve().name)
    eval_results = _eval_results(spec, results, dataset)
    card_data = ModelCardData(
        license=fields.pop("license", "apache-2.0"),
        language=fields.pop("language", None),
        library_name=spec.library_name,
        pipeline_tag=spec.pipeline_tag,
        tags=["hf_cgpu", kind, *extra_tags],
        datasets=[dataset] if _is_hub_id(dataset) else None,
        base_model=base_model if spec.adapter and (not public or _is_hub_id(base_model)) else None,
        model_name=model_name if eval_results else None,
        eval_results=eval_results or None,
    )
    template = spec.template_path()
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
        summary=_summary(results, n_params, spec.adapter),
        num_parameters=n_params,
        results_rows=_rows(results, skip={"settings", "samples", "sample_grid"}, public=public),
        results={k: public_value(v) if public else v for k, v in results.items()},  # a template's own sentences
        config=config,
        pipeline_index=read_json(d / "model_index.json"),  # a pipeline's saved sampling defaults
        samples=[str(x) for x in results.get("samples") or []],
        settings_rows=_rows(settings, public=public),
        eval_batches=settings.get("eval_batches") or 0,  # validation scored on that many micro-batches only
        config_rows=_rows(config, skip=CONFIG_NOISE, public=public),
        base_model_name=base_model or "BASE_MODEL",
        base_gguf=base_gguf,
        base_gguf_from=base_gguf_from,
        base_note=base_note,
        tokenizer_path=(repo_id or str(d)) if (d / "tokenizer_config.json").is_file()
        else base_model or "BASE_MODEL",  # the tokenizer it was trained with, where the folder holds it
        base_model_label=(f"[{base_model}](https://huggingface.co/{base_model})" if _is_hub_id(base_model)
                          else f"`{base_model}`" if base_model else "its base model"),
        **fields,
    )
    with atomic_output(d / "README.md") as tmp:
        card.save(str(tmp))
    return str(card)


__all__ = ["CARDS", "CardSpec", "base_model_of", "card_spec", "count_parameters", "detect_kind", "public_json",
           "public_value", "read_json", "render_model_card", "template_dir"]
