"""Several processes: the Accelerator for whatever ``accelerate launch`` asked for, and the few collective steps the
loop needs so that DDP and FSDP2 behave like one process.

* ``make_accelerator``: on a machine without CUDA a multi-process launch runs on CPU processes over gloo (the CI
  proof); accelerate enables FSDP only for GPU-like distributed types, so an FSDP launch on CPU goes through the
  same plugin with the distributed type set to ``MULTI_GPU`` before the ``AcceleratorState`` reads it.
* ``global_sum``: the loss and units of a step summed over the processes (every rank's guards see the same values).
* ``full_model``: the unsharded weights on the main process, for saving (``from_pretrained`` on one device),
  sample grids and generations. Under FSDP2 the parameters are ``DTensor`` shards: the full state dict is gathered
  (a collective on every rank) into a plain copy of the model kept on the CPU.
* ``local`` / ``full_tensor``: a tensor's shard on this rank, and the whole tensor (gathered when sharded).
* ``end_processes``: the end of a multi-process run without the exit hang of a gloo group (below).
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from typing import Any

import torch


def world_size_from_env() -> int:
    """Processes the launcher started (before any process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """The main process (rank 0), also before and after the Accelerator exists: what prints the results."""
    return int(os.environ.get("RANK", "0")) == 0


def make_accelerator(**kwargs: Any):
    """``Accelerator(**kwargs)``; several processes without CUDA (or with ``ACCELERATE_USE_CPU``): CPU processes
    over gloo, FSDP included."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    cpu_asked = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    if world_size_from_env() > 1 and (cpu_asked or not torch.cuda.is_available()):
        kwargs["cpu"] = True
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            state = PartialState(cpu=True)  # gloo process group, distributed type MULTI_CPU
            if state.distributed_type == DistributedType.MULTI_CPU:
                PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return Accelerator(**kwargs)


def kind(accelerator) -> str:
    """'single', 'ddp' (several processes, whole replicas) or 'fsdp2' (sharded parameters)."""
    if accelerator.num_processes == 1:
        return "single"
    return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "ddp"


def is_sharded(accelerator) -> bool:
    return kind(accelerator) == "fsdp2"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself unless it is a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (gathered from every rank when it is a DTensor: call on every rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def global_sum(accelerator, *values: torch.Tensor) -> list[torch.Tensor]:
    """Each 0-d tensor summed over the processes (one all-reduce); unchanged with one process."""
    if accelerator.num_processes == 1:
        return list(values)
    stacked = torch.stack([v.detach().float() for v in values])
    return list(accelerator.reduce(stacked, reduction="sum"))


def gather_list(accelerator, items: list) -> list:
    """Every rank's ``items`` concatenated, on every rank (e.g. the names of non-finite shards)."""
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    return list(gather_object(list(items)))


def end_processes(accelerator) -> None:
    """Wait for every rank, then end the run (``end_training``: trackers, the process group), leaving the group's
    worker threads time to drop the last collectives first.

    A finished gloo collective is freed on its worker thread, which takes the GIL to release the Python tensors it
    held (a barrier holds the all-gather before it). Once ``end_training`` has destroyed the group, DDP's reducer
    holds its last reference, and freeing the model joins those threads inside gloo's destructor with the GIL held:
    a worker still waiting for the GIL then hangs the process for ever in ``~ProcessGroupGloo`` after its results
    are written (pytorch/pytorch#56297). Sleeping releases the GIL."""
    import time

    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:
        time.sleep(0.2)
    accelerator.end_training()


def template_of(accelerator, model: torch.nn.Module) -> torch.nn.Module | None:
    """A plain copy of ``model`` (still on the CPU) to gather FSDP2 weights into on the main process; else None.
    Call before ``accelerator.prepare``."""
    if not (accelerator.num_processes > 1 and getattr(accelerator, "is_fsdp2", False)):
        return None
    return copy.deepcopy(model) if accelerator.is_main_process else None


@contextmanager
def full_model(accelerator, model: torch.nn.Module, template: torch.nn.Module | None):
    """Inside: the model with whole tensors on the main process (None on the others), on the training device.

    DDP and one process: ``unwrap_model(model)`` itself. FSDP2: the gathered state dict loaded into ``template``;
    every rank must enter (the gather is a collective)."""
    if not is_sharded(accelerator):
        yield accelerator.unwrap_model(model) if accelerator.is_main_process else None
        return
    state = accelerator.get_state_dict(model)  # full tensors on the main process (FULL_STATE_DICT), all ranks call
    if not accelerator.is_main_process:
        yield None
        return
    template.load_state_dict(state, strict=False)
    del state
    template.to(accelerator.device)
    template.train(model.training)
    try:
        yield template
    finally:
        template.to("cpu")


def load_full_state(accelerator, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors ``state`` (read by every rank) into the sharded ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def peak_memory_per_process(accelerator, measured: dict[str, float]) -> list[dict[str, float]]:
    """Each process's peak memory figures (``metrics.peak_memory``), in rank order, on every rank."""
    return gather_list(accelerator, [{"rank": accelerator.process_index, **measured}])
