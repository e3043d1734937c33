"""Fine-tuning pieces a LoRA recipe needs besides the training loop.

Adapters are saved alone (a few MB) and merged into a copy of the base afterwards. Merging is never done into
a 4-bit base: folding B @ A into nf4 weights would re-quantize them and lose most of the update. A QLoRA adapter
is merged into the nf4 weights it was trained against, de-quantised to bf16/fp32, so the merged model computes what
the adapter model did (merging into the bf16 original instead adds the quantisation error the adapter learned
around). A merge that rounds away part of the update (into bf16 weights) says so in one line.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import IntegrityError, SettingsError
from .gguf import gguf_location
from .integrity import sha256_file, usual_modes
from .paths import gguf_cache
from .tiers.load import is_4bit, load_base_model
from .tiers.lora import peft_quiet

__all__ = ["BASE_RECORD", "base_digest", "base_files", "check_base", "check_base_digest", "load_adapter",
           "merge_and_save", "merge_base", "merge_rounding", "merged_model", "packing_leak", "packing_tolerance",
           "resolve_base", "save_adapter"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
"""The files ``from_pretrained`` takes weights from (an index names shards of these kinds)."""
BASE_RECORD = "base_model.json"
"""Beside an adapter: the base it was trained on (``FinetuneTask._record_base``), with ``base_digest``."""


def base_files(folder: Path) -> list[str]:
    """The files of a base folder an adapter depends on: its config.json and weight files (top level)."""
    return sorted({p.name for pattern in ("config.json", *WEIGHT_PATTERNS) for p in folder.glob(pattern)
                   if p.is_file()})


def base_digest(base: str) -> dict[str, dict[str, Any]] | None:
    """The size and SHA-256 of each of ``base_files`` of a local base folder (None for a Hub id): what proves at
    load time that the base is the one the adapter was trained on. Hashing reads the base once (seconds for a
    billion-parameter base): a run does it in a background thread while the base loads."""
    folder = Path(base).expanduser()
    if not folder.is_dir():
        return None
    return {name: {"size": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
            for name in base_files(folder)}


def check_base_digest(adapter_dir: Path, base: str, verify: str = "auto") -> None:
    """The local base folder ``base`` holds the files ``adapter_dir`` recorded (``base_digest``): the same names and
    sizes, and (``verify`` auto or full) the same SHA-256; a one-line ``IntegrityError`` naming the base and the
    files that differ otherwise. An adapter saved without a record (or a Hub base) is not checked."""
    record = Path(adapter_dir) / BASE_RECORD
    recorded = json.loads(record.read_text()).get("base_digest") if record.is_file() else None
    folder = Path(base).expanduser()
    if not recorded or verify == "off" or not folder.is_dir():
        return
    now = base_files(folder)
    differ = [f"{name} {'added' if name in now else 'gone'}" for name in sorted(set(now) ^ set(recorded))]
    differ += [f"{name} {(folder / name).stat().st_size} bytes, trained on {recorded[name]['size']}"
               for name in sorted(set(now) & set(recorded)) if (folder / name).stat().st_size != recorded[name]["size"]]
    if not differ and verify != "sizes":
        differ = [f"{name} has other contents (SHA-256)" for name in sorted(recorded)
                  if sha256_file(folder / name) != recorded[name]["sha256"]]
    if differ:
        raise IntegrityError(f"the base {folder} changed after {adapter_dir} was trained on it: {'; '.join(differ)}; "
                             "restore the base it was trained on (or train the adapter again), or pass --verify off "
                             "to use it anyway")


def check_base(model: str, gguf_file: str = "") -> None:
    """A local ``--model`` is what ``from_pretrained`` loads a base from: a GGUF file (``gguf_location``) or a
    folder with config.json, weights and tokenizer files. Anything else (a config.json path, an adapter, a folder
    of something else) ends in one line naming what was found and what to pass, before transformers reports it in
    a traceback (a folder without tokenizer files even loads as a 2-token tokenizer)."""
    path = Path(model).expanduser()
    if not path.exists() or gguf_location(model, gguf_file) is not None:
        return
    wanted = "pass a causal LM folder (config.json, weights and tokenizer files), a .gguf file or a Hub id"
    if path.is_file():
        if path.name == "config.json":
            raise SettingsError(f"--model {model} is a config file; pass the folder that holds it: --model {path.parent}")
        raise SettingsError(f"--model {model} is a file, not a model; {wanted}")
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if "config.json" not in names:
        kind = ("a LoRA adapter (adapter_config.json): pass the base it was trained on" if "adapter_config.json" in names
                else "a FlowMatchPipeline (model_index.json), not a language model" if "model_index.json" in names
                else f"no model: it holds no config.json ({', '.join(names[:4]) or 'nothing'}"
                     f"{', ...' if len(names) > 4 else ''})")
        raise SettingsError(f"--model {model} is {kind}; {wanted}")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise SettingsError(f"--model {model} holds config.json but no weights (*.safetensors, *.bin); pass a folder "
                            "saved with save_pretrained (`hf-cgpu budget --config` prices a bare config)")
    if not any(name in names for name in TOKENIZER_FILES):
        raise SettingsError(f"--model {model} has weights but no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}); "
                            "save the base's tokenizer beside them (tokenizer.save_pretrained(folder))")


PACKING_PROBE = (7, 9)
"""Tokens of the two examples of the packing check's rows (``packing_leak``)."""


