"""One optimizer step's forward/backward: the accumulation window over this process's samples, then clipping.

Step ``k``'s global batch is ``order.indices(k, micro_batch_size x accumulation x processes)`` whatever the number
of processes; process ``r`` takes the ``r``-th contiguous slice of it, so its micro-batch ``j`` is micro-batch
``r x accumulation + j`` of the step. Every micro-batch draws its randomness (dropout, noise, times, flips) from a
seed of ``(seed, k, its index in the step)``: one process with accumulation ``a x P`` and ``P`` processes with
accumulation ``a`` train on the same micro-batches with the same draws, so they reach the same losses."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .parallel import full_tensor, global_sum
from .schedule import micro_batch_seed


@dataclass(frozen=True)
class StepResult:
    """On the device, unread: reading them waits for the step (``update.Updater`` decides when)."""

    loss: torch.Tensor
    """Mean loss over the micro-batches of every process (the same on every rank), 0-d fp32."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping, 0-d."""
    units: int | torch.Tensor
    """Throughput units all processes trained on (tokens, images): an int with one process, else the all-reduced
    0-d tensor."""


def clip_gradients(accelerator, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (0 = no clipping) and return the norm before clipping (a 0-d
    tensor on the device: nothing waits for it)."""
    if max_norm > 0:
        return full_tensor(accelerator.clip_grad_norm_(params, max_norm))
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if any(hasattr(g, "device_mesh") for g in grads):  # FSDP2 shards: torch reduces the norm over them
        return full_tensor(torch.nn.utils.get_total_norm(grads))
    return torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))


def before_graphed_micro_batch(params: list[torch.nn.Parameter], index: int, accumulation: int) -> None:
    """Call before each micro-batch's forward when the model runs under CUDA graphs (``--compile_mode
    reduce-overhead`` / ``max-autotune``): marks a new invocation for torch's cudagraph trees (the previous
    micro-batch's outputs are not read again), and before the first of several gives every trainable parameter a
    zero gradient, so autograd adds each backward's gradients into buffers of ours. Otherwise autograd keeps the
    first backward's gradient tensors, which belong to the graph's memory pool and are overwritten by the next
    replay: torch raises "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"
    (pytorch#169545; older versions accumulated wrong gradients silently, pytorch#96693)."""
    torch.compiler.cudagraph_mark_step_begin()
    if index == 0 and accumulation > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


class Stepper:
    """Forward/backward of step ``k``: its samples from ``order``, every random draw seeded by ``(seed, k)``.
    ``cuda_graphs``: the model runs under CUDA graphs (see ``before_graphed_micro_batch``); ``also``: modules the run's
    optimizer trains with the model (``TaskPlan.joint_modules``), their gradients clipped with the model's."""

    def __init__(self, task, model, accelerator, order, seed: int, max_grad_norm: float, cuda_graphs: bool = False,
                 also=()):
        self.task, self.model, self.accelerator, self.order = task, model, accelerator, order
        self.seed, self.max_grad_norm, self.cuda_graphs = seed, max_grad_norm, cuda_graphs
        self.trainable = [p for m in (model, *also) for p in m.parameters() if p.requires_grad]

    def run(self, step: int, micro_batch_size: int, accumulation: int) -> StepResult:
        acc, device = self.accelerator, self.accelerator.device
        effective = micro_batch_size * accumulation
        idx = self.order.indices(step, effective * acc.num_processes)
        idx = idx[acc.process_index * effective : (acc.process_index + 1) * effective]
        gen = torch.Generator(device=device)
        loss_sum = torch.zeros((), device=device)
        units = 0
        for k in range(accumulation):
            seed = micro_batch_seed(self.seed, step, acc.process_index * accumulation + k)
            torch.manual_seed(seed)  # dropout and any other global draw
            gen.manual_seed(seed)
            batch = self.task.train_batch(idx[k * micro_batch_size : (k + 1) * micro_batch_size], device, gen)
            if self.cuda_graphs:
                before_graphed_micro_batch(self.trainable, k, accumulation)
            with acc.no_sync(self.model) if k < accumulation - 1 else nullcontext():
                loss = self.task.loss(self.model, batch, gen)
                acc.backward(loss / accumulation)
            loss_sum += loss.detach().float()
            units += self.task.units(batch)
        grad_norm = clip_gradients(acc, self.trainable, self.max_grad_norm)
        micro_batches = accumulation * acc.num_processes
        if acc.num_processes == 1:
            return StepResult(loss_sum / micro_batches, grad_norm, units)
        loss_sum, total_units = global_sum(acc, loss_sum, torch.tensor(float(units), device=device))
        return StepResult(loss_sum / micro_batches, grad_norm, total_units)
