"""Causal-LM pretraining task: tokenizer + packed blocks + the hf_cgpu GPT, plugged into the one loop."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from ..budget.auto import REGIMES, Regime, pressure, regime
from ..budget.card import run_card
from ..budget.shape import ModelShape, RunShape
from ..data.corpus import load_text_dataset
from ..data.packing import pack_dataset, source_fingerprint
from ..data.tokenizer import (cached_tokenizer, check_vocab, load_tokenizer, save_tokenizer, tokenizer_hash,
                              tokenizer_made_from, tokenizer_problem, train_tokenizer)
from ..data.windows import document_position_ids, replace_tokens
from ..errors import CheckpointError, DataError, SettingsError
from ..evaluation.text import cgpt_target_loss
from ..generate import continue_texts
from ..hub.checks import check_dataset
from ..models.cgpt.configuration_cgpt import CgptConfig
from ..models.cgpt.modeling_cgpt import CgptForCausalLM
from ..settings import TrainSettings
from ..train import TaskPlan
from ..train.parallel import is_sharded
from ..train.schedule import calibration_step
from .auto import resolve as resolve_auto
from .mtp import MTPHeads, annealed_weight, mtp_loss
from .packed import PackedTokensTask
from .settings import GPTSettings
from .teachers import Distiller


def cgpt_run_shape(config: CgptConfig, name: str = "", settings: GPTSettings | None = None,
                   stream_tokens: int = 0) -> RunShape:
    """Our GPT's run shape: the sequence is its position table, the loss chunk its config's, the loss in forward, a
    mask per row when it keeps attention within documents; ``settings``: the run's, for its multi-token heads and
    distillation teachers (``stream_tokens``: the training stream's, a teacher cache's positions)."""
    shape = ModelShape.from_config(config, name or "cgpt")
    return RunShape(shape, config.n_positions, config.loss_chunk_size, train_mode="pretrain",
                    packed=bool(getattr(config, "document_masking", False)),
                    **(settings.ledger_extras(shape, stream_tokens) if settings is not None else {}))


MANY_EPOCHS = 4
"""Muennighoff et al. (2023): up to ~4 epochs of repeated data are nearly as good as fresh data, then returns drop."""
TOKENS_PER_PARAM = 20
"""Chinchilla's compute-optimal tokens per parameter."""


def epoch_plan(settings: TrainSettings, seq_len: int, corpus_tokens: int, num_params: int, processes: int = 1,
               dropout: float = 0.0, auto: bool = False) -> list[str]:
    """Lines saying how many epochs the planned tokens are and, beyond ``MANY_EPOCHS`` of a model large for its
    corpus, whether the run has the regularisation ``--preset auto``'s rule gives that over-fit pressure (a note) or
    which of it is missing (a warning); nothing more for ``auto`` (its own line said what it chose and why)."""
    per_step = settings.samples_per_step(processes) * seq_len
    planned = settings.max_steps * per_step
    epochs = planned / max(1, corpus_tokens)
    lines = [f"plan: {settings.max_steps:,} steps x {per_step:,} tokens = {planned / 1e6:,.1f}M tokens = "
             f"{epochs:.1f} epochs of the {corpus_tokens / 1e6:,.2f}M-token training stream"
             + (f" at most: the cosine is fitted to --max_minutes {settings.max_minutes:g} once step "
                f"{calibration_step(settings):,} is timed" if settings.fit_schedule_to_time
                else f" (or fewer: --max_minutes {settings.max_minutes:g})" if settings.max_minutes else "")]
    p = pressure(max(1, corpus_tokens), 6.0 * num_params * planned)  # the run's FLOPs, as the rule counts them
    reg = regime(p)
    if epochs <= MANY_EPOCHS or auto or reg is REGIMES[0]:  # few epochs, or a model small for them: no over-fit
        return lines
    where = (f"{epochs:.0f} epochs of one corpus for {num_params / 1e6:.1f}M parameters ({reg.name}: epochs x "
             f"params/token ~ {p:,.3g}")
    missing = _over_fit_remedies(settings, dropout, reg)
    if not missing:
        lines.append(f"note: {where}); the run has the regularisation measured for that and keeps its best weights")
        return lines
    supported = corpus_tokens / TOKENS_PER_PARAM
    lines.append(
        f"warning: {where}) over-fit without regularisation (beyond ~{MANY_EPOCHS} epochs repeated tokens are worth "
        f"much less than new ones; at {TOKENS_PER_PARAM} tokens/parameter this corpus supports a "
        f"~{supported / 1e6:.2f}M-parameter model per epoch). Add " + ", ".join(missing)
        + "; or --preset auto, which chooses size, regularisation and schedule for the corpus and --max_minutes; "
        "or use more data")
    return lines


