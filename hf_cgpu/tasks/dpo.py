"""DPO on a LoRA adapter: preference pairs, the SFT adapter continued, the reference computed once.

The policy is the base with the SFT adapter of ``--adapter`` loaded trainable (or a new LoRA, ``--require_adapter
false``). The reference policy is that same model as it starts: before the first step, one pass without gradients
over every training and held-out pair records each answer's summed log-probability, so no second copy of the base
(or of the adapter) exists while training. The pass is a pure function of the base, the adapter's files and the
data, so a resumed run computes the same reference (the adapter's files are in the resume fingerprint), and the
adapter folder is only read: the trained adapter goes to ``output_dir``.

Loss (sigmoid DPO, Rafailov et al.): ``-log sigmoid(r_chosen - r_rejected)`` with the implicit reward ``r = beta
(log pi(answer | prompt) - log pi_ref(answer | prompt))``, summed over the answer's tokens (the response-only targets
of instruction fine-tuning). At the first step policy = reference: the loss is log 2 and every reward 0. Held-out
pairs are scored for the DPO loss, the reward accuracy (the share of pairs whose chosen answer earns the larger
reward) and the mean margin.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data.chat import prepare_chat
from ..data.preference import PairRows, build_pair_rows, preference_splits
from ..data.tokenizer import tokenizer_hash
from ..errors import MissingPathError, SettingsError
from ..finetune import BASE_RECORD, TOKENIZER_FILES, load_adapter
from ..integrity import sha256_file
from ..models.causal_lm_loss import token_logprobs_from_hidden
from ..tiers.load import is_4bit
from ..train import SampleOrder, TaskPlan
from ..train.parallel import is_sharded
from .finetune_lm import FinetuneTask, _tensors_hash
from .settings import DPOSettings

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
"""The files of a peft adapter folder that define its weights."""


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean sigmoid DPO loss, rewards) of pairs whose summed answer log-probabilities are ``policy`` and ``reference``
    ((n, 2): chosen, rejected). ``rewards`` (n, 2) = ``beta (policy - reference)``."""
    rewards = beta * (policy - reference.to(policy))
    return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean(), rewards


