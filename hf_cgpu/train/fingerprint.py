"""What a checkpoint must share with the run that resumes it, derived rather than listed: every field of the model's
saved config, the content hashes of the tokenizer and the data, and every setting marked as changing the math of the
steps after it (``settings.FIXED``). A resume that differs in any of them is refused in one line naming the field and
both values, so a checkpoint never loads into a model it was not written for (LayerNorm without bias and RMSNorm both
save only ``.weight``: nothing else would tell them apart)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch

from ..settings import fixed_defaults, fixed_settings

CONFIG_NOISE = frozenset({"transformers_version", "architectures", "auto_map", "_name_or_path", "dtype", "torch_dtype",
                          "use_cache", "quantization_config", "_commit_hash", "_diffusers_version", "_class_name",
                          "_use_default_values"})
"""Config keys that say nothing about the network: versions, class names, paths, dtypes and quantization (the tier
decides those), the KV cache switch (recompute turns it off)."""


def saved_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config as ``save_pretrained`` writes it (transformers' ``to_dict``, diffusers' frozen dict), without
    ``CONFIG_NOISE`` and private keys; a model without a config is described by its parameters' names and shapes."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        raw = config.to_dict()
    elif dataclasses.is_dataclass(config):
        raw = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        return {f"param.{name}": list(t.shape) for name, t in model.state_dict().items()}
    return {k: v for k, v in raw.items() if k not in CONFIG_NOISE and not k.startswith("_")}


def run_fingerprint(model_config: Mapping[str, Any] | None, data: Mapping[str, Any], *settings: Any) -> dict[str, Any]:
    """One flat dict: ``model.<field>`` for every field of the saved config, the task's data hashes, and the fixed
    settings of ``settings`` (JSON-ready: what trainer_state.json keeps)."""
    out = {f"model.{k}": v for k, v in (model_config or {}).items()}
    out.update(data)
    out.update(fixed_settings(*settings))
    return json.loads(json.dumps(out, sort_keys=True, default=str))  # as trainer_state.json gives it back


def model_option_defaults(*settings: Any) -> dict[str, Any]:
    """``model.<field>`` at its default for every field of ``settings``: a model option newer than a checkpoint's
    config (absent from it) was trained as its default, which is the plain model (our GPT's options are off by
    default)."""
    return {f"model.{f.name}": f.default for s in settings for f in dataclasses.fields(s)
            if f.default is not dataclasses.MISSING}


def with_new_settings(theirs: Mapping[str, Any], ours: Mapping[str, Any], *settings: Any) -> dict[str, Any]:
    """``theirs`` (a checkpoint's fingerprint) with the settings and model options added since it was written, at
    their defaults: a checkpoint that predates a setting was trained as its default does, so a resume at the default is
    accepted and one at another value is refused like any change."""
    defaults = json.loads(json.dumps({**fixed_defaults(*settings), **model_option_defaults(*settings)},
                                     sort_keys=True, default=str))
    return {**{k: v for k, v in defaults.items() if k in ours and k not in theirs}, **theirs}


def difference(theirs: Mapping[str, Any], ours: Mapping[str, Any], *settings: Any, shown: int = 3) -> str:
    """The first ``shown`` differing entries as ``{key: (checkpoint's, this run's)}``, the count of the rest, and the
    flag to set for the first one when it is a fixed setting or a model option of ``settings`` (a content hash or a
    config field no flag sets gets none: there is no flag to name)."""
    keys = sorted(set(theirs) | set(ours), key=lambda k: (k not in ours or k not in theirs, k))  # changed ones first
    diff = {k: (theirs.get(k), ours.get(k)) for k in keys if theirs.get(k) != ours.get(k)}
    text = str(dict(list(diff.items())[:shown])) + (f" and {len(diff) - shown} more" if len(diff) > shown else "")
    first = next(iter(diff), "")
    name = first.removeprefix("model.")
    flag = (name in {f.name for s in settings for f in dataclasses.fields(s)} if first.startswith("model.")
            else first in fixed_settings(*settings))
    if flag and theirs.get(first) is not None:
        text += f" (--{name} {theirs[first]})"
    return text


__all__ = ["CONFIG_NOISE", "difference", "model_option_defaults", "run_fingerprint", "saved_config", "with_new_settings"]
