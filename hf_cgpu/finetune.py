"""Fine-tuning pieces a LoRA recipe needs besides the training loop.

Adapters are saved alone (a few MB) and merged into a bf16 copy of the base afterwards. Merging is
never done into a 4-bit base: folding B @ A into nf4 weights would re-quantize them and lose most of
the update. QLoRA adapters are merged into the bf16 original of their base; the small gap between the
nf4 weights they were trained on and the bf16 ones is the known QLoRA merge caveat (evaluate after).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import SettingsError
from .gguf import gguf_location
from .integrity import usual_modes
from .paths import gguf_cache
from .tiers.lora import peft_quiet

__all__ = ["check_base", "load_adapter", "merge_and_save", "resolve_base", "save_adapter"]

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


def save_adapter(model: nn.Module, output_dir: str | Path) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (adapter weights only) to `output_dir`."""
    from peft import PeftModel

    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, PeftModel):
        raise ValueError(f"save_adapter needs a PeftModel (tier lora/qlora), got {type(model).__name__}")
    output_dir = Path(output_dir)
    model.save_pretrained(str(output_dir), safe_serialization=True)
    return output_dir


def load_adapter(base: nn.Module, adapter_dir: str | Path):
    """``PeftModel.from_pretrained(base, adapter_dir)`` under ``tiers.peft_quiet``."""
    from peft import PeftModel

    with peft_quiet():
        return PeftModel.from_pretrained(base, str(adapter_dir))


def merge_and_save(
    base_name_or_path: str,
    adapter_dir: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
) -> Path:
    """Reload the base in `dtype` (never 4-bit), apply the adapter, merge it and save safetensors.

    Tokenizer files found next to the adapter are copied so the merged folder loads on its own.
    """
    from transformers import AutoModelForCausalLM

    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"merge into a bf16/fp16/fp32 base, not {dtype}: merging into 4/8-bit weights loses the update")
    base = AutoModelForCausalLM.from_pretrained(base_name_or_path, dtype=dtype, trust_remote_code=trust_remote_code)
    merged = load_adapter(base, adapter_dir).merge_and_unload()
    output_dir = Path(output_dir)
    merged.save_pretrained(str(output_dir))
    for name in TOKENIZER_FILES:
        src = Path(adapter_dir) / name
        if src.is_file():
            shutil.copy2(src, output_dir / name)
    return output_dir


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
