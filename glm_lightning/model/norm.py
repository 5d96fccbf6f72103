"""RMSNorm (Zhang & Sennrich 2019, as used by DeepSeek-V3 / GLM-5): y = w * x / sqrt(mean(x^2) + eps).

Computed in fp32 (fp64 inputs stay fp64) and cast back, so low-precision inputs do not lose the normalisation.
`weight=False` gives the unweighted norm. Forward and backward are written out (an autograd Function keeping only
rstd): with autograd recording, `F.rms_norm` on a CPU falls back to the composite pow/mean/add/rsqrt/mul chain, and
its PowBackward0 alone was ~15% of a flash-25m backward pass.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from glm_lightning.model import cext


@functools.lru_cache(maxsize=16)
def _eps_tensor(eps: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """eps as a 0-d tensor (cached: `new_full` would be 3 dispatched ops per call)."""
    with torch.inference_mode(False):
        return torch.tensor(eps, dtype=dtype, device=device)


class _FusedRMSNorm(torch.autograd.Function):
    """y = weight * x * rstd over the last dim, rstd = rsqrt(mean(x^2) + eps); backward from the saved rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        # rstd from one vector_norm: mean(x^2) = |x|^2 / C (ATen's CPU _fused_rms_norm is itself a 20-op composite)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = torch.addcmul(_eps_tensor(eps, x.dtype, x.device), norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
        y = x * rstd
        if weight is not None:
            y.mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        # xh = x * rstd, y = w * xh:  dx = rstd * (dxh - xh * mean(dxh * xh)),  dxh = w * dy,  dw = sum(dy * xh)
        x, rstd, weight = ctx.saved_tensors
        xh = x * rstd
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (grad * xh).sum(dim=tuple(range(x.dim() - 1)))
        gx = None
        if ctx.needs_input_grad[0]:
            gxh = grad if weight is None else grad * weight
            dot = (gxh * xh).sum(-1, keepdim=True)  # C * mean: a sum is 3 dispatched ops, a mean 9
            gx = torch.addcmul(gxh, xh, dot, value=-1.0 / x.shape[-1]).mul_(rstd)
        return gx, gw, None


class _RMSNormCpp(torch.autograd.Function):
    """`_FusedRMSNorm` (with a weight) as the C++ ops of csrc/rms_norm.cpp: one pass each way (rstd recomputed in the
    backward) instead of ~5 and ~8 dispatched ops; values within float rounding of the eager form."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.ops.glm_lightning.rms_norm(x, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx, gw = torch.ops.glm_lightning.rms_norm_backward(grad, x, weight, ctx.eps)
        return gx.view(x.shape), gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim, fp32 (or fp64) compute, result in x's dtype (the C++ ops when they take
    the tensors and there is a weight, else `_FusedRMSNorm`)."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x if x.dtype == dt else x.to(dt)
    w = weight if weight is None or weight.dtype == dt else weight.to(dt)
    xc = xc if xc.is_contiguous() else xc.contiguous()
    y = (_RMSNormCpp.apply(xc, w, eps) if w is not None and cext.takes(xc, w)
         else _FusedRMSNorm.apply(xc, w, eps))
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
