"""Distillation from a cached top-K of the teacher's predictions (``--teacher DIR --teacher_top_k K``).

Before the first step the teacher runs once over the training stream, in windows of ``seq_len + 1`` tokens at
stride ``seq_len`` (``eval_windows``: every position predicted once), and keeps, for every stream position ``p``, the
K tokens it finds likeliest to come at ``p + 1`` with their log-probabilities. A training window at offset ``o``
reads rows ``o .. o + seq_len - 1``, so the cache serves any window order (shifted, random, fixed). The teacher saw
each position in the context of its own window: with ``--document_masking`` that is the document's own prefix,
except where a document was cut by one of the teacher's window starts (a shorter context there); without it, the
stream since the teacher's window start, which differs from the student's window.

The distillation term is then a sparse KL at temperature ``T``: ``p`` the teacher's K entries renormalised (softmax
of their log-probabilities over T), ``log q`` the student's full log-softmax at T read at the K ids; computed in the
loss chunk that computes the cross-entropy, from one set of student logits. The step costs what the plain step costs
plus a gather; the teacher's forward is paid once.

The cache is a file ``teacher_cache/<key>.safetensors`` in the run's output_dir, written atomically, named by a
content hash of what it depends on (the teacher's weights, the token stream, seq_len, document masking, K, the
teacher's dtype): a resume or a second student in the same folder reads it, anything else builds a new one (and
drops the old). It is neither sealed with the model nor pushed. During training it is held on the accelerator: N
positions x K x (2 B ids + 2 B values on CUDA, where the bf16 teacher's values are kept as fp16).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.windows import document_position_ids, eval_windows
from ..errors import SettingsError
from ..integrity import atomic_output
from ..models.cgpt.modeling_cgpt import soft_cap

CACHE_DIR = "teacher_cache"
"""The folder of the run's output_dir that holds the cache (never sealed, never pushed)."""
FORMAT = 1
"""Part of the key: a cache of another layout is rebuilt."""


def id_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest integer type that holds every token id."""
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def value_dtype(teacher_dtype: torch.dtype) -> torch.dtype:
    """The cached log-probabilities' type: fp16 for a bf16 teacher (finer than its logits), fp32 for an fp32 one."""
    return torch.float32 if teacher_dtype == torch.float32 else torch.float16


