"""Where ``fit`` was imported from before the loop became the ``hf_cgpu.train`` package; kept for recipes and
scripts that say ``from hf_cgpu.loop import fit``."""

from .train import EMA, BestKeeper, SampleOrder, Task, TaskPlan, TrainingStopped, fit, lr_at, step_seed

__all__ = ["BestKeeper", "EMA", "SampleOrder", "Task", "TaskPlan", "TrainingStopped", "fit", "lr_at", "step_seed"]
