"""Causal-LM pretraining task: tokenizer + packed blocks + the hf_cgpu GPT, plugged into the one loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..budget.shape import ModelShape, RunShape
from ..errors import SettingsError
from ..models.cgpt import CgptConfig, CgptForCausalLM
from ..settings import TrainSettings
from ..train import TaskPlan
from .packed import PackedTokensTask


@dataclass(frozen=True)
class GPTSettings:
    """Model shape and data of a from-scratch GPT run."""

    n_layer: int = 12
    """Transformer blocks."""
    n_embd: int = 768
    """Residual width; must be divisible by n_head."""
    n_head: int = 12
    """Attention heads."""
    mlp_ratio: int = 4
    """MLP width = mlp_ratio * n_embd."""
    dropout: float = 0.0
    """Dropout (0 for single-epoch pretraining)."""
    bias: bool = False
    """Biases in linears and LayerNorms."""
    seq_len: int = 1024
    """Tokens per training sequence; also the model's n_positions."""
    vocab_size: int = 32000
    """Tokenizer vocabulary to train (ignored when --tokenizer is given: its size is used)."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the fp32 loss (0 = materialise all logits)."""
    data_order: str = "shifted"
    """How training windows are cut from the token stream: shifted (a new random offset and order every epoch),
    random (nanoGPT: uniform random starts) or fixed (the same blocks every epoch; memorises a small corpus)."""
    dataset: str = "builtin"
    """Text source: 'builtin' (Python's pydoc topics), a directory/files of parquet/json/txt, or a Hub id."""
    text_column: str = "text"
    """Column holding the documents."""
    tokenizer: str = ""
    """Existing tokenizer directory to use; empty = train a byte-level BPE on the training split."""
    tokenizer_train_docs: int = 50000
    """Documents sampled to train the tokenizer (more = slower, slightly better compression)."""
    num_proc: int = 0
    """Processes for tokenisation (0 = automatic)."""
    cache_dir: str = ""
    """Where packed token files are cached (empty = ~/.cache/hf_cgpu/packed or $HF_CGPU_CACHE/packed)."""
    prompts: str = ""
    """'|'-separated prompts continued at the end of training (empty = taken from validation text)."""
    max_new_tokens: int = 60
    """Tokens generated per prompt at the end of training."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise SettingsError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"use n_head in {[h for h in range(1, 33) if self.n_embd % h == 0]}"
            )
        if self.seq_len < 2:
            raise SettingsError("seq_len must be at least 2")
        from ..data.text import DATA_ORDERS

        if self.data_order not in DATA_ORDERS:
            raise SettingsError(f"data_order={self.data_order!r}; choose one of {', '.join(DATA_ORDERS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise SettingsError(f"dropout={self.dropout} must be in [0, 1); e.g. 0.1 for many epochs of a small corpus")

    def model_config(self, vocab_size: int, eos_token_id: int) -> CgptConfig:
        return CgptConfig(
            vocab_size=vocab_size, n_positions=self.seq_len, n_embd=self.n_embd, n_layer=self.n_layer,
            n_head=self.n_head, mlp_ratio=self.mlp_ratio, dropout=self.dropout, bias=self.bias,
            loss_chunk_size=self.loss_chunk_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
        )

    def run_shape(self, name: str = "", vocab_size: int | None = None) -> RunShape:
        """What the ledger needs of this GPT, from the config training builds (``vocab_size``: the tokenizer's)."""
        return cgpt_run_shape(self.model_config(vocab_size or self.vocab_size, eos_token_id=0), name)


def cgpt_run_shape(config: CgptConfig, name: str = "") -> RunShape:
    """Our GPT's run shape: the sequence is its position table, the loss chunk its config's, the loss in forward."""
    return RunShape(ModelShape.from_config(config, name or "cgpt"), config.n_positions, config.loss_chunk_size)


TOKENIZER_KEY = "hf_cgpu_tokenizer.json"
"""Beside a tokenizer the run trained: what it was trained from (a fresh run reuses it only when that matches)."""

MANY_EPOCHS = 4  # Muennighoff et al. (2023): up to ~4 epochs are nearly as good as fresh data, then returns drop
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio (the seed's table uses it too)


def epoch_plan(settings: TrainSettings, seq_len: int, corpus_tokens: int, num_params: int, processes: int = 1) -> list[str]:
    """Lines saying how many epochs the planned tokens are, and a warning where that many epochs over-fit."""
    per_step = settings.samples_per_step(processes) * seq_len
    planned = settings.max_steps * per_step
    epochs = planned / max(1, corpus_tokens)
    lines = [f"plan: {settings.max_steps:,} steps x {per_step:,} tokens = {planned / 1e6:,.1f}M tokens = "
             f"{epochs:.1f} epochs of the {corpus_tokens / 1e6:,.2f}M-token training stream"
             + (f" (or fewer: --max_minutes {settings.max_minutes:g})" if settings.max_minutes else "")]
    if epochs > MANY_EPOCHS:
        supported = corpus_tokens / TOKENS_PER_PARAM
        lines.append(
            f"warning: {epochs:.0f} epochs of one corpus over-fit (beyond ~{MANY_EPOCHS} epochs repeated tokens are "
            f"worth much less than new ones); at {TOKENS_PER_PARAM} tokens/parameter this corpus supports a "
            f"~{supported / 1e6:.2f}M-parameter model per epoch (this one has {num_params / 1e6:.1f}M). Use more "
            f"data, a smaller model or dropout (--dropout 0.1); validation picks the best weights "
            f"(--load_best_at_end true, --early_stopping_patience N)"
        )
    return lines


class CausalLMTask(PackedTokensTask):
    card_kind = "gpt"

    def __init__(self, cfg: GPTSettings):
        self.cfg = cfg
        self.tokenizer = None
        self.data_order = cfg.data_order

    # ---- data and model
    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        from ..data.text import check_vocab, load_text_dataset, pack_dataset

        cfg, out = self.cfg, Path(settings.output_dir)
        ds = load_text_dataset(None if cfg.dataset == "builtin" else cfg.dataset, text_column=cfg.text_column)
        with accelerator.main_process_first():
            self.tokenizer = self._tokenizer(ds, out, resume=bool(settings.resume_from_checkpoint))
            cache = cfg.cache_dir or None
            kw = dict(seq_len=cfg.seq_len, cache_dir=cache, num_proc=cfg.num_proc or None, text_column=cfg.text_column)
            self.train_data = pack_dataset(ds["train"], self.tokenizer, **kw)
            self.val_data = pack_dataset(ds["validation"], self.tokenizer, **kw)
        vocab = len(self.tokenizer)
        self.val_texts = [t for t in ds["validation"][cfg.text_column][:50] if t.strip()]
        config = cfg.model_config(vocab, self.tokenizer.eos_token_id)
        check_vocab(self.tokenizer, config.vocab_size)
        model = CgptForCausalLM(config)
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        accelerator.print(
            f"GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), {num_params / 1e6:.2f}M parameters, "
            f"vocab {vocab}, seq {cfg.seq_len}, dropout {cfg.dropout}; train {self.train_data.n_tokens:,} tokens, "
            f"validation {self.val_data.n_tokens:,} tokens ({cfg.data_order} windows)"
        )
        if self.val_data.n_tokens < cfg.seq_len + 1:
            raise SettingsError(f"validation split has fewer than seq_len+1={cfg.seq_len + 1} tokens; lower --seq_len")
        for line in epoch_plan(settings, cfg.seq_len, self.train_data.n_tokens, num_params,
                               accelerator.num_processes):
            accelerator.print(line)
        return TaskPlan(model, expected_initial_loss=math.log(vocab), shape=cgpt_run_shape(config))

    def _tokenizer(self, ds, out: Path, resume: bool):
        """--tokenizer, else the one this output folder's run trained (reused when resuming, or when it was trained
        from the same data and settings), else a new byte-level BPE saved atomically to ``output_dir/tokenizer``."""
        from transformers import AutoTokenizer

        from ..data.text import source_fingerprint, train_tokenizer
        from ..integrity import atomic_dir, atomic_write_json

        cfg = self.cfg
        if cfg.tokenizer:
            return AutoTokenizer.from_pretrained(cfg.tokenizer)
        saved = out / "tokenizer"
        key = {"vocab_size": cfg.vocab_size, "tokenizer_train_docs": cfg.tokenizer_train_docs,
               "text_column": cfg.text_column, "source": source_fingerprint(ds["train"], cfg.text_column)}
        if (saved / "tokenizer.json").is_file():
            try:
                made_from = json.loads((saved / TOKENIZER_KEY).read_text())
            except (OSError, ValueError):
                made_from = None
            if resume or made_from == key:  # resume: the same ids as the checkpoint (its fingerprint checks them)
                return AutoTokenizer.from_pretrained(str(saved))
        train = ds["train"]
        if len(train) > cfg.tokenizer_train_docs:
            train = train.shuffle(seed=0).select(range(cfg.tokenizer_train_docs))
        tok = train_tokenizer(train[cfg.text_column], vocab_size=cfg.vocab_size)
        with atomic_dir(saved) as tmp:  # a kill never leaves a 0-byte tokenizer_config.json behind
            tok.save_pretrained(str(tmp))
            atomic_write_json(tmp / TOKENIZER_KEY, key)
        return tok

    def target_loss(self, model, inputs, targets) -> torch.Tensor:
        # return_logits=False: validation (eval mode) needs only the loss, so the chunked loss builds no logits there either
        return model(input_ids=inputs, shift_labels=targets, use_cache=False, return_logits=False).loss

    def save_pretrained(self, model, output_dir: Path) -> None:
        model.save_pretrained(str(output_dir))
        self.tokenizer.save_pretrained(str(output_dir))

    def fingerprint(self) -> dict[str, Any]:
        """Model shape, the tokenizer's content and the packed data's content (not the path it was read from)."""
        from ..data.text import tokenizer_hash

        c = self.cfg
        return {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "seq_len": c.seq_len,
                "vocab_size": len(self.tokenizer), "mlp_ratio": c.mlp_ratio, "bias": c.bias, "dropout": c.dropout,
                "tokenizer": tokenizer_hash(self.tokenizer), "train_data": self.train_data.content_hash,
                "validation_data": self.val_data.content_hash, "data_order": c.data_order}

    def sample_prompts(self) -> list[str]:
        if self.cfg.prompts:
            return [p for p in self.cfg.prompts.split("|") if p]
        return [t[:24] for t in self.val_texts[:3]]
