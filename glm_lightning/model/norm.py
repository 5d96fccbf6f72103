"""RMSNorm (Zhang & Sennrich 2019, as used by DeepSeek-V3 / GLM-5): y = w * x / sqrt(mean(x^2) + eps).

Computed in fp32 (fp64 inputs stay fp64) and cast back, so low-precision inputs do not lose the normalisation
(glm_lightning/model/ops/norm.py; its reference form is ``ops.reference.rms_norm``).
"""

from __future__ import annotations

import torch
from torch import nn

from glm_lightning.model import ops


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, fp32 compute, optional learnable scale (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"
