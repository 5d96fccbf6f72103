"""KDA's elementwise ops (glm_lightning/model/ops/kda_inputs.py, ops/norm.py) against their reference forms: values and every
gradient within 1e-5 in fp32, gradcheck in fp64, and the clamped (near-zero) q/k branch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import cext
from glm_lightning.model.ops import kda_inputs, norm, reference

KDAFeaturesCpp = kda_inputs._KDAFeaturesCpp
GatedHeadNormCpp = norm._GatedHeadNormCpp


class KDAFeatures:
    """The features' PyTorch form (its reference, autograd for the backward), with a Function's ``apply``."""

    apply = staticmethod(reference.kda_features)


class GatedHeadNorm:
    """The gated head norm's PyTorch form (its reference, autograd for the backward), with a Function's ``apply``."""

    apply = staticmethod(reference.gated_head_norm)


needs_cpp = pytest.mark.skipif(not cext.available(), reason="C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")
FEATURES = [KDAFeatures, pytest.param(KDAFeaturesCpp, marks=needs_cpp)]
GATED_NORMS = [GatedHeadNorm, pytest.param(GatedHeadNormCpp, marks=needs_cpp)]

B, T, H, K, LB = 2, 5, 3, 4, -5.0


def _rescale(dtype=torch.float32):
    return torch.tensor([K ** 0.5] * H + [1.0] * H, dtype=dtype).view(2 * H, 1)


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


@pytest.mark.parametrize("fn", FEATURES)
def test_features_equal_the_eager_formulas(fn):
    inputs, extra = _inputs(torch.float32), (_rescale(), LB)
    outs, grads = _values_and_grads(fn.apply, inputs, extra)
    outs_ref, grads_ref = _values_and_grads(reference.kda_features, inputs, extra)
    for a, b in zip(outs, outs_ref):  # the eager Function runs the same ops forward; the C++ op rounds its own way
        tol = 0 if fn is KDAFeatures else 1e-6
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for name, a, b in zip(["y", "f", "b", "A_log"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")
    inputs64 = [x.double().requires_grad_() for x in _inputs(torch.float64, seed=2)]
    inputs64[0].data[0, 1, :K] = 0.3  # gradcheck away from the clamp's kink
    assert torch.autograd.gradcheck(lambda *xs: fn.apply(*xs, _rescale(torch.float64), LB), inputs64)


@pytest.mark.parametrize("fn", GATED_NORMS)
def test_gated_head_norm_equals_the_eager_formula(fn):
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(B, T, H, K, generator=gen)
    gate, weight = torch.randn(B, T, H * K, generator=gen), torch.randn(K, generator=gen)
    outs, grads = _values_and_grads(fn.apply, [o, gate, weight], (1e-5,))
    outs_ref, grads_ref = _values_and_grads(reference.gated_head_norm, [o, gate, weight], (1e-5,))
    torch.testing.assert_close(outs[0], outs_ref[0], rtol=1e-6, atol=1e-6)
    for name, a, b in zip(["o", "gate", "weight"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")
    args64 = [t.double().requires_grad_() for t in (o, gate, weight)]
    assert torch.autograd.gradcheck(lambda *xs: fn.apply(*xs, 1e-5), args64)
    # the module's own RMSNorm gives the same normalised values (weight 1, gate -> +inf)
    torch.testing.assert_close(fn.apply(o, torch.full_like(gate, 50.0), torch.ones(K), 1e-5),
                               F.rms_norm(o, (K,), eps=1e-5).reshape(B, T, H * K), rtol=1e-6, atol=1e-6)


@needs_cpp
def test_cpp_ops_over_many_row_blocks_equal_the_eager_functions_at_any_thread_count():
    """400 token rows (7 of the ops' 64-row blocks, the last partial), the study model's head size: the C++ forms equal
    the eager Functions within float rounding, and their parameter gradients (A_log, the norm weight: sums over
    fixed row blocks) are bit for bit the same at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(4)
    Bb, Tt, Hh, Kk = 4, 100, 3, 16
    y = torch.randn(Bb, Tt, 3 * Hh * Kk, generator=gen)
    f, b = torch.randn(Bb, Tt, Hh * Kk, generator=gen), torch.randn(Bb, Tt, Hh, generator=gen)
    A_log = torch.randn(Hh, generator=gen)
    rescale = torch.tensor([Kk ** 0.5] * Hh + [1.0] * Hh).view(2 * Hh, 1)
    o, gate, weight = (torch.randn(Bb, Tt, Hh, Kk, generator=gen), torch.randn(Bb, Tt, Hh * Kk, generator=gen),
                       torch.randn(Kk, generator=gen))
    cases = [(KDAFeatures, KDAFeaturesCpp, [y, f, b, A_log], (rescale, LB)),
             (GatedHeadNorm, GatedHeadNormCpp, [o, gate, weight], (1e-5,))]
    threads = torch.get_num_threads()
    try:
        for eager, cpp, inputs, extra in cases:
            outs_ref, grads_ref = _values_and_grads(eager.apply, inputs, extra)
            torch.set_num_threads(1)
            outs_1, grads_1 = _values_and_grads(cpp.apply, inputs, extra)
            torch.set_num_threads(2)
            outs_2, grads_2 = _values_and_grads(cpp.apply, inputs, extra)
            for a, r in zip(outs_1, outs_ref):
                torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
            for a, r in zip(grads_1, grads_ref):
                torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
            for a, c in zip((*outs_1, *grads_1), (*outs_2, *grads_2)):
                assert torch.equal(a, c)
    finally:
        torch.set_num_threads(threads)
