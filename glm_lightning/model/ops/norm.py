"""RMSNorm and KDA's gated head norm (references: ``reference.rms_norm``, ``reference.gated_head_norm``).

y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (fp64 stays fp64) and cast back. The C++ ops (csrc/rms_norm.cpp)
are one pass each way. Without them both norms run their reference forms with autograd: hand-written PyTorch twins
of each (with their own backward) measured within the noise of their reference forms, so they went
(``python -m benchmarks.bench_twins``, C++ ops off, median of alternated rounds against a no-swap control that read
0.95x-1.04x: RMSNorm 0.94x and 1.03x on the study model, 1.02x on flash-25m; the gated head norm 1.11x earlier)."""

from __future__ import annotations

import torch
from torch import Tensor

from glm_lightning.model.ops import backend, decode, mixed_precision as mp, reference


class _RMSNormCpp(torch.autograd.Function):
    """RMSNorm with a weight as the C++ ops: one pass each way (rstd recomputed in the backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.ops.glm_lightning.rms_norm(x, weight, eps).view(x.shape)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx, gw = torch.ops.glm_lightning.rms_norm_backward(grad, x, weight, ctx.eps)
        return gx.view(x.shape), gw, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, fp32 (or fp64) compute, result in x's dtype."""
    f32 = torch.float32
    if decode.cpp("rms_norm") and weight is not None and x.dtype is f32 and weight.dtype is f32 and x.is_contiguous():
        return torch.ops.glm_lightning.rms_norm(x, weight, eps).view(x.shape)  # a decode step: the op itself
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x if x.dtype == dt else x.to(dt)
    w = weight if weight is None or weight.dtype == dt else weight.to(dt)
    xc = xc if xc.is_contiguous() else xc.contiguous()
    if w is not None and backend.takes(xc, w, op="rms_norm"):
        # without autograd the op itself: Function.apply's node and saved tensors cost a decode step ~1 us per call
        y = (_RMSNormCpp.apply(xc, w, eps) if backend.needs_grad(xc, w)
             else torch.ops.glm_lightning.rms_norm(xc, w, eps).view(xc.shape))
    else:
        y = reference.rms_norm(xc, w, eps)
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
    @mp.autocast_off_backward
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        o, gate, weight = ctx.saved_tensors
        do, dgate, dw = torch.ops.glm_lightning.gated_head_norm_backward(dy, o, gate, weight, ctx.eps)
        return do.view(o.shape), dgate.view(gate.shape), dw, None


@mp.fp32_op
def gated_head_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA's output norm RMSNorm_head(o) * weight * sigmoid(gate): o [B, T, H, K] (fp32), gate [B, T, H*K] ->
    [B, T, H*K] fp32 (fp64 for an fp64 o)."""
    gate = gate if gate.dtype == o.dtype else gate.to(o.dtype)
    if backend.takes(o, gate, weight, op="gated_head_norm"):
        return _GatedHeadNormCpp.apply(o, gate, weight, eps)
    return reference.gated_head_norm(o, gate, weight, eps)
