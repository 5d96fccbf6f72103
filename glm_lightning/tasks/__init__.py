"""Executable function-writing tasks (`task`, drawn from the families in `families`) and the arithmetic composition
corpus (`composition`), in pure standard library. Import what you need from those modules; the names below are the
ones most callers want.

Nothing here runs model-written code: checking a completion is the verifier's job (`glm_lightning.verifier`).
"""

from glm_lightning.tasks.families import resolve_families
from glm_lightning.tasks.task import SPLITS, Task, make_tasks

__all__ = ["SPLITS", "Task", "make_tasks", "resolve_families"]
