"""KDA's fused elementwise Functions (glm_lightning/model/kda_fused.py) against the eager formulas: values and every
gradient within 1e-5 in fp32, gradcheck in fp64, and the clamped (near-zero) q/k branch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm_lightning.model.kda_fused import GatedHeadNorm, KDAFeatures

B, T, H, K, LB = 2, 5, 3, 4, -5.0


def _rescale(dtype=torch.float32):
    return torch.tensor([K ** 0.5] * H + [1.0] * H, dtype=dtype).view(2 * H, 1)


def _features_eager(y, f, b, A_log, rescale, lb):
    qk = y[..., :2 * H * K].reshape(B, T, 2 * H, K)
    q, k = (qk / (torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-6) * rescale)).split(H, dim=2)
    v = y[..., 2 * H * K:].reshape(B, T, H, K)
    g = lb * torch.sigmoid(A_log.exp().view(H, 1) * f.view(B, T, H, K))
    return q, k, v, g, torch.sigmoid(b)


def _gated_norm_eager(o, gate, weight, eps):
    rstd = torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)
    return (o * rstd * weight * torch.sigmoid(gate.view(B, T, H, K))).reshape(B, T, H * K)


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(B, T, 3 * H * K, generator=gen, dtype=dtype)
    y[0, 1, :K] = 1e-8  # one q head below the L2 eps: the clamped branch
    return [y, torch.randn(B, T, H * K, generator=gen, dtype=dtype), torch.randn(B, T, H, generator=gen, dtype=dtype),
            torch.randn(H, generator=gen, dtype=dtype)]


def _values_and_grads(fn, inputs, extra, seed=1):
    xs = [x.clone().requires_grad_() for x in inputs]
    outs = fn(*xs, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, xs)


def test_features_equal_the_eager_formulas():
    inputs, extra = _inputs(torch.float32), (_rescale(), LB)
    outs, grads = _values_and_grads(KDAFeatures.apply, inputs, extra)
    outs_ref, grads_ref = _values_and_grads(_features_eager, inputs, extra)
    for a, b in zip(outs, outs_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops forward
    for name, a, b in zip(["y", "f", "b", "A_log"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")
    inputs64 = [x.double().requires_grad_() for x in _inputs(torch.float64, seed=2)]
    inputs64[0].data[0, 1, :K] = 0.3  # gradcheck away from the clamp's kink
    assert torch.autograd.gradcheck(lambda *xs: KDAFeatures.apply(*xs, _rescale(torch.float64), LB), inputs64)


def test_gated_head_norm_equals_the_eager_formula():
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(B, T, H, K, generator=gen)
    gate, weight = torch.randn(B, T, H * K, generator=gen), torch.randn(K, generator=gen)
    outs, grads = _values_and_grads(GatedHeadNorm.apply, [o, gate, weight], (1e-5,))
    outs_ref, grads_ref = _values_and_grads(_gated_norm_eager, [o, gate, weight], (1e-5,))
    torch.testing.assert_close(outs[0], outs_ref[0], rtol=1e-6, atol=1e-6)
    for name, a, b in zip(["o", "gate", "weight"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")
    args64 = [t.double().requires_grad_() for t in (o, gate, weight)]
    assert torch.autograd.gradcheck(lambda *xs: GatedHeadNorm.apply(*xs, 1e-5), args64)
    # the module's own RMSNorm gives the same normalised values (weight 1, gate -> +inf)
    torch.testing.assert_close(GatedHeadNorm.apply(o, torch.full_like(gate, 50.0), torch.ones(K), 1e-5),
                               F.rms_norm(o, (K,), eps=1e-5).reshape(B, T, H * K), rtol=1e-6, atol=1e-6)
