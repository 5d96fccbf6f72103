"""KDA's elementwise steps around the core (references: ``reference.short_conv``, ``reference.kda_features``): the
causal short conv + SiLU over the q|k|v projections, then the features (unit-norm q and k, v, the gates g and beta).

Why: the study model is dispatch-bound (~15 us per op). Left to autograd the features recorded ~25 nodes per layer
that replayed as ~130 ops; the C++ ops (csrc/kda_pointwise.cpp, csrc/short_conv.cpp) are one pass each way (the oneDNN
conv, SiLU and their backward were ~6 passes, the conv backward alone 0.5 ms for the study model's [8, 128, 144]).

Without the C++ ops the features run their reference form with autograd: a hand-written PyTorch twin measured within
the noise of it and went (``python -m benchmarks.bench_twins``, C++ ops off: 0.96x and 0.99x on the study model, 1.05x
on flash-25m, against a no-swap control that read 0.95x-1.04x). The short conv's PyTorch form is a depthwise ``conv2d`` on the channels-last view of the [B, T, 3HK] projections
(oneDNN consumes and produces it without transposes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, mixed_precision as mp, reference, thresholds


class _KDAFeaturesCpp(torch.autograd.Function):
    """The features as the C++ ops: one pass forward, one backward (which recomputes the norms and gate sigmoids from
    the saved inputs) instead of ~14 and ~18 ATen ops per layer."""

    @staticmethod
    def forward(ctx, y: Tensor, f: Tensor, b: Tensor, A_log: Tensor, rescale: Tensor,  # type: ignore[override]
                lb: float) -> tuple[Tensor, ...]:
        B, T, _ = y.shape
        H = A_log.shape[0]
        K = f.shape[-1] // H
        y = y if y.is_contiguous() else y.contiguous()
        a = A_log.exp()
        qk, g, beta = torch.ops.glm_lightning.kda_features(y, f, b, a, rescale, lb)
        ctx.save_for_backward(y, f, beta, a, rescale)
        ctx.lb, ctx.b_shape = lb, b.shape
        q, k = qk.view(B, T, 2 * H, K).split(H, dim=2)
        return q, k, y.view(B, T, 3 * H, K)[:, :, 2 * H:], g.view(B, T, H, K), beta.view(B, T, H)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, dg: Tensor, dbeta: Tensor):  # type: ignore[override]
        y, f, beta, a, rescale = ctx.saved_tensors
        dy, df, db, dA = torch.ops.glm_lightning.kda_features_backward(dq, dk, dv, dg, dbeta, y, f, beta, a, rescale,
                                                                       ctx.lb)
        return dy.view(y.shape), df.view(f.shape), db.view(ctx.b_shape), dA, None, None


def pads_as_identity(k: Tensor, g: Tensor, beta: Tensor,
                     valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """k, g [B, T, H, K] and beta [B, T, H] with the pad steps (``valid`` False) made identity steps of the state:
    k = 0, g = 0 (no decay), beta = 0 (no write)."""
    if valid is None:
        return k, g, beta
    pad = ~valid
    return (k.masked_fill(pad[..., None, None], 0.0), g.masked_fill(pad[..., None, None], 0.0),
            beta.masked_fill(pad[..., None], 0.0))


@mp.fp32_op
def kda_features(y: Tensor, f: Tensor, b: Tensor, A_log: Tensor, rescale: Tensor,
                 lb: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v [B, T, H, K], g [B, T, H, K], beta [B, T, H] from the conv output y [B, T, 3HK], the gate input f
    [B, T, HK] and b [B, T, H] (all fp32), A_log [H], rescale [2H, 1] (see ``reference.kda_features``)."""
    if backend.takes(y, f, b, A_log, rescale, op="kda_features"):
        return _KDAFeaturesCpp.apply(y, f, b, A_log, rescale, lb)
    return reference.kda_features(y, f, b, A_log, rescale, lb)


class _ShortConvCpp(torch.autograd.Function):
    """(x [B, T, C] raw projections, weight [C, 1, ks]) -> SiLU(causal depthwise conv(x)) [B, T, C], zeros before
    t = 0, through ``glm_lightning::short_conv_silu`` and its backward (which recomputes the conv output)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        x = x if x.is_contiguous() else x.contiguous()
        ctx.save_for_backward(x, weight)
        return torch.ops.glm_lightning.short_conv_silu(x, weight.view(weight.shape[0], -1))

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dx, dw = torch.ops.glm_lightning.short_conv_silu_backward(dy, x, weight.view(weight.shape[0], -1))
        return dx, dw.view_as(weight)


@mp.fp32_op
def short_conv(raw: Tensor, weight: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """SiLU(causal depthwise conv) over time (see ``reference.short_conv``): raw [B, T, C], weight [C, 1, ks],
    context [B, ks-1, C] the previous raw inputs or None for zeros (training). Returns [B, T, C] and, with a context,
    the raw inputs after it [B, ks-1+T, C] (the next context's source)."""
    T, ks, C = raw.shape[1], weight.shape[-1], raw.shape[-1]
    if context is None and ks <= thresholds.SHORT_CONV_MAX_KERNEL and backend.takes(raw, weight, op="short_conv"):
        return _ShortConvCpp.apply(raw, weight), None
    # [B, T, C] viewed as [B, C, 1, T] is channels-last memory: oneDNN's depthwise conv2d needs no transpose copies
    if context is None:
        xp = None
        y = F.conv2d(raw.transpose(1, 2).unsqueeze(2), weight.unsqueeze(2), groups=C, padding=(0, ks - 1))
        y = y[..., :T]                                                           # causal: left context only
    else:
        xp = torch.cat([context.to(raw.dtype), raw], dim=1)
        y = F.conv2d(xp.transpose(1, 2).unsqueeze(2), weight.unsqueeze(2), groups=C)
    return F.silu(y.squeeze(2).transpose(1, 2)), xp
