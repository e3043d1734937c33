"""Saving inside the loop without the libraries' noise: transformers draws a "Writing model shards" bar for every
``save_pretrained`` (a run that keeps its best weights saves often, each a carriage-return bar in the middle of the
log), and accelerate's ``save_state`` warns at every checkpoint that it "removed shared tensor
{'lm_head.weight'} ... check by verifying" although the head is tied on purpose and comes back tied on loading
(the resume tests reproduce uninterrupted runs bit for bit from those files). Only that warning, for the model's
own tied names, is dropped; any other shared tensor is still reported."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import torch

ACCELERATE_SAVE_LOGGER = "accelerate.utils.other"
"""The logger of accelerate's ``clean_state_dict_for_safetensors`` (accelerate 1.x: ``get_logger(__name__)``)."""


def tied_names(model: torch.nn.Module | None) -> frozenset[str]:
    """The parameter names ``model`` ties to another (transformers' ``_tied_weights_keys``: a dict target -> source
    in transformers 5, a list before), when its config ties them; empty otherwise."""
    if model is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return frozenset()
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return frozenset(keys.keys() if isinstance(keys, dict) else keys)


class TiedHeadFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...}" record when every name in it is one of ``tied`` (possibly
    under a wrapper's prefix, ``module.lm_head.weight``)."""

    def __init__(self, tied: frozenset[str]):
        super().__init__()
        self.tied = tied

    def _is_tied(self, name: str) -> bool:
        return any(name == t or name.endswith("." + t) for t in self.tied)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # accelerate's adapter prefixes "[RANK 0] "
        found = re.search(r"Removed shared tensor (.*?) while saving", message)
        if found is None:
            return True
        names = re.findall(r"'([^']+)'", found.group(1))
        return not (names and all(self._is_tied(n) for n in names))


@contextlib.contextmanager
def quiet_saves(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Inside: no transformers progress bars, and no accelerate warning about ``model``'s tied weights."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    tied = tied_names(model)
    logger = logging.getLogger(ACCELERATE_SAVE_LOGGER)
    drop = TiedHeadFilter(tied) if tied else None
    if drop is not None:
        logger.addFilter(drop)
    try:
        yield
    finally:
        if drop is not None:
            logger.removeFilter(drop)
        if bars:
            hf_logging.enable_progress_bar()
