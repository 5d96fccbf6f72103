"""KDA's elementwise steps around the chunked core as autograd Functions with hand-written backward passes.

Why: the study model is dispatch-bound (~15 us per op), and left to autograd these few lines recorded ~25 nodes per
layer (slices, views, norm, clamp, division, split, exp, sigmoids, products) that replayed as ~130 ops. The forward
of each Function runs the same ops as the eager form in glm_lightning/model/kda.py (tests/test_kda.py compares them):

* :class:`KDAFeatures`: conv output y = [q | k | v] -> unit-norm q (scaled by K^-0.5), unit-norm k, v, and the gates
  g = lb * sigmoid(exp(A_log) * f), beta = sigmoid(b). For u = x / (max(|x|, 1e-6) r):
  dx = (du - [|x| >= 1e-6] x_hat <x_hat, du>) / (max(|x|, 1e-6) r), x_hat = x / |x|.
* :class:`GatedHeadNorm`: the output RMSNorm_head(o) * sigmoid(gate), flattened to [B, T, H*K].
* :class:`ShortConvSiLU`: the causal depthwise short conv + SiLU of a cache-free forward as the C++ ops of
  csrc/short_conv.cpp (one pass each way; the oneDNN conv, SiLU and their backward were ~6, and the conv backward
  alone 0.5 ms for the study model's [8, 128, 144]); the eager conv2d form stays in kda.py as the fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_lightning.model.norm import _eps_tensor

_L2_EPS = 1e-6
"""The eps of the q/k L2 norm (as F.normalize)."""


class KDAFeatures(torch.autograd.Function):
    """(y [B, T, 3HK], f [B, T, HK], b [B, T, H], A_log [H], rescale [2H, 1], lb) -> q, k, v [B, T, H, K], g, beta.

    ``rescale`` holds sqrt(K) for the q heads and 1 for the k heads (q / |q| * K^-0.5 in the same division).
    """

    @staticmethod
    def forward(ctx, y: Tensor, f: Tensor, b: Tensor, A_log: Tensor, rescale: Tensor,  # type: ignore[override]
                lb: float) -> tuple[Tensor, ...]:
        B, T, _ = y.shape
        H = A_log.shape[0]
        K = f.shape[-1] // H
        y4 = y.view(B, T, 3 * H, K) if y.is_contiguous() else y.reshape(B, T, 3 * H, K)
        qk = y4[:, :, :2 * H]
        norm = torch.linalg.vector_norm(qk, dim=-1, keepdim=True)
        denom = norm.clamp_min(_L2_EPS).mul_(rescale)
        qk_n = qk / denom
        a = A_log.exp().view(H, 1)
        s = torch.sigmoid(a * f.view(B, T, H, K))
        beta = torch.sigmoid(b)
        ctx.save_for_backward(qk_n, norm, denom, rescale, f, a, s, beta)
        ctx.lb = lb
        q, k = qk_n.split(H, dim=2)
        return q, k, y4[:, :, 2 * H:], s * lb, beta

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, dg: Tensor, dbeta: Tensor):  # type: ignore[override]
        qk_n, norm, denom, rescale, f, a, s, beta = ctx.saved_tensors
        B, T, H2, K = qk_n.shape
        dqk = torch.cat([dq, dk], dim=2)
        # x_hat = u * rescale where the norm is not clamped (else the direction term is absent)
        x_hat = qk_n * (rescale * (norm >= _L2_EPS))
        dx = torch.addcmul(dqk, x_hat, (dqk * x_hat).sum(-1, keepdim=True), value=-1.0).div_(denom)
        dy = torch.cat([dx, dv], dim=2).view(B, T, -1)
        dz = torch.ops.aten.sigmoid_backward(dg, s).mul_(ctx.lb)              # d(a f), [B, T, H, K]
        dA = (dz * f.view_as(dz)).sum(dim=(0, 1, 3)).mul_(a.view(-1))        # d/dA_log of exp(A_log) = a
        df = (dz * a).view(B, T, -1)
        return dy, df, torch.ops.aten.sigmoid_backward(dbeta, beta), dA, None, None


class GatedHeadNorm(torch.autograd.Function):
    """(o [B, T, H, K], gate [B, T, H*K], weight [K], eps) -> RMSNorm(o) * weight * sigmoid(gate) as [B, T, H*K].

    Backward: with xh = o * rstd, sg = sigmoid(gate):  dgate = sigmoid'(dy * xh * w),  dn = dy * sg,
    dw = sum(dn * xh),  do = rstd * (dn w - xh * mean(dn w xh)).
    """

    @staticmethod
    def forward(ctx, o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        B, T, H, K = o.shape
        norm = torch.linalg.vector_norm(o, dim=-1, keepdim=True)
        rstd = torch.addcmul(_eps_tensor(eps, o.dtype, o.device), norm, norm, value=1.0 / K).rsqrt_()  # as RMSNorm
        xh = o * rstd
        xw = xh * weight
        sg = torch.sigmoid(gate.view(B, T, H, K))
        ctx.save_for_backward(xh, rstd, weight, xw, sg)
        return (xw * sg).view(B, T, H * K)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        xh, rstd, weight, xw, sg = ctx.saved_tensors
        B, T, H, K = xh.shape
        dy = dy.reshape(B, T, H, K)
        dgate = torch.ops.aten.sigmoid_backward(dy * xw, sg).view(B, T, H * K)
        dn = dy * sg
        dw = (dn * xh).sum(dim=(0, 1, 2))
        dxw = dn.mul_(weight)
        do = torch.addcmul(dxw, xh, (dxw * xh).sum(-1, keepdim=True), value=-1.0 / K).mul_(rstd)
        return do, dgate, dw, None


class ShortConvSiLU(torch.autograd.Function):
    """(x [B, T, C] raw projections, weight [C, 1, ks]) -> SiLU(causal depthwise conv(x)) [B, T, C], zeros before
    t = 0, through ``glm_lightning::short_conv_silu`` and its backward (which recomputes the conv output)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        x = x if x.is_contiguous() else x.contiguous()
        ctx.save_for_backward(x, weight)
        return torch.ops.glm_lightning.short_conv_silu(x, weight.view(weight.shape[0], -1))

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dx, dw = torch.ops.glm_lightning.short_conv_silu_backward(dy, x, weight.view(weight.shape[0], -1))
        return dx, dw.view_as(weight)


class KDAFeaturesCpp(torch.autograd.Function):
    """:class:`KDAFeatures` as the C++ ops of csrc/kda_pointwise.cpp: one pass forward, one backward (which recomputes
    the norms and gate sigmoids from the saved inputs) instead of ~14 and ~18 ATen ops per layer. Same inputs and
    outputs, values within float rounding of the eager form (tests/test_kda_fused.py)."""

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
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, dg: Tensor, dbeta: Tensor):  # type: ignore[override]
        y, f, beta, a, rescale = ctx.saved_tensors
        dy, df, db, dA = torch.ops.glm_lightning.kda_features_backward(dq, dk, dv, dg, dbeta, y, f, beta, a, rescale,
                                                                       ctx.lb)
        return dy.view(y.shape), df.view(f.shape), db.view(ctx.b_shape), dA, None, None


class GatedHeadNormCpp(torch.autograd.Function):
    """:class:`GatedHeadNorm` as the C++ ops of csrc/rms_norm.cpp (its row norm with a gate): one pass each way (the rstd and the gate
    sigmoid recomputed in the backward) instead of ~8 and ~10 ATen ops per layer. Same inputs and outputs."""

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
