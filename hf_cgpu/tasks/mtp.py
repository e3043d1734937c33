"""Multi-token prediction heads for a GPT run (``hf-cgpu train gpt --mtp_heads K``), annealed out during training.

Head ``k`` (1..K) reads the model's final hidden state at position t (after its final norm, what the LM head reads)
and predicts token t + 1 + k through the model's own LM head, so the vocabulary projection is shared:

    h_k = h + W_k rmsnorm_k(h)      (W_k a d x d matrix, zero at the start: head k first predicts as the model does)
    loss = CE(next token) + w(step) x mean_k CE_k(token t + 1 + k)

Each extra cross-entropy is the model's chunked one (no full logits where the plain loss builds none). A target in
another document than position t's token (an EOS among tokens t .. t + k) is not scored, nor one past the row's end.
``w`` falls linearly from ``--mtp_weight`` at step 0 to 0 at ``--mtp_anneal`` of the schedule; from there on the loss
is the plain one. The heads are the run's companion module (``TaskPlan.companions``): trained by the run's optimizer
with the model, held in every checkpoint, never part of the saved model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.cgpt.modeling_cgpt import IGNORE_INDEX, chunked_cross_entropy


class MTPHeads(nn.Module):
    """K residual heads ``h + W_k rmsnorm_k(h)`` on hidden states of width ``n_embd``, each ``W_k`` zero-initialised."""

    def __init__(self, n_embd: int, heads: int, eps: float = 1e-5):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(n_embd, eps=eps) for _ in range(heads))
        self.projs = nn.ModuleList(nn.Linear(n_embd, n_embd, bias=False) for _ in range(heads))
        for proj in self.projs:
            nn.init.zeros_(proj.weight)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states (..., d) each head hands the LM head."""
        return [hidden + proj(norm(hidden)) for norm, proj in zip(self.norms, self.projs, strict=True)]


def mtp_targets(block: torch.Tensor, offset: int, eos: int) -> torch.Tensor:
    """(B, S) targets of the head ``offset`` tokens further than the next token, from a row of ``S + 1`` tokens
    ``block`` (position t predicts ``block[t + 1 + offset]``): ``IGNORE_INDEX`` past the row's end and where an EOS
    among ``block[t .. t + offset]`` puts the target in a later document than position t's token."""
    S = block.shape[1] - 1
    ends = F.pad((block == eos).long().cumsum(-1), (1, 0))  # ends[j]: EOS among block[0 .. j - 1]
    targets = block[:, 1 + offset :]  # (B, S - offset)
    crossing = ends[:, offset + 1 : S + 1] - ends[:, : S - offset] > 0  # an EOS among block[t .. t + offset]
    return F.pad(targets.masked_fill(crossing, IGNORE_INDEX), (0, offset), value=IGNORE_INDEX)


def mtp_loss(heads: MTPHeads, hidden: torch.Tensor, head_weight: torch.Tensor, block: torch.Tensor, eos: int,
             chunk_size: int, softcap: float = 0.0) -> torch.Tensor:
    """Mean over the heads of their cross-entropy against ``mtp_targets`` of ``block``, each through the LM head
    ``head_weight`` (V, d) in checkpointed chunks of ``chunk_size`` positions (0: at once), soft-capped as the model
    caps its logits; ``hidden`` (B, S, d) the model's final hidden states."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for k, h in enumerate(heads(hidden), start=1):
        flat = h.reshape(-1, h.shape[-1])
        total = total + chunked_cross_entropy(flat, head_weight, mtp_targets(block, k, eos).reshape(-1),
                                              chunk_size or flat.shape[0], softcap=softcap)
    return total / len(heads.projs)


def annealed_weight(step: int, last_step: int, weight: float, anneal: float) -> float:
    """An extra loss's weight at ``step`` (the heads', or distillation's with ``--distill_anneal``): ``weight`` at
    step 0, linearly to 0 at ``anneal`` of the schedule's ``last_step`` steps, 0 from there on."""
    end = anneal * last_step
    return weight * max(0.0, 1.0 - step / end) if end > 0 else 0.0


__all__ = ["MTPHeads", "annealed_weight", "mtp_loss", "mtp_targets"]