def adapter_files_hash(folder: str | Path) -> str:
    """SHA-256 over the files that define an adapter's weights (``ADAPTER_FILES`` present in ``folder``)."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = Path(folder) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


class DPOTask(FinetuneTask):
    unit = "pair"
    best_metric = "val_loss"

    def __init__(self, cfg: DPOSettings):
        self.cfg = cfg

    def setup(self, settings, accelerator) -> TaskPlan:
        if accelerator.num_processes > 1:
            raise SettingsError("hf-cgpu train dpo runs in one process (its loss calls the backbone, outside a "
                                "data-parallel wrapper); drop --num_processes / --config_file")
        self._check_adapter_folder(settings)
        plan = super().setup(settings, accelerator)
        from ..budget import flops_per_token

        if plan.shape is None:
            return plan
        per_token = flops_per_token(plan.shape.model, plan.shape.setup(settings), count_recompute=False)
        return dataclasses.replace(plan, flops_per_unit=per_token * self.train_rows.n_tokens / self.train_rows.n_pairs)

    # ---- the SFT adapter: checked, loaded trainable, its tokenizer (and chat template) used
    def _check_adapter_folder(self, settings) -> None:
        cfg = self.cfg
        if not cfg.adapter:
            return
        folder = Path(cfg.adapter).expanduser()
        if not folder.is_dir():
            raise MissingPathError(f"--adapter {cfg.adapter} does not exist; pass the output_dir of hf-cgpu train lora")
        if not (folder / "adapter_config.json").is_file():
            raise SettingsError(f"--adapter {cfg.adapter} holds no adapter_config.json: pass the output_dir of "
                                "hf-cgpu train lora (a LoRA adapter folder), not a model or a checkpoint")
        out = Path(settings.output_dir).expanduser().resolve()
        if out == folder.resolve() or folder.resolve() in out.parents:
            raise SettingsError(f"--output_dir {settings.output_dir} is (inside) --adapter {cfg.adapter}: the SFT "
                                "adapter is the reference and is only read; write the DPO adapter to another folder")

    def _tokenizer_source(self) -> str:
        """The adapter's folder where it holds a tokenizer (the chat template its SFT run trained with), else the
        base."""
        folder = Path(self.cfg.adapter).expanduser() if self.cfg.adapter else None
        if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
            return str(folder)
        return self.base

    def _start_from(self, model, accelerator):
        cfg = self.cfg
        if not cfg.adapter:
            accelerator.print("no --adapter: a new LoRA on the base, the base itself the reference policy")
            return model
        self._check_same_base()
        try:
            model = load_adapter(model, Path(cfg.adapter).expanduser(), trainable=True)
        except (RuntimeError, ValueError, KeyError) as err:  # peft's size mismatch or unknown modules
            first = str(err).strip().splitlines()[0][:200]
            raise SettingsError(f"--adapter {cfg.adapter} does not fit --model {cfg.model} ({first}): pass the base "
                                "it was trained on") from None
        lora = model.peft_config["default"]
        given = [f"--{k}" for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
                 if k in self.settings.given_flags.split(",")]
        accelerator.print(f"continuing the SFT adapter {cfg.adapter} (r {lora.r}, alpha {lora.lora_alpha}); as it is, "
                          "it is the reference policy" + (f"; {', '.join(given)} do not apply to it" if given else ""))
        return model

    def _check_same_base(self) -> None:
        """The base the adapter recorded (``base_model.json``: its files' digest) is --model's; an adapter without
        that record, or a Hub base, is checked by loading it (peft refuses other shapes)."""
        cfg = self.cfg
        folder = Path(cfg.adapter).expanduser()
        record = folder / BASE_RECORD
        info = json.loads(record.read_text()) if record.is_file() else {}
        recorded = info.get("base_digest")
        now = self.base_digest.result() if self.base_digest is not None else None
        if recorded and now and recorded != now:
            differ = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
            raise SettingsError(f"{record}: field base_digest records another base ({info.get('load_from', '?')}) "
                                f"than --model {cfg.model} (differs in {', '.join(differ)}): a DPO run continues an "
                                "adapter on the base it was trained on; pass that --model, or train an SFT adapter on "
                                "this one first")

    # ---- data and the reference pass
    def _load_data(self, accelerator, model) -> bool:
        cfg = self.cfg
        self.end_of_turn, append = prepare_chat(self.tokenizer, cfg.model, accelerator.print)
        splits = preference_splits(cfg.dataset, self.tokenizer, cfg.seq_len, append, cfg.skip_bad_rows,
                                   accelerator.print)
        if cfg.packing and not self._packing_holds(model, accelerator):
            self.cfg = cfg = dataclasses.replace(cfg, packing=False)
        self.train_rows = build_pair_rows(splits["train"], self.tokenizer, cfg.seq_len, append, packing=cfg.packing)
        self.val_rows = build_pair_rows(splits["validation"], self.tokenizer, cfg.seq_len, append)
        if not is_sharded(accelerator) and not is_4bit(model) and not getattr(model, "hf_device_map", None):
            model.to(accelerator.device)
        started = time.perf_counter()
        self.reference = {name: self.pair_logprobs_of(model, rows, self.settings.micro_batch_size)
                          for name, rows in (("train", self.train_rows), ("validation", self.val_rows))}
        self.reference_seconds = time.perf_counter() - started
        pairs = self.train_rows.n_pairs + self.val_rows.n_pairs
        accelerator.print(f"reference: log-probabilities of {pairs:,} pairs' answers under the policy as it starts, "
                          f"computed once ({self.reference_seconds:.1f} s)")
        return True

    def on_saved(self, model, output_dir, log=print) -> dict[str, Any]:
        """The reference pass's cost beside the training figures: the pairs it scored and its seconds (outside
        train_seconds, which times the steps)."""
        return {"reference_pairs": self.train_rows.n_pairs + self.val_rows.n_pairs,
                "reference_seconds": round(self.reference_seconds, 2)}

    def pair_logprobs_of(self, model, rows: PairRows, units_per_batch: int) -> torch.Tensor:
        """(n_pairs, 2) summed answer log-probabilities of every pair of ``rows`` under ``model`` (eval mode, no
        gradients), on the host."""
        device = next(p.device for p in model.parameters())
        was_training = model.training
        model.eval()
        out = []
        try:
            with torch.no_grad():
                for start in range(0, len(rows), units_per_batch):
                    units = torch.arange(start, min(start + units_per_batch, len(rows)))
                    batch = {k: v.to(device) for k, v in rows.batch(units).items()}
                    out.append(self.pair_logprobs(model, batch).float().cpu())
        finally:
            model.train(was_training)
        return torch.cat(out)

    def pair_logprobs(self, model, batch: dict) -> torch.Tensor:
        """(n, 2) summed log-probability of the chosen and the rejected answer of each of the batch's n pairs."""
        inputs, targets, segments = batch["input_ids"][:, :-1], batch["targets"][:, 1:], batch["segments"][:, 1:]
        extra = {"position_ids": batch["position_ids"][:, :-1]} if "position_ids" in batch else {}
        with self.accelerator.autocast():
            logp = token_logprobs_from_hidden(model, inputs, targets, chunk_size=self.cfg.loss_chunk_size, **extra)
        n = batch["pair_index"].numel()
        # one (2n, tokens) 0/1 matrix sums each sequence: deterministic, unlike an atomic scatter on a GPU
        which = (segments.reshape(1, -1) == torch.arange(2 * n, device=segments.device)[:, None]).to(logp.dtype)
        return (which @ logp.reshape(-1)).view(n, 2)

    # ---- training
    def sample_order(self, seed: int):
        return SampleOrder(len(self.train_rows), seed)

    def train_batch(self, indices, device, generator) -> dict:
        batch = self.train_rows.batch(indices)
        batch["reference"] = self.reference["train"][batch["pair_index"]]
        pairs = int(batch["pair_index"].numel())
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        batch["pairs"] = pairs
        return batch

    def units(self, batch) -> int:
        return batch["pairs"]

    def loss(self, model, batch, generator) -> torch.Tensor:
        return dpo_loss(self.pair_logprobs(model, batch), batch["reference"], self.cfg.beta)[0]

    def evaluate(self, model, settings, device) -> dict[str, float]:
        policy = self.pair_logprobs_of(model, self.val_rows, settings.micro_batch_size)
        loss, rewards = dpo_loss(policy, self.reference["validation"], self.cfg.beta)
        margin = rewards[:, 0] - rewards[:, 1]
        return {"val_loss": loss.item(), "val_reward_accuracy": (margin > 0).float().mean().item(),
                "val_reward_margin": margin.mean().item(), "val_chosen_reward": rewards[:, 0].mean().item(),
                "val_rejected_reward": rewards[:, 1].mean().item(), "val_pairs": float(len(policy))}

    def _data_summary(self) -> str:
        rows, cfg = self.train_rows, self.cfg
        layout = (f"packed into {len(rows):,} rows of {2 * (cfg.seq_len + 1)} tokens, "
                  f"{rows.n_tokens / rows.ids.numel():.1%} of their slots tokens" if rows.position_ids is not None
                  else f"two padded rows of {cfg.seq_len + 1} tokens a pair")
        return (f"{rows.n_pairs:,} preference pairs ({self.val_rows.n_pairs:,} held out), {rows.n_truncated} answers "
                f"longer than {cfg.seq_len + 1} tokens cut; {layout}; DPO loss (beta {cfg.beta:g}) on the answers only")

    def _run_shape(self, shape):
        """A micro-batch of ``micro_batch_size`` pairs holds as many tokens as that many rows of twice --seq_len."""
        if shape is None:
            return None
        from ..budget.shape import RunShape

        return RunShape(shape, 2 * self.cfg.seq_len, self.cfg.loss_chunk_size, loss_in_forward=False,
                        packed=self.train_rows.position_ids is not None)

    def data_fingerprint(self) -> dict[str, Any]:
        """The tokenizer, the pairs' rows, and the SFT adapter's files (which the reference is computed from)."""
        train = [self.train_rows.ids, self.train_rows.targets, self.train_rows.segments, self.train_rows.pairs]
        if self.train_rows.position_ids is not None:
            train.append(self.train_rows.position_ids)
        return {"tokenizer": tokenizer_hash(self.tokenizer), "train_data": _tensors_hash(*train),
                "validation_data": _tensors_hash(self.val_rows.ids, self.val_rows.targets, self.val_rows.segments),
                "reference_adapter": adapter_files_hash(self.cfg.adapter) if self.cfg.adapter else "none"}
