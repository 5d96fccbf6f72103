"""RMSNorm computed in fp32 (Zhang & Sennrich 2019, as used by DeepSeek-V3 / GLM-5).

y = w * x / sqrt(mean(x^2) + eps). The statistic is taken in fp32 and the result cast back, so low-precision inputs
do not lose the normalisation. `weight=False` gives the unweighted norm used on mHC's flattened streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, fp32 compute, optional learnable scale (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"