def cache_key(teacher_sha: str, stream_sha: str, seq_len: int, document_masking: bool, k: int,
              teacher_dtype: torch.dtype) -> str:
    """SHA-256 of everything the cached predictions depend on."""
    what = {"format": FORMAT, "teacher": teacher_sha, "stream": stream_sha, "seq_len": seq_len,
            "document_masking": document_masking, "top_k": k, "dtype": str(teacher_dtype)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def top_k_of_stream(teacher, tokens, seq_len: int, k: int, batch_size: int, device: torch.device,
                    eos: int | None = None, chunk_size: int = 0, progress: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probabilities), each ``(len(tokens) - 1, k)`` on the host: row ``p`` the teacher's ``k`` likeliest
    tokens at stream position ``p + 1`` and their log-softmax (soft-capped as the teacher caps its logits), from
    windows of ``seq_len + 1`` tokens at stride ``seq_len``; ``eos``: positions restart after it (document
    masking), as the training step gives them."""
    n = len(tokens)
    vocab = teacher.config.vocab_size
    ids = torch.empty((n - 1, k), dtype=id_dtype(vocab))
    values = torch.empty((n - 1, k), dtype=value_dtype(teacher.dtype))
    plan = eval_windows(n, seq_len)
    weight, cap = teacher.lm_head.weight, teacher.config.logit_softcap
    batches = range(0, len(plan), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="teacher cache", unit="batch")
    for first in batches:
        chunk = plan[first : first + batch_size]
        starts = torch.tensor([s for s, _ in chunk])
        index = starts[:, None] + torch.arange(seq_len)[None, :]
        x = torch.from_numpy(tokens[index.numpy()].astype("int64")).to(device)
        positions = document_position_ids(x, eos) if eos is not None else None
        hidden = teacher.transformer(input_ids=x, position_ids=positions if teacher.config.document_masking else None,
                                     use_cache=False).last_hidden_state.reshape(-1, weight.shape[1])
        step = chunk_size or hidden.shape[0]
        top_v, top_i = [], []
        for at in range(0, hidden.shape[0], step):
            logp = F.log_softmax(soft_cap(F.linear(hidden[at : at + step], weight).float(), cap), dim=-1)
            v, i = logp.topk(k, dim=-1)
            top_v.append(v)
            top_i.append(i)
        v, i = (torch.cat(t).reshape(len(chunk), seq_len, k).cpu() for t in (top_v, top_i))
        for row, (start, skip) in enumerate(chunk):  # the last window's first ``skip`` rows are some earlier window's
            ids[start + skip : start + seq_len] = i[row, skip:].to(ids.dtype)
            values[start + skip : start + seq_len] = v[row, skip:].to(values.dtype)
    return ids, values


class TeacherCache:
    """The cached top-K of one teacher over the training stream, on the device the run trains on."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor):
        self.ids, self.values = ids, values

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.values.numel() * self.values.element_size()

    def rows(self, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64, log-probabilities fp32), each ``(len(starts), length, K)``, of the windows at ``starts``."""
        device = self.ids.device
        index = (starts.to(device)[:, None] + torch.arange(length, device=device)[None, :]).reshape(-1)
        shape = (len(starts), length, self.ids.shape[1])
        return (self.ids.index_select(0, index).long().reshape(shape),
                self.values.index_select(0, index).float().reshape(shape))

    @classmethod
    def load_or_build(cls, output_dir: Path, key: str, build, device: torch.device, log=print
                      ) -> tuple[TeacherCache, float]:
        """The cache named ``key`` in ``output_dir/teacher_cache`` (read when there and whole), else the one
        ``build()`` makes (``(ids, values)``), saved there atomically in place of any other; with the seconds spent."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file, save_file

        folder = Path(output_dir) / CACHE_DIR
        path = folder / f"{key}.safetensors"
        started = time.perf_counter()
        if path.is_file():
            try:
                saved = load_file(str(path))
                cache = cls(saved["ids"].to(device), saved["values"].to(device))
                seconds = time.perf_counter() - started
                log(f"teacher cache: {path} reused ({cache.nbytes / 1e9:.2f} GB, read in {seconds:.1f} s)")
                return cache, seconds
            except (SafetensorError, KeyError, OSError) as err:
                log(f"teacher cache: {path} unreadable ({err}); building it again")
        ids, values = build()
        with atomic_output(path) as tmp:
            save_file({"ids": ids, "values": values}, str(tmp), metadata={"key": key})
        for old in folder.glob("*.safetensors"):  # one cache per folder: another key's is stale
            if old != path:
                old.unlink(missing_ok=True)
        cache = cls(ids.to(device), values.to(device))
        seconds = time.perf_counter() - started
        log(f"teacher cache: top-{ids.shape[1]} of the teacher's predictions at {ids.shape[0]:,} positions, "
            f"{cache.nbytes / 1e9:.2f} GB, built in {seconds:.1f} s (before the first step, outside --max_minutes), "
            f"kept in {path}")
        return cache, seconds


def check_top_k(k: int, vocab_size: int) -> None:
    if not 1 <= k <= vocab_size:
        raise SettingsError(f"--teacher_top_k {k}: this run's vocabulary has {vocab_size:,} tokens; use 1 .. "
                            f"{vocab_size:,} (e.g. 32), or 0 for the teacher's logits on the fly")


def _chunk_ce_sparse_kl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor,
                        values: torch.Tensor, temperature: float, cap: float, kl: bool = True) -> torch.Tensor:
    """(summed cross-entropy, summed sparse KL; 0 without ``kl``) over one chunk's rows, from one set of fp32
    student logits."""
    logits = soft_cap(F.linear(hidden, weight).float(), cap)
    lse = torch.logsumexp(logits, dim=-1)
    ce = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    if not kl:
        return torch.stack((ce, torch.zeros_like(ce)))
    lse_t = lse if temperature == 1 else torch.logsumexp(logits / temperature, dim=-1)
    log_q = logits.gather(1, ids) / temperature - lse_t[:, None]
    log_p = F.log_softmax(values / temperature, dim=-1)  # the K entries renormalised
    kl = (log_p.exp() * (log_p - log_q)).sum()
    return torch.stack((ce, kl))


@functools.cache
def _compiled_chunk():
    """``_chunk_ce_sparse_kl`` compiled once per process: one fused pass over the chunk's logits instead of eager's
    fp32 copy, log-sum-exp and gathers each reading them again (benchmarks/throughput/bench_sparse_kl.py).
    ``dynamic=False`` as the model's own compile (``tiers.compile.apply_compile``): a shorter last chunk gets a graph
    of its own instead of turning every chunk's graph dynamic."""
    return torch.compile(_chunk_ce_sparse_kl, dynamic=False)


def chunked_ce_sparse_kl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor,
                         values: torch.Tensor, chunk_size: int, temperature: float = 1.0, cap: float = 0.0,
                         kl: bool = True, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy against ``targets``, mean sparse KL(teacher's top-K || student) at ``temperature``) of the
    logits ``hidden @ weight.T`` (soft-capped at ``cap``), hidden (N, C), targets (N,), ``ids`` / ``values`` (N, K) the
    teacher's top-K ids and log-probabilities; ``chunk_size`` rows at a time (0: all at once), each chunk's logits
    only inside a checkpointed call; without ``kl`` the KL is 0 and not computed; ``compiled``: each chunk through
    ``torch.compile`` (a run that compiles its model)."""
    chunk = _compiled_chunk() if compiled else _chunk_ce_sparse_kl
    n = hidden.shape[0]
    step = chunk_size or n
    total = hidden.new_zeros(2, dtype=torch.float32)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        args = (hidden[rows], weight, targets[rows], ids[rows], values[rows], temperature, cap, kl)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = total + checkpoint(chunk, *args, use_reentrant=False)
        else:
            total = total + chunk(*args)
    ce, kl = total / max(1, n)
    return ce, kl


__all__ = ["CACHE_DIR", "TeacherCache", "cache_key", "check_top_k", "chunked_ce_sparse_kl", "top_k_of_stream"]
