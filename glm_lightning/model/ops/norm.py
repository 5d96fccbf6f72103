"""RMSNorm and KDA's gated head norm (references: ``reference.rms_norm``, ``reference.gated_head_norm``).

y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (fp64 stays fp64) and cast back. The C++ ops (csrc/rms_norm.cpp)
are one pass each way. The PyTorch form of the norm is :class:`_RMSNorm`, kept beside them with its hand-written
backward: with autograd recording, ``F.rms_norm`` on a CPU falls back to the composite pow/mean/add/rsqrt/mul chain,
and its PowBackward0 alone was ~15% of a flash-25m backward pass; the reference form with autograd made a study-model
training step without the C++ ops 1.25x slower (benchmarks/bench_twins.py). The gated head norm's PyTorch form is its
reference (a hand-written twin measured 1.11x, within the noise of the shared machine, and went).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from glm_lightning.model.ops import backend, mixed_precision as mp, reference


@functools.lru_cache(maxsize=16)
def eps_tensor(eps: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """eps as a 0-d tensor (cached: `new_full` would be 3 dispatched ops per call)."""
    with torch.inference_mode(False):
        return torch.tensor(eps, dtype=dtype, device=device)


class _RMSNorm(torch.autograd.Function):
    """y = weight * x * rstd over the last dim, rstd = rsqrt(mean(x^2) + eps); backward from the saved rstd."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:  # type: ignore[override]
        # rstd from one vector_norm: mean(x^2) = |x|^2 / C (ATen's CPU _fused_rms_norm is itself a 20-op composite)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = torch.addcmul(eps_tensor(eps, x.dtype, x.device), norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
        y = x * rstd
        if weight is not None:
            y.mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
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
    """:class:`_RMSNorm` with a weight as the C++ ops: one pass each way (rstd recomputed in the backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.ops.glm_lightning.rms_norm(x, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx, gw = torch.ops.glm_lightning.rms_norm_backward(grad, x, weight, ctx.eps)
        return gx.view(x.shape), gw, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, fp32 (or fp64) compute, result in x's dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x if x.dtype == dt else x.to(dt)
    w = weight if weight is None or weight.dtype == dt else weight.to(dt)
    xc = xc if xc.is_contiguous() else xc.contiguous()
    y = _RMSNormCpp.apply(xc, w, eps) if w is not None and backend.takes(xc, w) else _RMSNorm.apply(xc, w, eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class _GatedHeadNormCpp(torch.autograd.Function):
    """RMSNorm_head(o) * weight * sigmoid(gate) as the C++ ops of csrc/rms_norm.cpp: one pass each way (the rstd and the
    gate sigmoid recomputed in the backward) instead of ~8 and ~10 ATen ops per layer."""

    @staticmethod
    def forward(ctx, o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        B, T, H, K = o.shape
        ctx.save_for_backward(o, gate, weight)
        ctx.eps = eps
        return torch.ops.glm_lightning.gated_head_norm(o, gate, weight, eps).view(B, T, H * K)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        o, gate, weight = ctx.saved_tensors
        do, dgate, dw = torch.ops.glm_lightning.gated_head_norm_backward(dy, o, gate, weight, ctx.eps)
        return do.view(o.shape), dgate.view(gate.shape), dw, None


@mp.fp32_op
def gated_head_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA's output norm RMSNorm_head(o) * weight * sigmoid(gate): o [B, T, H, K] (fp32), gate [B, T, H*K] ->
    [B, T, H*K] fp32."""
    gate = gate if gate.dtype == torch.float32 else gate.float()
    if backend.takes(o, gate, weight):
        return _GatedHeadNormCpp.apply(o, gate, weight, eps)
    return reference.gated_head_norm(o, gate, weight, eps)
