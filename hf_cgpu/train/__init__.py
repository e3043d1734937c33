"""The one training loop for every task, and its components (see ``loop`` for the map).

    from hf_cgpu.train import fit, Task, TaskPlan
"""

from ..errors import TrainingStopped
from .ema import EMA
from .loop import fit
from .schedule import SampleOrder, lr_at, step_seed
from .task import Task, TaskPlan
from .validation import BestKeeper

__all__ = ["BestKeeper", "EMA", "SampleOrder", "Task", "TaskPlan", "TrainingStopped", "fit", "lr_at", "step_seed"]