def packing_leak(model: nn.Module, autocast: Callable[[], Any] = contextlib.nullcontext) -> float:
    """How far an example in a packed row is from itself alone: the largest total variation distance (the share of
    probability that moves, 0 to 1) between the next-token distributions of example B, position by position, in the
    row A + B and in the rows B + A (B first: a causal model reads it as B alone) and A' + B (another A of the same
    length). Positions restart at each example, as training packs rows; the three rows are one batch of one shape.
    0 where positions and masks keep examples apart (up to rounding); more where a model ignores the restarted
    positions (OPT's learned positions, BLOOM's ALiBi distances) or attends across examples.

    Milliseconds on the model's device: eval mode (no dropout), no gradients, ``autocast`` as training has it.
    """
    a_len, b_len = PACKING_PROBE
    vocab = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (2 * a_len + b_len,), generator=torch.Generator().manual_seed(0))
    a, other, b = tokens[:a_len], tokens[a_len : 2 * a_len], tokens[2 * a_len :]
    ids = torch.stack([torch.cat([a, b]), torch.cat([other, b]), torch.cat([b, a])])
    restart = torch.cat([torch.arange(a_len), torch.arange(b_len)])
    positions = torch.stack([restart, restart, torch.cat([torch.arange(b_len), torch.arange(a_len)])])
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False).logits
    finally:
        model.train(was_training)
    probs = torch.softmax(logits.float(), dim=-1)
    packed, crossed, alone = probs[0, a_len:], probs[1, a_len:], probs[2, :b_len]
    return max(0.5 * (packed - other_row).abs().sum(-1).max().item() for other_row in (alone, crossed))


def packing_tolerance(model: nn.Module, mixed_precision: str = "no") -> float:
    """The most ``packing_leak`` may find where nothing leaks: 1e-4 for fp32 arithmetic, 0.05 for bf16/fp16 (weights
    or autocast) and 4-bit weights. Rounding alone (the same example at another offset of a row of one shape) stays
    several times below it, and a base that leaks moves several times more."""
    low = (mixed_precision in ("bf16", "fp16") or getattr(model, "dtype", torch.float32) != torch.float32
           or is_4bit(model))
    return 0.05 if low else 1e-4


def save_adapter(model: nn.Module, output_dir: str | Path) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (adapter weights only) to `output_dir`."""
    from peft import PeftModel

    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, PeftModel):
        raise ValueError(f"save_adapter needs a PeftModel (tier lora/qlora), got {type(model).__name__}")
    output_dir = Path(output_dir)
    model.save_pretrained(str(output_dir), safe_serialization=True)
    return output_dir


def load_adapter(base: nn.Module, adapter_dir: str | Path, trainable: bool = False):
    """``PeftModel.from_pretrained(base, adapter_dir)`` under ``tiers.peft_quiet``; ``trainable``: its adapter
    weights (fp32) train on, the base stays frozen."""
    from peft import PeftModel

    with peft_quiet():
        return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)


def merge_base(base_name_or_path: str, dtype: torch.dtype = torch.float32, quantized: bool = False,
               trust_remote_code: bool = False, log: Callable[[str], None] = print) -> nn.Module:
    """The weights an adapter is merged into, in ``dtype`` (never 4-bit: folding B @ A into nf4 would re-quantise
    the sum and lose most of the update). ``quantized`` (a QLoRA adapter, or a base stored quantised): the nf4
    weights the adapter was trained against, de-quantised, so the merged model computes what the adapter model
    computed rather than what the bf16 original plus the adapter would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise SettingsError(f"merge into bfloat16, float16 or float32 weights, not {dtype}: merging into 4/8-bit "
                            "weights re-quantises the sum and loses the update")
    config = AutoConfig.from_pretrained(base_name_or_path, trust_remote_code=trust_remote_code)
    stored = getattr(config, "quantization_config", None)
    if not quantized and stored is None:
        return AutoModelForCausalLM.from_pretrained(base_name_or_path, dtype=dtype,
                                                    trust_remote_code=trust_remote_code)
    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
    model = load_base_model(base_name_or_path, "qlora" if stored is None else "lora", device_map=device_map,
                            trust_remote_code=trust_remote_code)
    why = "a QLoRA adapter" if stored is None else "the base is stored quantised"
    log(f"{why}: merging into the 4-bit weights it was trained against, de-quantised to {_dtype_name(dtype)}")
    # before any forward: bitsandbytes' CPU path re-packs 4-bit weights on the first call, which dequantize misreads
    return model.dequantize().to("cpu", dtype)


