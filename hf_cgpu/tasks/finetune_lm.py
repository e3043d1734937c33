"""Fine-tuning task: any causal LM (Hub id or local dir; Pythia-1.4B is the headline) on a text or instruction set.

The memory tier (``--tier lora|qlora|full|adamw8bit``) decides how the base is loaded (bf16, nf4, fp32); the loss
goes through ``causal_lm_loss_from_hidden`` so the (B, T, vocab) fp32 logits are never built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..budget.shape import ModelShape, RunShape
from ..errors import SettingsError
from ..settings import TrainSettings
from ..train import TaskPlan
from .packed import PackedTokensTask


@dataclass(frozen=True)
class FinetuneSettings:
    """Base model and data of a fine-tuning run."""

    model: str = "EleutherAI/pythia-1.4b"
    """Base causal LM: a Hub id (needs network once) or a local directory (our own GPT works too)."""
    dataset: str = "builtin"
    """Text or instruction data: a directory/files of parquet/json/txt, a Hub id, or 'builtin'."""
    text_column: str = "text"
    """Column with plain text; instruction sets (instruction/input/output or prompt/response) are formatted."""
    seq_len: int = 1024
    """Tokens per training sequence."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the fp32 loss (the full logits are never materialised)."""
    merge: bool = False
    """Also write the adapter merged into a bf16 copy of the base (output_dir/merged)."""
    trust_remote_code: bool = False
    """Allow the base model's own code from its repository."""
    num_proc: int = 0
    """Processes for tokenisation (0 = automatic)."""
    cache_dir: str = ""
    """Where packed token files are cached (empty = default cache)."""


class FinetuneTask(PackedTokensTask):
    train_mode = "finetune"

    def __init__(self, cfg: FinetuneSettings):
        self.cfg = cfg

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        from transformers import AutoTokenizer

        from ..data.text import load_text_dataset, pack_dataset
        from ..tiers import count_parameters, load_base_model

        cfg = self.cfg
        self.settings, self.accelerator = settings, accelerator
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        if self.tokenizer.eos_token_id is None:
            raise SettingsError(f"tokenizer of {cfg.model} has no eos token; documents could not be separated")
        device_map = {"": accelerator.device} if settings.tier == "qlora" and accelerator.device.type == "cuda" else None
        model = load_base_model(cfg.model, settings.tier, device_map=device_map, trust_remote_code=cfg.trust_remote_code)
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if limit and cfg.seq_len > limit:
            raise SettingsError(f"--seq_len {cfg.seq_len} exceeds the model's {limit} positions; use --seq_len {limit}")
        ds = load_text_dataset(None if cfg.dataset == "builtin" else cfg.dataset, text_column=cfg.text_column)
        with accelerator.main_process_first():
            kw = dict(seq_len=cfg.seq_len, cache_dir=cfg.cache_dir or None, num_proc=cfg.num_proc or None,
                      text_column=cfg.text_column)
            self.train_data = pack_dataset(ds["train"], self.tokenizer, **kw)
            self.val_data = pack_dataset(ds["validation"], self.tokenizer, **kw)
        _, total = count_parameters(model)
        accelerator.print(f"{cfg.model}: {total / 1e6:.0f}M parameters, tier {settings.tier}; train "
                          f"{self.train_data.n_tokens:,} tokens, windows of {cfg.seq_len}")
        # a pretrained base starts well below ln(vocab): no label-leak check
        return TaskPlan(model, shape=self._run_shape(model.config))

    def _run_shape(self, config) -> RunShape | None:
        """The base's shape for the ledger (autofit, OOM advice, MFU); None for a config it cannot read."""
        try:
            shape = ModelShape.from_config(config)
        except SettingsError:
            return None
        return RunShape(shape, self.cfg.seq_len, self.cfg.loss_chunk_size, loss_in_forward=False)

    @property
    def card_kind(self) -> str | None:
        return "lora" if self.settings.tier in ("lora", "qlora") else None

    def target_loss(self, model, inputs, targets) -> torch.Tensor:
        from ..tiers import causal_lm_loss_from_hidden

        with self.accelerator.autocast():  # the backbone is called directly, outside prepare's autocast
            return causal_lm_loss_from_hidden(model, inputs, targets, chunk_size=self.cfg.loss_chunk_size, shift=False)

    def save_pretrained(self, model, output_dir: Path) -> None:
        from ..finetune import merge_and_save, save_adapter

        if self.settings.tier in ("lora", "qlora"):
            save_adapter(model, output_dir)
            if self.cfg.merge:
                merge_and_save(self.cfg.model, output_dir, output_dir / "merged",
                               trust_remote_code=self.cfg.trust_remote_code)
        else:
            model.save_pretrained(str(output_dir))
        self.tokenizer.save_pretrained(str(output_dir))

    def save_best(self, model, folder: Path) -> None:
        """The adapter (or model) and tokenizer, never the merged copy: the best weights are saved often."""
        from ..finetune import save_adapter

        if self.settings.tier in ("lora", "qlora"):
            save_adapter(model, folder)
        else:
            model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))

    def fingerprint(self) -> dict[str, Any]:
        s = self.settings
        return {"model": self.cfg.model, "tier": s.tier, "lora_r": s.lora_r, "seq_len": self.cfg.seq_len,
                "dataset": self.cfg.dataset}

