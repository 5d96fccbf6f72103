"""The shared GLM model: one module wrapped by every training stage."""

from glm_lightning.model.cache import ModelCache
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.model import Block, GLMModel, GLMOutput

__all__ = ["Block", "GLMConfig", "GLMModel", "GLMOutput", "ModelCache"]