def _over_fit_remedies(settings: TrainSettings, dropout: float, reg: Regime) -> list[str]:
    """The flags of ``reg`` (the auto rule's regularisation for this pressure) and best-weight keeping that the run
    lacks."""
    remedies = []
    if dropout < reg.dropout:
        remedies.append(f"--dropout {reg.dropout:g}")
    if settings.weight_decay < reg.weight_decay:
        remedies.append(f"--weight_decay {reg.weight_decay:g}")
    if settings.optimizer == "muon" and settings.optimizer_options.muon_weight_decay < reg.muon_weight_decay:
        remedies.append(f"--muon_weight_decay {reg.muon_weight_decay:g}")
    if not settings.load_best_at_end:
        remedies.append("--load_best_at_end true (keeps the weights that validated best)"
                        + ("" if settings.eval_steps else " with --eval_steps N"))
    return remedies


def tokenizer_key(cfg: GPTSettings, train) -> dict[str, Any]:
    """What a trained tokenizer is made from: its settings and the training split's content."""
    return {"vocab_size": cfg.vocab_size, "tokenizer_train_docs": cfg.tokenizer_train_docs,
            "text_column": cfg.text_column, "source": source_fingerprint(train, cfg.text_column)}


def corpus_tokenizer(cfg: GPTSettings, train, key: dict[str, Any], log=print):
    """A byte-level BPE trained on (at most ``tokenizer_train_docs`` of) the training split, or the one an earlier
    run or ``hf-cgpu budget`` trained from the same data and settings (``cached_tokenizer``)."""
    if len(train) > cfg.tokenizer_train_docs:
        train = train.shuffle(seed=0).select(range(cfg.tokenizer_train_docs))

    def fresh():
        log(f"tokenizer: training a byte-level BPE of {cfg.vocab_size:,} tokens on {len(train):,} documents of the "
            "training split (kept in the cache: a later run on the same data and settings reuses it)")
        return train_tokenizer(train[cfg.text_column], vocab_size=cfg.vocab_size)

    tok, reused = cached_tokenizer(key, cfg.cache_dir or None, fresh)
    if reused is not None:
        log(f"tokenizer: trained by an earlier run on the same data and settings, reused from {reused}")
    return tok


def load_corpus(cfg: GPTSettings, log=print):
    """The run's ``DatasetDict(train, validation)`` of ``--dataset``."""
    check_dataset(cfg.dataset)
    return load_text_dataset(None if cfg.dataset == "builtin" else cfg.dataset, text_column=cfg.text_column, log=log)


def given_tokenizer(cfg: GPTSettings):
    return load_tokenizer(cfg.tokenizer, "tokenizer given by --tokenizer")


def pack(cfg: GPTSettings, split_ds, tokenizer, split: str, log=print):
    """``split_ds`` packed as the run packs it (the same cache key)."""
    return pack_dataset(split_ds, tokenizer, seq_len=cfg.seq_len, cache_dir=cfg.cache_dir or None,
                        num_proc=cfg.num_proc or None, text_column=cfg.text_column, log=log, split=split)


