"""``MuonWithAdamW``: torch's ``torch.optim.Muon`` on the 2-D hidden weight matrices and ``torch.optim.AdamW`` on the
rest, as one optimizer, so the loop, accelerate and the checkpoints see a single ``param_groups`` / ``state_dict``
and a resumed run continues exactly.

Muon replaces each update of a weight matrix by the orthogonalised Nesterov momentum: 5 steps of the quintic
Newton-Schulz iteration with coefficients (3.4445, -4.7750, 2.0315) in bf16, scaled by ``max(1, rows / cols) ** 0.5``
(``adjust_lr_fn="original"``). The step is torch's algorithm, batched (``batched=True``, the default): torch's
``Muon.step`` runs ~22 small ops per matrix; ours stacks the matrices of one shape and runs one Newton-Schulz chain of
``baddbmm`` per shape and ``_foreach`` ops for momentum, decay and the update. Same state (``momentum_buffer``), same
hyperparameters, the same update up to bf16 rounding (tests/test_muon.py); ``batched=False`` calls
``torch.optim.Muon.step`` itself.

Learning rates: every group carries ``lr_scale`` (its peak lr over the run's ``learning_rate``); the schedule
(``hf_cgpu.train.schedule.set_lr``) sets ``lr = schedule * lr_scale`` for such groups, so Muon's peak is
``muon_learning_rate`` and the AdamW groups get the schedule's value unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .groups import output_weight_ids, with_embedding_lr


def is_muon_param(model: nn.Module) -> dict[int, bool]:
    """By parameter id: True for 2-D weights of hidden layers (not an ``nn.Embedding``, not the output head)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    outside = embeddings | output_weight_ids(model)
    return {id(p): p.ndim == 2 and id(p) not in outside for p in model.parameters()}


def muon_param_groups(
    model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], lr: float, weight_decay: float, muon_lr: float,
    muon_momentum: float, muon_weight_decay: float,
) -> list[dict[str, Any]]:
    """Three groups of the trainable ``named`` parameters: Muon matrices, AdamW decayed (other >= 2-D weights:
    embeddings, an untied head), AdamW not decayed (norms, biases, 1-D tensors). Empty groups are dropped."""
    muon = is_muon_param(model)
    named = list(named)
    groups = [
        {"params": [p for _, p in named if muon.get(id(p), False)], "use_muon": True, "lr": muon_lr,
         "lr_scale": muon_lr / lr, "momentum": muon_momentum, "weight_decay": muon_weight_decay},
        {"params": [p for _, p in named if not muon.get(id(p), False) and p.ndim >= 2], "use_muon": False,
         "weight_decay": weight_decay},
        {"params": [p for _, p in named if not muon.get(id(p), False) and p.ndim < 2], "use_muon": False,
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over groups marked ``use_muon``: those step with ``torch.optim.Muon`` (Nesterov, 5
    Newton-Schulz steps), the others with ``torch.optim.AdamW``.

    Both inner optimizers hold the very group dicts of ``param_groups`` and share ``state``, so ``set_lr``,
    ``state_dict`` and ``load_state_dict`` (accelerate's ``save_state`` / ``load_state``) act on both.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, momentum: float = 0.95, fused: bool = False,
                 batched: bool = True):
        groups = [dict(g) for g in groups]
        muon = [g for g in groups if g.get("use_muon")]
        adamw = [g for g in groups if not g.get("use_muon")]
        self._muon = torch.optim.Muon(muon, lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0,
                                      adjust_lr_fn="original") if muon else None
        self._adamw = torch.optim.AdamW(adamw, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        fused=fused) if adamw else None
        super().__init__(muon + adamw, {})
        self.batched = batched
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (after construction and after a load)."""
        for inner, use_muon in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if bool(g.get("use_muon")) == use_muon]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:
            if self.batched:
                for group in self._muon.param_groups:
                    self._batched_muon_group(group)
            else:
                self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _batched_muon_group(self, group: dict[str, Any]) -> None:
        """torch.optim.Muon's update for one group, with the matrices of one shape stacked (see the module doc)."""
        lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
        by_shape: dict[torch.Size, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_shape.setdefault(p.shape, []).append(p)
        for shape, params in by_shape.items():
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            ortho = newton_schulz_batched(torch.stack(updates), group["ns_coefficients"], group["ns_steps"],
                                          group["eps"])
            adjusted = lr * math.sqrt(max(1, shape[0] / shape[1]))  # adjust_lr_fn="original"
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, list(ortho.to(params[0].dtype).unbind(0)), alpha=-adjusted)


def newton_schulz_batched(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                          eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of each matrix of ``g`` (k, rows, cols), in bf16."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def build(model: nn.Module, named: list, settings: Any, fused: bool) -> MuonWithAdamW:
    """The registry's builder: Muon at ``muon_learning_rate`` on the hidden matrices, AdamW on the rest."""
    s, o = settings, settings.optimizer_options
    groups = with_embedding_lr(model, muon_param_groups(model, named, s.learning_rate, s.weight_decay,
                                                        o.muon_learning_rate, o.muon_momentum, o.muon_weight_decay), s)
    return MuonWithAdamW(groups, lr=s.learning_rate, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps,
                         weight_decay=s.weight_decay, momentum=o.muon_momentum, fused=fused)
