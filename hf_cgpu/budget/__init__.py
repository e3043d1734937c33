"""The ledger: what a run needs on one card (memory) and how long it takes (time), before it starts.

    shape.py   ModelShape (from a model config) and TrainSetup (the run's TrainSettings plus its task's sequence);
               RunShape, what a task declares
    memory.py  bytes of every kind of GPU memory in one step, and the peak (``ledger``)
    time.py    training FLOPs per token (the trainer's MFU counts them too) and hours
    ladder.py  the memory-saving ladder: ``autofit``, ``next_rung``, the trainer's ``--autofit`` and OOM advice

``hf-cgpu budget`` (``hf_cgpu.commands.budget``) reads a training command line and prints all of it.
"""

from .ladder import LADDER, RUNGS, TRAINER_RUNGS, FitPlan, autofit, autofit_settings, next_rung, oom_advice
from .memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_FRACTION,
    LOGITS_CHUNK_BYTES,
    LOGITS_EAGER_BYTES,
    WORKSPACE_BYTES,
    GiB,
    Ledger,
    MiB,
    Regime,
    Row,
    activation_bytes,
    fmt_gib,
    layer_activation_bytes_per_token,
    ledger,
    lora_trainable_params,
    model_state_bytes,
    outside_blocks_bytes_per_token,
    parse_memory,
    regime,
)
from .images import ImageLedger, image_ledger, image_step_work, sample_memory, sample_work
from .shape import ModelShape, RunShape, TrainSetup
from .time import chinchilla_tokens, flops_per_token, peak_tflops, training_hours

__all__ = [name for name in dir() if not name.startswith("_")]
