"""The hand-written-backward linear (glm_lightning/model/linear.py) equals F.linear: values and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model.linear import linear


@pytest.mark.parametrize("shape", [(5, 7), (2, 9, 7), (2, 3, 4, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(shape, with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    w = torch.randn(6, 7, generator=gen)
    b = torch.randn(6, generator=gen) if with_bias else None
    wy = torch.randn(*shape[:-1], 6, generator=gen)
    results = []
    for fn in (linear, F.linear):
        xs = [t.clone().requires_grad_() for t in (x, w) + ((b,) if with_bias else ())]
        y = fn(xs[0], xs[1], xs[2] if with_bias else None)
        results.append((y.detach(), torch.autograd.grad((y * wy).sum(), xs)))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same addmm / mm forward
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_linear_gradcheck_fp64_and_frozen_parts():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(linear, (x, w, b))
    # a frozen weight (e.g. a frozen stage) still gives dx, and no gradient reaches the weight
    w_frozen = w.detach()
    (gx,) = torch.autograd.grad(linear(x, w_frozen).sum(), x)
    torch.testing.assert_close(gx, w_frozen.sum(0).expand_as(x))


@pytest.mark.parametrize("shape", [(5, 7), (2, 9, 7), (4, 1, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_no_grad_path_is_f_linear_bit_for_bit(shape, with_bias, contiguous):
    """Without autograd (decoding) linear calls mm/addmm itself: the same values as F.linear, exactly."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    x = x[..., ::2] if not contiguous else x[..., : shape[-1]].contiguous()
    w = torch.randn(6, shape[-1], generator=gen)
    b = torch.randn(6, generator=gen) if with_bias else None
    with torch.no_grad():
        y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 6)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)
