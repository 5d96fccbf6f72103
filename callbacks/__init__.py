"""Lightning callbacks (importing this package registers them for `class_path: Name` in configs)."""

from callbacks.freeze import FreezeCallback
from callbacks.pass_at_k import PassAtKCallback
from callbacks.progress import PlainProgressBar, StepProgressBar
from callbacks.regression import RegressionCallback
from callbacks.summary import ParamsSummary

__all__ = ["FreezeCallback", "ParamsSummary", "PassAtKCallback", "PlainProgressBar", "RegressionCallback",
           "StepProgressBar"]