def merge_rounding(peft_model: nn.Module, dtype: torch.dtype) -> float:
    """The fraction of the adapter's update (its norm, over every adapted weight) that merging into ``dtype``
    weights rounds away: ``||round(W + dW) - W - dW|| / ||dW||``, with W already in ``dtype``."""
    from peft.tuners.lora import LoraLayer

    lost = total = 0.0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer) or not module.active_adapters:
            continue
        weight = module.get_base_layer().weight.detach().float()
        delta = sum(module.get_delta_weight(name).detach().float() for name in module.active_adapters)
        merged = (weight + delta).to(dtype).float()
        lost += float(((merged - weight) - delta).square().sum())
        total += float(delta.square().sum())
    return (lost / total) ** 0.5 if total else 0.0


def merged_model(adapter_dir: str | Path, base_name_or_path: str, dtype: torch.dtype = torch.bfloat16,
                 quantized: bool = False, trust_remote_code: bool = False,
                 log: Callable[[str], None] = print) -> nn.Module:
    """The base (``merge_base``) with the adapter of ``adapter_dir`` folded in, as a plain transformers model; one
    line when ``dtype`` rounds away more than 1% of the adapter's update."""
    base = merge_base(base_name_or_path, dtype, quantized, trust_remote_code, log)
    model = load_adapter(base, adapter_dir)
    lost = merge_rounding(model, dtype)
    if lost > 0.01:
        log(f"note: merging into {_dtype_name(dtype)} weights rounds away {lost:.0%} of the adapter's update "
            "(its norm); --merge_dtype float32 keeps it")
    return model.merge_and_unload()


def merge_and_save(
    base_name_or_path: str,
    adapter_dir: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    quantized: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """``merged_model`` saved as safetensors; tokenizer files found next to the adapter are copied so the merged
    folder loads on its own."""
    merged = merged_model(adapter_dir, base_name_or_path, dtype, quantized, trust_remote_code, log)
    output_dir = Path(output_dir)
    merged.save_pretrained(str(output_dir))
    for name in TOKENIZER_FILES:
        src = Path(adapter_dir) / name
        if src.is_file():
            shutil.copy2(src, output_dir / name)
    return output_dir


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_base(model: str, gguf_file: str = "", cache_dir: str | Path | None = None) -> tuple[str, dict[str, Any]]:
    """Where to load the base from, and what to record about it.

    A GGUF checkpoint (``model`` a ``.gguf`` file, or a folder/Hub id plus ``gguf_file``) is de-quantised once by
    transformers (``from_pretrained(..., gguf_file=)``, needs the ``gguf`` package) into safetensors + tokenizer
    under the cache (``$HF_CGPU_CACHE/gguf/<name>-<size>``), so every tier (LoRA, QLoRA's nf4, full) loads it the
    usual way and ``merge``/``PeftModel.from_pretrained`` have a real base folder. Anything else is returned as is.
    """
    located = gguf_location(model, gguf_file)
    if located is None:
        return model, {}
    path, gguf_file = located
    source = path / gguf_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = source.stat().st_size if source.is_file() else 0
    root = Path(cache_dir) if cache_dir else gguf_cache()
    folder = root / f"{Path(gguf_file).stem}-{size}"
    info = {"gguf_file": str(source), "dequantized_to": str(folder)}
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return str(folder), info
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"de-quantising {source} to {folder} (once)")
    tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else model, gguf_file=gguf_file)
    base = AutoModelForCausalLM.from_pretrained(str(path) if path.exists() else model, gguf_file=gguf_file,
                                                dtype=torch.float32)
    # the weights are plain fp32 now; transformers only keeps a GGUF marker that refuses serialisation
    base.hf_quantizer = None
    if hasattr(base.config, "quantization_config"):
        del base.config.quantization_config
    base.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    usual_modes(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return str(folder), info
