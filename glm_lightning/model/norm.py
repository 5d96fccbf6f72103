"""RMSNorm (Zhang & Sennrich 2019, as used by DeepSeek-V3 / GLM-5): y = w * x / sqrt(mean(x^2) + eps).

Computed in fp32 (fp64 inputs stay fp64) and cast back, so low-precision inputs do not lose the normalisation.
`weight=False` gives the unweighted norm. The forward is one fused ATen kernel (`_fused_rms_norm`, which also returns
rstd) and the backward is written out from the saved rstd: with autograd recording, `F.rms_norm` on a CPU falls back
to the composite pow/mean/add/rsqrt/mul chain, and its PowBackward0 alone was ~15% of a flash-25m backward pass.
(PyTorch has no CPU kernel for `_fused_rms_norm_backward`.)
"""

from __future__ import annotations

import torch
from torch import nn


class _FusedRMSNorm(torch.autograd.Function):
    """y = weight * x * rstd over the last dim, rstd = rsqrt(mean(x^2) + eps); backward from the saved rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        # xh = x * rstd, y = w * xh:  dx = rstd * (dxh - xh * mean(dxh * xh)),  dxh = w * dy,  dw = sum(dy * xh)
        x, rstd, weight = ctx.saved_tensors
        xh = x * rstd
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (grad * xh).reshape(-1, x.shape[-1]).sum(0)
        gx = None
        if ctx.needs_input_grad[0]:
            gxh = grad if weight is None else grad * weight
            dot = (gxh * xh).mean(-1, keepdim=True)
            gx = torch.addcmul(gxh, xh, dot, value=-1.0).mul_(rstd)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim, fp32 (or fp64) compute, result in x's dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x if x.dtype == dt else x.to(dt)
    w = weight if weight is None or weight.dtype == dt else weight.to(dt)
    y = _FusedRMSNorm.apply(xc if xc.is_contiguous() else xc.contiguous(), w, eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, fp32 compute, optional learnable scale (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"
