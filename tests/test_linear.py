"""The hand-written-backward linear (glm_lightning/model/ops/matmul.py) equals F.linear: values and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm_lightning.model.ops.matmul as linear_mod
from glm_lightning.model import cext
from glm_lightning.model.ops import linear, thresholds

needs_cext = pytest.mark.skipif(not cext.available(), reason="C++ ops not built")


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
def test_no_grad_path_is_f_linear_bit_for_bit(shape, with_bias, contiguous, monkeypatch):
    """Without autograd linear calls mm/addmm itself (above SMALL_ROWS rows, forced here): the same values as
    F.linear, exactly."""
    monkeypatch.setattr(thresholds, "SMALL_ROWS", 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    x = x[..., ::2] if not contiguous else x[..., : shape[-1]].contiguous()
    w = torch.randn(6, shape[-1], generator=gen)
    b = torch.randn(6, generator=gen) if with_bias else None
    with torch.no_grad():
        y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 6)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)


@needs_cext
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("size", [(6, 7), (37, 50), (768, 192)])  # (out, in): off and on the 16-float lanes
def test_no_grad_few_rows_take_small_matmul(with_bias, size, monkeypatch):
    """Without autograd, fp32 calls of at most SMALL_ROWS rows run glm_lightning::small_matmul (decode steps): within
    1e-5 of F.linear, and each row's values are the same bit for bit whatever the other rows of the call are (the
    op sums a row in one order), which BLAS does not promise. One row more runs mm: F.linear exactly."""
    n_out, n_in = size
    gen = torch.Generator().manual_seed(2)
    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)  # the AVX-512 table's value (0 on AVX2: BLAS always)
    rows = thresholds.SMALL_ROWS
    x = torch.randn(rows + 1, 2 * n_in, generator=gen)[:, ::2]  # strided rows, as a decode step's slices can be
    w = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5  # outputs of order 1, as in the model
    b = torch.randn(n_out, generator=gen) if with_bias else None
    calls = []
    real = torch.ops.glm_lightning.small_matmul
    monkeypatch.setattr(linear_mod, "small_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a),
                        raising=True)
    with torch.no_grad():
        y = linear(x[:rows], w, b)
        torch.testing.assert_close(y, F.linear(x[:rows], w, b), rtol=1e-5, atol=1e-5)
        for m in (1, 3, 4, 5, rows - 1):
            assert torch.equal(linear(x[rows - m:rows].unsqueeze(0), w, b)[0], y[rows - m:])
        assert calls == [rows, 1, 3, 4, 5, rows - 1]
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
        assert len(calls) == 6
