"""Knowledge distillation of a GPT run from saved runs of the same tokenizer (``hf-cgpu train gpt --teacher DIR``).

The loss is ``(1 - a) CE + a T^2 KL(teacher || student)``, the KL at temperature ``T`` between the teachers' averaged
probabilities and the student's, per token. It is computed one loss chunk of positions at a time from the two
models' last hidden states: each chunk's student and teacher logits live only inside a checkpointed call (as the
model's own chunked cross-entropy), so distillation holds no more logits than the cross-entropy does. The teachers
run under no_grad, in bf16 on CUDA, compiled where the student is. With ``--teacher_top_k K`` the teacher runs
once before training instead, and the term is a sparse KL from its cached top-K (``teacher_cache``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.tokenizer import load_tokenizer, tokenizer_hash
from ..errors import SettingsError
from ..integrity import sha256_file
from ..models.cgpt.modeling_cgpt import CgptForCausalLM, soft_cap
from ..verify import check_saved
from .teacher_cache import TeacherCache, cache_key, check_top_k, chunked_ce_sparse_kl, top_k_of_stream


def load_teacher(folder: str, tokenizer, vocab_size: int, device: torch.device) -> CgptForCausalLM:
    """The GPT saved in ``folder`` (checked against its manifest first), frozen, in eval mode on ``device`` (bf16 on
    CUDA); refused in one line unless it is our GPT with ``tokenizer`` and ``vocab_size``."""
    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise SettingsError(f"--teacher {folder}: no config.json there; pass the output_dir (or best/) of an "
                            "hf-cgpu train gpt run")
    check_saved(path, "auto", what="--teacher")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type != "cgpt":
        raise SettingsError(f"--teacher {folder} is a {model_type} model; distillation takes a GPT of hf-cgpu train "
                            "gpt (model_type cgpt)")
    theirs = load_tokenizer(path, f"--teacher {folder}'s tokenizer")
    if tokenizer_hash(theirs) != tokenizer_hash(tokenizer):
        raise SettingsError(f"--teacher {folder} has another tokenizer than this run ({len(theirs):,} tokens, hash "
                            f"{tokenizer_hash(theirs)}; this run: {len(tokenizer):,}, {tokenizer_hash(tokenizer)}); "
                            f"its token ids mean other text: train the student with its tokenizer (--tokenizer "
                            f"{folder}) or distill from a run on this one")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = CgptForCausalLM.from_pretrained(str(path), dtype=dtype)
    if teacher.config.vocab_size != vocab_size:
        raise SettingsError(f"--teacher {folder} has a vocabulary of {teacher.config.vocab_size:,} logits, this run "
                            f"{vocab_size:,}: distill from a run of the same tokenizer and vocab_size")
    return teacher.to(device).eval().requires_grad_(False)


def _chunk_kl_sum(student: torch.Tensor, weight: torch.Tensor, teachers: list[torch.Tensor],
                  heads: list[torch.Tensor], temperature: float, cap: float, caps: list[float]) -> torch.Tensor:
    """Summed KL(teachers' mean || student) over the rows of one chunk of last hidden states (fp32 softmax)."""
    log_q = F.log_softmax(soft_cap(F.linear(student, weight).float(), cap) / temperature, dim=-1)
    log_ps = [F.log_softmax(soft_cap(F.linear(h, w).float(), c) / temperature, dim=-1)
              for h, w, c in zip(teachers, heads, caps, strict=True)]
    log_p = log_ps[0] if len(log_ps) == 1 else torch.logsumexp(torch.stack(log_ps), 0) - math.log(len(log_ps))
    return F.kl_div(log_q, log_p, reduction="sum", log_target=True)


def chunked_kl(student: torch.Tensor, weight: torch.Tensor, teachers: list[torch.Tensor], heads: list[torch.Tensor],
               chunk_size: int, temperature: float = 1.0, cap: float = 0.0, caps: list[float] | None = None
               ) -> torch.Tensor:
    """Mean per-row KL(teachers' averaged probabilities || student's) at ``temperature`` of the logits ``student @
    weight.T`` and ``teachers[i] @ heads[i].T`` (soft-capped as each model caps them), hidden states (N, C) each,
    ``chunk_size`` rows at a time (0: all at once)."""
    caps = caps or [0.0] * len(teachers)
    n = student.shape[0]
    step = chunk_size or n
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, n, step):
        args = (student[start : start + step], weight, [t[start : start + step] for t in teachers], heads,
                temperature, cap, caps)
        if torch.is_grad_enabled() and (student.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_kl_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_kl_sum(*args)
    return total / max(1, n)


class Distiller:
    """The teachers of a run and its distillation loss."""

    def __init__(self, folders: list[str], tokenizer, vocab_size: int, device: torch.device, weight: float,
                 temperature: float, autocast, compile: bool = False, top_k: int = 0):
        self.folders, self.weight, self.temperature, self.autocast = folders, weight, temperature, autocast
        self.weight_now = weight
        """The distillation term's weight at this step (``--distill_anneal`` lowers it); 0: the plain loss."""
        self.top_k = top_k
        """Above 0: the KL from the teacher's top-K cached over the training stream (``cache_over``)."""
        self.teachers = [load_teacher(f, tokenizer, vocab_size, device) for f in folders]
        self.weight_hashes = [sha256_file(Path(f).expanduser() / "model.safetensors") for f in folders]
        """The teachers' weights by content (the resume fingerprint and the cache's key)."""
        self.sizes = ", ".join(f"{sum(p.numel() for p in t.parameters()) / 1e6:.2f}M" for t in self.teachers)
        self.cache: TeacherCache | None = None
        self.cache_seconds = 0.0
        self.compile = compile
        """The run compiles its model: the cached path's loss chunk is compiled too."""
        if compile and not top_k:  # as the student is compiled: the teachers' blocks, once, on the first step's shapes
            for t in self.teachers:
                t.transformer.compile()

    def describe(self) -> str:
        n = len(self.folders)
        return (f"distilling from {n} teacher{'s' * (n > 1)} ({self.sizes} parameters; {', '.join(self.folders)}): "
                f"loss = {1 - self.weight:g} x CE + {self.weight:g} x T^2 x KL at T = {self.temperature:g}"
                + (f", the KL over the teacher's top-{self.top_k} cached over the training stream before the first "
                   "step" if self.top_k else ""))

    def cache_over(self, stream, output_dir: Path, batch_size: int, eos: int | None, device: torch.device,
                   progress: bool = False, log=print) -> None:
        """Distil from the one teacher's ``top_k`` over the packed training ``stream`` (``TeacherCache``: read from
        ``output_dir`` when its key matches, else built and saved there); the teacher is then let go. ``eos``: the
        positions restart after it (--document_masking)."""
        teacher, k = self.teachers[0], self.top_k
        check_top_k(k, teacher.config.vocab_size)
        key = cache_key(self.weight_hashes[0], stream.content_hash, stream.seq_len, eos is not None, k, teacher.dtype)

        def build():
            return top_k_of_stream(teacher, stream.tokens, stream.seq_len, k, batch_size, device, eos,
                                   teacher.config.loss_chunk_size, progress)

        self.cache, self.cache_seconds = TeacherCache.load_or_build(output_dir, key, build, device, log)
        self.teachers = []  # its predictions are in the cache

    def fingerprint(self) -> dict[str, Any]:
        """The teachers' weights by content: a resume against another teacher is refused."""
        return {f"teacher_weights_{i}": h for i, h in enumerate(self.weight_hashes)}

    def loss(self, model, inputs: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor,
             starts: torch.Tensor | None = None) -> torch.Tensor:
        """The run's training loss of ``model`` (as prepared: compiled, wrapped) on ``inputs``; ``starts``: the
        windows' offsets in the training stream (where the cache is read)."""
        from accelerate.utils import extract_model_from_parallel

        if self.cache is not None:
            return self._cached_loss(model, inputs, positions, targets, starts)
        out = model(input_ids=inputs, position_ids=positions, shift_labels=targets, use_cache=False,
                    return_logits=False, output_hidden_states=True)  # one call throughout: no recompile at weight 0
        if not self.weight_now:
            return out.loss
        bare = extract_model_from_parallel(model)
        hidden = out.hidden_states[-1]  # after the final norm: what the head reads
        with torch.no_grad():
            theirs = [t.transformer(input_ids=inputs, position_ids=positions if t.config.document_masking else None,
                                    use_cache=False).last_hidden_state for t in self.teachers]
        flat = [h.reshape(-1, h.shape[-1]) for h in theirs]
        with self.autocast():
            kl = chunked_kl(hidden.reshape(-1, hidden.shape[-1]), bare.lm_head.weight, flat,
                            [t.lm_head.weight for t in self.teachers], bare.config.loss_chunk_size, self.temperature,
                            bare.config.logit_softcap, [t.config.logit_softcap for t in self.teachers])
        return (1 - self.weight_now) * out.loss + self.weight_now * self.temperature**2 * kl

    def _cached_loss(self, model, inputs, positions, targets, starts) -> torch.Tensor:
        """The cross-entropy and the sparse KL from the cache, in one pass over the student's logits (the model
        computes none itself: only its last position's, unused)."""
        from accelerate.utils import extract_model_from_parallel

        out = model(input_ids=inputs, position_ids=positions, use_cache=False, logits_to_keep=1,
                    output_hidden_states=True)
        bare = extract_model_from_parallel(model)
        hidden = out.hidden_states[-1]  # after the final norm: what the head reads
        ids, values = self.cache.rows(starts, inputs.shape[1])
        with self.autocast():
            ce, kl = chunked_ce_sparse_kl(hidden.reshape(-1, hidden.shape[-1]), bare.lm_head.weight,
                                          targets.reshape(-1), ids.reshape(-1, ids.shape[-1]),
                                          values.reshape(-1, ids.shape[-1]), bare.config.loss_chunk_size,
                                          self.temperature, bare.config.logit_softcap, kl=bool(self.weight_now),
                                          compiled=self.compile)
        return (1 - self.weight_now) * ce + self.weight_now * self.temperature**2 * kl


__all__ = ["Distiller", "chunked_kl", "load_teacher"]