def train_split_tokens(cfg: GPTSettings, log=print) -> tuple[int, int]:
    """(the training split's tokens, the tokenizer's vocabulary) as a run of ``cfg`` makes them (``--preset auto``
    chooses for these), through the same caches: the run then reuses the tokenizer and the packed tokens."""
    ds = load_corpus(cfg, log)
    train = ds["train"]
    tok = given_tokenizer(cfg) if cfg.tokenizer else corpus_tokenizer(cfg, train, tokenizer_key(cfg, train), log)
    return pack(cfg, train, tok, "train", log).n_tokens, len(tok)


class CausalLMTask(PackedTokensTask):
    card = "gpt"

    def __init__(self, cfg: GPTSettings):
        self.cfg = cfg
        self.tokenizer = None
        self.data_order = cfg.data_order
        self.distiller: Distiller | None = None
        self.mtp: MTPHeads | None = None
        self.mtp_now = 0.0
        """The multi-token heads' weight at the step under way (``at_step``); 0: the plain loss."""
        self.autocast = contextlib.nullcontext

    # ---- data and model
    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        cfg, out, log = self.cfg, Path(settings.output_dir), accelerator.print
        if cfg.attn_implementation == "flex_attention" and accelerator.device.type != "cuda":
            raise SettingsError(f"--attn_implementation flex_attention trains on CUDA only (torch has no "
                                f"{accelerator.device.type} backward for it); use sdpa here")
        ds = load_corpus(cfg, log)
        with accelerator.main_process_first():
            self.tokenizer = self._tokenizer(ds, out, resume=bool(settings.resume_from_checkpoint), log=log)
            self.train_data = pack(cfg, ds["train"], self.tokenizer, "train", log)
            self.val_data = pack(cfg, ds["validation"], self.tokenizer, "validation", log)
        vocab = len(self.tokenizer)
        self.val_texts = [t for t in ds["validation"][cfg.text_column][:50] if t.strip()]
        chosen = None
        if cfg.auto:  # the shape, regularisation and schedule for this corpus and these minutes, recorded for resume
            self.cfg, chosen, line = self._auto(settings, accelerator, vocab)
            cfg, settings = self.cfg, chosen
            accelerator.print(line)
        config = cfg.model_config(vocab, self.tokenizer.eos_token_id)
        check_vocab(self.tokenizer, config.vocab_size)
        model = CgptForCausalLM(config)
        if cfg.attn_implementation != model.config._attn_implementation:
            model.set_attn_implementation(cfg.attn_implementation)
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        accelerator.print(
            f"GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), {num_params / 1e6:.2f}M parameters, "
            f"vocab {vocab}, seq {cfg.seq_len}, dropout {cfg.dropout}; train {self.train_data.n_tokens:,} tokens, "
            f"validation {self.val_data.n_tokens:,} tokens ({cfg.data_order} windows"
            f"{', attention within each document' if cfg.document_masking else ''})"
        )
        if self.val_data.n_tokens < cfg.seq_len + 1:
            raise SettingsError(f"validation split has fewer than seq_len+1={cfg.seq_len + 1} tokens; lower --seq_len")
        for line in epoch_plan(settings, cfg.seq_len, self.train_data.n_tokens, num_params,
                               accelerator.num_processes, cfg.dropout, cfg.auto):
            accelerator.print(line)
        if cfg.input_noise:
            accelerator.print(f"input noise: {cfg.input_noise:.0%} of the training inputs replaced by uniform random "
                              "tokens, the targets kept")
        if cfg.teachers:
            if is_sharded(accelerator):
                raise SettingsError("--teacher reads the student's LM head beside its forward, and FSDP2 shards it: "
                                    "distill on one GPU, or on several without FSDP (data parallel)")
            self.distiller = Distiller(cfg.teachers, self.tokenizer, config.vocab_size, accelerator.device,
                                       cfg.distill_weight, cfg.distill_temperature, accelerator.autocast,
                                       compile=settings.compile and accelerator.device.type == "cuda",
                                       top_k=cfg.teacher_top_k)
            accelerator.print(self.distiller.describe() + (f"; its weight falls to 0 at {cfg.distill_anneal:g} of "
                              "the schedule, the plain loss from there on" if cfg.distill_anneal else ""))
            if cfg.teacher_top_k:  # built by the main process, read by the others
                with accelerator.main_process_first():
                    self.distiller.cache_over(self.train_data, out, settings.micro_batch_size,
                                              self.tokenizer.eos_token_id if cfg.document_masking else None,
                                              accelerator.device, settings.progress and accelerator.is_main_process,
                                              log)
        if cfg.mtp_heads:
            if is_sharded(accelerator):
                raise SettingsError("--mtp_heads reads the model's LM head beside its forward, and FSDP2 shards it: "
                                    "train it on one GPU, or set --mtp_heads 0")
            self.mtp, self.autocast = self.make_heads(config, accelerator.device), accelerator.autocast
            accelerator.print(f"multi-token prediction: {cfg.mtp_heads} extra head{'s' * (cfg.mtp_heads > 1)} "
                              f"({sum(p.numel() for p in self.mtp.parameters()):,} parameters, not saved with the "
                              f"model) predict tokens t+2..t+{cfg.mtp_heads + 1} through the LM head; their loss "
                              f"weighs {cfg.mtp_weight:g}, falling to 0 at {cfg.mtp_anneal:g} of the schedule")
        return TaskPlan(model, expected_initial_loss=math.log(vocab), settings=chosen,
                        shape=cgpt_run_shape(config, settings=cfg, stream_tokens=self.train_data.n_tokens),
                        companions=(self.mtp,) if self.mtp is not None else ())

    def make_heads(self, config: CgptConfig, device) -> MTPHeads:
        """The ``--mtp_heads`` heads for a model of ``config`` on ``device``, the same initial weights in every run
        (drawn aside: the model's and the data's draws stay those of a run without them)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return MTPHeads(config.n_embd, self.cfg.mtp_heads).to(device)

    def at_step(self, step: int, last_step: int) -> None:
        """The multi-token heads' and the distillation term's weights for ``step`` on the schedule of ``last_step``
        steps."""
        if self.mtp is not None:
            self.mtp_now = annealed_weight(step, last_step, self.cfg.mtp_weight, self.cfg.mtp_anneal)
        if self.distiller is not None and self.cfg.distill_anneal:
            cfg = self.cfg
            self.distiller.weight_now = annealed_weight(step, last_step, cfg.distill_weight, cfg.distill_anneal)

    def _auto(self, settings: TrainSettings, accelerator, vocab: int):
        """(GPTSettings, TrainSettings, the line) of ``--auto`` for the packed training split on this card."""
        card = run_card(settings.peak_tflops, accelerator.device, settings.emulate_card)
        return resolve_auto(self.cfg, settings, self.train_data.n_tokens, card, Path(settings.output_dir), vocab,
                            accelerator.num_processes, save=accelerator.is_main_process,
                            device_type=accelerator.device.type)

    def _tokenizer(self, ds, out: Path, resume: bool, log=print):
        """--tokenizer, else the one this output folder's run trained (reused when resuming, or when it was trained
        from the same data and settings), else a new byte-level BPE saved atomically to ``output_dir/tokenizer``: the
        one an earlier run trained from the same data and settings when the cache has it (``cached_tokenizer``)."""
        cfg = self.cfg
        if cfg.tokenizer:
            return given_tokenizer(cfg)
        saved = out / "tokenizer"
        key = tokenizer_key(cfg, ds["train"])
        if (saved / "tokenizer.json").is_file():
            # resume: the same ids as the checkpoint (its fingerprint checks them)
            if resume or tokenizer_made_from(saved) == key:
                try:
                    return load_tokenizer(saved, f"the tokenizer this run trained ({saved})")
                except DataError as err:  # a file damaged or removed on disk or by hand
                    if resume:
                        why = tokenizer_problem(saved) or str(err)
                        raise CheckpointError(
                            f"the tokenizer this run trained ({saved}) cannot be read: {why}; the checkpoints' token ids "
                            "need it: copy the tokenizer files back from the model folder or best/, or start a fresh "
                            "--output_dir") from None
                    # not resuming: nothing depends on it yet, so a new one is trained (and saved atomically)
        tok = corpus_tokenizer(cfg, ds["train"], key, log)
        save_tokenizer(tok, saved, key)
        return tok

    def target_loss(self, model, inputs, targets) -> torch.Tensor:
        """Training and validation alike; with ``document_masking`` the positions restart after each EOS."""
        eos = self.tokenizer.eos_token_id if self.cfg.document_masking else None
        return cgpt_target_loss(model, inputs, targets, eos)

    def loss(self, model, batch, generator) -> torch.Tensor:
        """The training loss: the plain one, or with ``input_noise`` (inputs replaced, targets and document positions
        those of the true text), ``--teacher`` (distillation) and ``--mtp_heads`` (their term while its weight is above
        0; the model called the same way throughout, so a compiled one does not recompile when it reaches 0)."""
        if not (self.cfg.input_noise or self.distiller or self.mtp is not None):
            return super().loss(model, batch, generator)
        block = batch["input_ids"]  # (B, S + 1): position t predicts token t + 1
        inputs, targets = block[:, :-1], block[:, 1:]
        positions = document_position_ids(inputs, self.tokenizer.eos_token_id) if self.cfg.document_masking else None
        if self.cfg.input_noise:
            inputs = replace_tokens(inputs, self.cfg.input_noise, len(self.tokenizer), generator)
        if self.distiller is not None:
            return self.distiller.loss(model, inputs, positions, targets, batch.get("starts"))
        out = model(input_ids=inputs, position_ids=positions, shift_labels=targets, use_cache=False,
                    return_logits=False, **({"output_hidden_states": True} if self.mtp is not None else {}))
        if not self.mtp_now:
            return out.loss
        from accelerate.utils import extract_model_from_parallel

        bare = extract_model_from_parallel(model)
        with self.autocast():  # hidden states after the final norm: what the LM head reads
            extra = mtp_loss(self.mtp, out.hidden_states[-1], bare.lm_head.weight, block,
                             self.tokenizer.eos_token_id, bare.config.loss_chunk_size, bare.config.logit_softcap)
        return out.loss + self.mtp_now * extra

    def train_batch(self, indices, device, generator) -> dict:
        """The packed windows; with a teacher cache also their offsets in the stream (``starts``), where it is read."""
        batch = super().train_batch(indices, device, generator)
        if self.distiller is not None and self.distiller.cache is not None:
            batch["starts"] = indices.to(device, non_blocking=True)
        return batch

    def save_pretrained(self, model, output_dir: Path) -> None:
        model.save_pretrained(str(output_dir))
        self.tokenizer.save_pretrained(str(output_dir))

    def on_saved(self, model, output_dir: Path, log=print) -> dict[str, Any]:
        """Continue the prompts with the saved weights: printed, kept in all_results.json, shown on the card."""
        was_training = model.training
        samples = continue_texts(model, self.tokenizer, self.sample_prompts(), self.cfg.max_new_tokens, log=log)
        model.train(was_training)
        log("\n".join(f"--- sample {i + 1}\n{s}" for i, s in enumerate(samples)))
        cache = self.distiller is not None and self.distiller.cache is not None
        return {"samples": samples, **({"teacher_cache_seconds": self.distiller.cache_seconds} if cache else {})}

    def data_fingerprint(self) -> dict[str, Any]:
        """The tokenizer's content and the packed data's content (not the path it was read from)."""
        return {"tokenizer": tokenizer_hash(self.tokenizer), "train_data": self.train_data.content_hash,
                "validation_data": self.val_data.content_hash,
                **(self.distiller.fingerprint() if self.distiller is not None else {})}

    def sample_prompts(self) -> list[str]:
        if self.cfg.prompts:
            return [p for p in self.cfg.prompts.split("|") if p]
        return [t[:24] for t in self.val_texts[:3]]
