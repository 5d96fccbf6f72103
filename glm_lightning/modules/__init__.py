"""Stage LightningModules, all wrapping the one shared GLMModel."""

from glm_lightning.modules.base import StageModule
from glm_lightning.modules.pretrain import PretrainModule
from glm_lightning.modules.rl import RLModule
from glm_lightning.modules.vision import VisionModule

__all__ = ["StageModule", "PretrainModule", "RLModule", "VisionModule"]
