"""Fine-tuning task: any causal LM (Hub id or local dir; Pythia-1.4B is the headline) on a text or instruction set.

The memory tier (``--tier lora|qlora|full|adamw8bit``) decides how the base is loaded (bf16, nf4, fp32); the loss
goes through ``causal_lm_loss_from_hidden`` so the (B, T, vocab) fp32 logits are never built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..budget.shape import ModelShape, RunShape
from ..data.chat import prepare_chat, save_generation_config
from ..data.corpus import load_text_dataset
from ..data.instruct import IGNORE, build_rows, instruction_splits
from ..data.packing import pack_dataset
from ..data.tokenizer import no_eos_message, tokenizer_hash
from ..errors import DataError, SettingsError, require_model
from ..evaluation.text import score_rows
from ..finetune import (BASE_RECORD, base_digest, check_base, merge_and_save, packing_leak, packing_tolerance,
                        resolve_base, save_adapter)
from ..hub.checks import check_dataset, check_hub_model
from ..models.causal_lm_loss import causal_lm_loss_from_hidden
from ..options import ADAPTER_TIERS
from ..settings import TrainSettings
from ..tiers.load import count_parameters, is_4bit, load_base_model
from ..train import SampleOrder, TaskPlan
from ..train.artifacts import FEW_VALIDATION_TOKENS
from ..train.parallel import is_sharded
from ..verify import check_saved
from .packed import PackedTokensTask
from .settings import FinetuneSettings


class FinetuneTask(PackedTokensTask):
    def __init__(self, cfg: FinetuneSettings):
        self.cfg = cfg

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        cfg = self.cfg
        self.settings, self.accelerator = settings, accelerator
        if cfg.merge and settings.tier not in ADAPTER_TIERS:
            accelerator.print(f"note: --merge folds an adapter into its base; tier {settings.tier} trains every "
                              "weight, so the saved model is already whole (no merged/ folder)")
        require_model(cfg.model, "base model")
        check_saved(cfg.model, cfg.verify, "--model")
        check_base(cfg.model, cfg.gguf_file)
        if not Path(cfg.model).expanduser().exists():
            check_hub_model(cfg.model, "base model", filename=cfg.gguf_file or "config.json")
        check_dataset(cfg.dataset)
        with accelerator.main_process_first():
            self.base, self.base_info = resolve_base(cfg.model, cfg.gguf_file)
        self.base_digest = None  # what the adapter records of its base, hashed while the base loads
        if settings.tier in ADAPTER_TIERS and accelerator.is_main_process:
            pool = ThreadPoolExecutor(1, thread_name_prefix="hf_cgpu-base-digest")
            self.base_digest = pool.submit(base_digest, self.base)
            pool.shutdown(wait=False)
        self.tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_source(),
                                                       trust_remote_code=cfg.trust_remote_code)
        if self.tokenizer.eos_token_id is None:  # which file lost it, else that documents could not be separated
            raise DataError(no_eos_message(self.tokenizer, f"tokenizer of {cfg.model}"))
        self.end_of_turn = self.tokenizer.eos_token_id  # an instruction run: what closes its template's turns
        device_map = {"": accelerator.device} if settings.tier == "qlora" and accelerator.device.type == "cuda" else None
        model = load_base_model(self.base, settings.tier, device_map=device_map, trust_remote_code=cfg.trust_remote_code,
                                device=accelerator.device)
        model = self._start_from(model, accelerator)
        if settings.tier == "lora" and model.dtype == torch.float32:
            accelerator.print("lora on a CPU without bf16 arithmetic (AVX512-BF16, AMX): the frozen base is kept in "
                              "fp32, where bf16 matmuls would be emulated several times slower")
        shape = self._model_shape(model.config)
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if shape is None and limit and cfg.seq_len > limit:
            raise SettingsError(f"--seq_len {cfg.seq_len} exceeds the model's {limit} positions; use --seq_len {limit}")
        if shape is not None and (note := shape.positions_note(cfg.seq_len)):  # a position table refuses
            accelerator.print(note)
        self.instruct = self._load_data(accelerator, model)
        _, total = count_parameters(model)
        accelerator.print(f"{cfg.model}: {total / 1e6:.0f}M parameters, tier {settings.tier}; "
                          f"train {self._data_summary()}")
        # a pretrained base starts well below ln(vocab): no label-leak check
        return TaskPlan(model, shape=self._run_shape(shape))

    def _tokenizer_source(self) -> str:
        """Where the tokenizer loads from: the base."""
        return self.base

    def _start_from(self, model, accelerator):
        """The model training starts from, given the base as loaded: the base (the tiers add the adapters)."""
        return model

    def _data_summary(self) -> str:
        cfg = self.cfg
        if not self.instruct:
            return f"{self.train_data.n_tokens:,} tokens of text, windows of {cfg.seq_len}"
        rows = self.train_rows
        dropped = (f" ({rows.n_cut_to_prompt} of them before their first response token: left out, raise "
                   "--seq_len to train on them)" if rows.n_cut_to_prompt else "")
        return (f"{rows.n_examples:,} instruction examples ({self.fmt} rows, chat template: "
                f"{'yes' if getattr(self.tokenizer, 'chat_template', None) else 'no'}), "
                f"{rows.n_truncated} longer than {cfg.seq_len + 1} tokens cut{dropped}; {self._layout()}; "
                "loss on the responses only")

    def _load_data(self, accelerator, model) -> bool:
        """Instruction rows (True) or a packed text stream (False), by ``data_format`` and the columns."""
        cfg = self.cfg
        source = None if cfg.dataset == "builtin" else cfg.dataset
        found = instruction_splits(source, cfg.data_format, cfg.text_column, skip_bad_rows=cfg.skip_bad_rows,
                                   log=accelerator.print, tokenizer=self.tokenizer)
        if found is not None:
            splits, self.fmt = found
            self.end_of_turn, append = prepare_chat(self.tokenizer, cfg.model, accelerator.print)
            if cfg.packing and not self._packing_holds(model, accelerator):
                self.cfg = cfg = dataclasses.replace(cfg, packing=False)  # what the run records and resumes with
            self.train_rows = build_rows(splits["train"], self.tokenizer, cfg.seq_len, self.fmt, "the train split",
                                         append, packing=cfg.packing)
            self.val_rows = build_rows(splits["validation"], self.tokenizer, cfg.seq_len, self.fmt,
                                       "the validation split", append)
            scored = int((self.val_rows.targets[:, 1:] != IGNORE).sum())
            if scored < FEW_VALIDATION_TOKENS:
                accelerator.print(f"note: the validation split holds {self.val_rows.n_examples:,} examples, {scored:,} "
                                  "response tokens: a loss on so few is mostly noise (which examples were held out "
                                  "moves it more than training does); a validation split of more examples makes "
                                  "val_loss against base_val_loss mean something")
            return True
        ds = load_text_dataset(source, text_column=cfg.text_column, log=accelerator.print)
        with accelerator.main_process_first():
            kw = dict(seq_len=cfg.seq_len, cache_dir=cfg.cache_dir or None, num_proc=cfg.num_proc or None,
                      text_column=cfg.text_column, log=accelerator.print)
            self.train_data = pack_dataset(ds["train"], self.tokenizer, split="train", **kw)
            self.val_data = pack_dataset(ds["validation"], self.tokenizer, split="validation", **kw)
        return False

    def _packing_holds(self, model, accelerator) -> bool:
        """Whether packed rows keep this base's examples apart: ``packing_leak`` within ``packing_tolerance``, on the
        device the run trains on (the base goes there now; ``prepare`` would put it there). Otherwise one line says
        why and the run falls back to one example per row, or, for --packing true given on the command line,
        refuses."""
        if not is_sharded(accelerator) and not is_4bit(model) and not getattr(model, "hf_device_map", None):
            model.to(accelerator.device)
        leak = packing_leak(model, accelerator.autocast)
        tolerance = packing_tolerance(model, getattr(accelerator, "mixed_precision", "no"))
        if leak <= tolerance:
            return True
        why = (f"in a packed row the second example's next-token probabilities move by up to {leak:.2g} (total "
               f"variation; rounding alone stays under {tolerance:g}) from what it gets alone: this "
               f"{model.config.model_type} base does not keep packed examples apart by restarting positions")
        if "packing" in self.cfg.given_flags.split(","):
            raise SettingsError(f"--packing true: {why}; pass --packing false (one example per row)")
        accelerator.print(f"note: packing off: {why}; one example per row instead (--packing false)")
        return False

    def _layout(self) -> str:
        rows = self.train_rows
        if rows.position_ids is None:
            return "one example per row"
        return f"packed into {len(rows):,} rows, {rows.n_tokens / rows.ids.numel():.1%} of their slots tokens"

    # ---- instruction rows: one example (or several packed) per row, targets only on the responses
    def sample_order(self, seed: int):
        if not self.instruct:
            return super().sample_order(seed)
        return SampleOrder(len(self.train_rows), seed)

    def train_batch(self, indices, device, generator) -> dict:
        if not self.instruct:
            return super().train_batch(indices, device, generator)
        rows = self.train_rows
        batch = {"input_ids": rows.ids[indices], "targets": rows.targets[indices]}
        if rows.position_ids is not None:
            batch["position_ids"] = rows.position_ids[indices]
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        # the examples' tokens among the inputs (a row's last slot is a target only), counted on the host
        batch["tokens"] = int(rows.row_tokens[indices].clamp(max=rows.seq_len).sum())
        return batch

    def units(self, batch) -> int:
        """Tokens of the examples, not the padding after them (instruction rows); every input token of text."""
        return batch["tokens"] if "tokens" in batch else super().units(batch)

    def evaluate(self, model, settings, device) -> dict[str, float]:
        if not self.instruct:
            return super().evaluate(model, settings, device)
        return score_rows(lambda x, y: self.target_loss(model, x, y), self.val_rows, settings.micro_batch_size,
                          device, prefix="val_")

    @staticmethod
    def _model_shape(config) -> ModelShape | None:
        """The base's shape for the ledger (autofit, OOM advice, MFU); None for a config it cannot read."""
        try:
            return ModelShape.from_config(config)
        except SettingsError:
            return None

    def _run_shape(self, shape: ModelShape | None) -> RunShape | None:
        if shape is None:
            return None
        packed = bool(self.instruct and self.train_rows.position_ids is not None)
        return RunShape(shape, self.cfg.seq_len, self.cfg.loss_chunk_size, loss_in_forward=False, packed=packed)

    @property
    def card(self) -> str | None:
        """An adapter's card; a fully fine-tuned model is the base's kind, which no card of ours describes."""
        return "lora" if self.settings.tier in ADAPTER_TIERS else None

    def target_loss(self, model, inputs, targets, **kwargs) -> torch.Tensor:
        """``kwargs``: ``position_ids`` of packed rows (restarts mark where an example starts)."""
        if getattr(self.accelerator, "num_processes", 1) > 1:
            # through the DDP/FSDP2 wrapper's forward: DDP syncs gradients only for a forward it ran, FSDP2 gathers
            # the root's weights (embeddings, head) in its forward hook. The model's own loss (full logits).
            targets = targets.contiguous()
            return model(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False, **kwargs).loss
        with self.accelerator.autocast():  # the backbone is called directly, outside prepare's autocast
            return causal_lm_loss_from_hidden(model, inputs, targets, chunk_size=self.cfg.loss_chunk_size, shift=False,
                                              **kwargs)

    def save_pretrained(self, model, output_dir: Path) -> None:
        if self.settings.tier in ADAPTER_TIERS:
            save_adapter(model, output_dir)
            self._record_base(output_dir)
            self.tokenizer.save_pretrained(str(output_dir))  # before merging: merged/ gets a copy
            if self.cfg.merge:
                merge_and_save(self.base, output_dir, output_dir / "merged", dtype=getattr(torch, self.cfg.merge_dtype),
                               trust_remote_code=self.cfg.trust_remote_code, quantized=self.settings.tier == "qlora",
                               log=self.accelerator.print)
                self.tokenizer.save_pretrained(str(output_dir / "merged"))
                self._save_generation_config(output_dir / "merged")
        else:
            model.save_pretrained(str(output_dir))
            self.tokenizer.save_pretrained(str(output_dir))
        self._save_generation_config(output_dir)

    def _save_generation_config(self, folder: Path) -> None:
        """The base's generation config with the end-of-turn id among its EOS ids: generation stops there."""
        save_generation_config(folder, self.base, [self.end_of_turn, self.tokenizer.eos_token_id],
                               self.tokenizer.pad_token_id)

    def _record_base(self, folder: Path) -> None:
        """adapter_config.json names the folder the base loads from (the de-quantised GGUF, say), and the card
        reads ``base_model`` (the Hub id given, else --model) from ``base_model.json``, which also records the tier (a
        QLoRA adapter is merged into the de-quantised nf4 weights it was trained against) and the base's digest
        (``finetune.base_digest``: loading the adapter checks it)."""
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        config["base_model_name_or_path"] = self.base
        path.write_text(json.dumps(config, indent=2))
        digest = self.base_digest.result() if self.base_digest is not None else base_digest(self.base)
        (folder / BASE_RECORD).write_text(json.dumps(
            {"base_model": self.cfg.base_model_name or self.cfg.model, "load_from": self.base, **self.base_info,
             "tier": self.settings.tier, "base_digest": digest},
            indent=2))

    def save_best(self, model, folder: Path) -> None:
        """The adapter (or model) and tokenizer, never the merged copy: the best weights are saved often."""
        if self.settings.tier in ADAPTER_TIERS:
            save_adapter(model, folder)
            self._record_base(folder)
        else:
            model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))
        self._save_generation_config(folder)

    def data_fingerprint(self) -> dict[str, Any]:
        """The tokenizer's content and the training data's content (the rows or the packed stream)."""
        if self.instruct:
            train = [self.train_rows.ids, self.train_rows.targets, self.train_rows.position_ids]
            data = {"train_data": _tensors_hash(*[t for t in train if t is not None]),
                    "validation_data": _tensors_hash(self.val_rows.ids, self.val_rows.targets)}
        else:
            data = {"train_data": self.train_data.content_hash, "validation_data": self.val_data.content_hash}
        return {"tokenizer": tokenizer_hash(self.tokenizer), **data}


def _tensors_hash(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()
