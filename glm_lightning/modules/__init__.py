"""Stage LightningModules, all wrapping the one shared GLMModel."""

from glm_lightning.modules.base import GLMTaskModule
from glm_lightning.modules.pretrain import PretrainModule

__all__ = ["GLMTaskModule", "PretrainModule"]
