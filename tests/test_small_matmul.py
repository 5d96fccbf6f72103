"""glm_lightning::small_matmul (csrc/small_matmul.cpp) packs each task's weight rows into output panels and multiplies
from there: each output sums its products in order k = 0, 1, ..., as panel_matmul does on weights packed once. So it
equals panel_matmul bit for bit (a prefill and the decode steps after it compute their matmuls alike), and a row's
output does not depend on how many rows its call has or where the row falls (every register tile shape)."""

import pytest
import torch

from glm_lightning.model import cext
from tests.conftest import few_row_matmul_case

needs_cext = pytest.mark.skipif(not cext.available(), reason="C++ ops not available")

SHAPES = [(8, 14, 192, 768), (8, 19, 384, 192), (3, 40, 50, 37), (2, 33, 17, 129), (4, 6, 7, 70)]
"""(E, M, in, out): flash-25m's expert shapes at a 44-token prefill, and sizes off the lanes (ragged `in`, a ragged last
panel, a last chunk of fewer panels than a task's), with rows for several register tiles."""


@needs_cext
@pytest.mark.parametrize("shape", SHAPES)
def test_small_matmul_equals_panel_matmul_bit_for_bit(shape):
    E, M, n_in, n_out = shape
    x, W, bias, counts = few_row_matmul_case(shape)
    P = torch.ops.glm_lightning.panel_pack(W, None)
    for b in (None, bias):
        y = torch.ops.glm_lightning.small_matmul(x, W, counts, b)
        assert torch.equal(y, torch.ops.glm_lightning.panel_matmul(x, P, n_out, counts, b))
        ref = torch.bmm(x, W.transpose(1, 2)) + (0 if b is None else b[:, None])
        for e, c in enumerate(counts.tolist()):
            torch.testing.assert_close(y[e, :c], ref[e, :c], rtol=1e-5, atol=1e-5)
            assert torch.count_nonzero(y[e, c:]) == 0
    one = torch.ops.glm_lightning.small_matmul(x[0], W[0], None, bias[0])
    assert torch.equal(one, torch.ops.glm_lightning.panel_matmul(x[0], P[0], n_out, None, bias[0]))


@needs_cext
@pytest.mark.parametrize("n_in, n_out", [(192, 70), (24, 33)])
def test_a_rows_output_does_not_depend_on_its_call(n_in, n_out):
    """Rows 0 .. m-1 of an m-row call, for every m up to 40 (1 to 3 register tiles of each width), and any window of
    rows, equal the same rows of the 40-row call bit for bit."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, n_in, generator=gen)
    W = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
    b = torch.randn(n_out, generator=gen)
    full = torch.ops.glm_lightning.small_matmul(x, W, None, b)
    for m in range(1, 41):
        assert torch.equal(torch.ops.glm_lightning.small_matmul(x[:m], W, None, b), full[:m]), m
        assert torch.equal(torch.ops.glm_lightning.small_matmul(x[40 - m:], W, None, b), full[40 - m:]), m


@needs_cext
def test_no_rows_and_strided_inputs():
    """No real rows give zeros; a strided x and a transposed-then-contiguous W give the contiguous result."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 64, generator=gen)
    W = torch.randn(2, 48, 64, generator=gen)
    assert torch.count_nonzero(torch.ops.glm_lightning.small_matmul(x, W, torch.zeros(2, dtype=torch.long))) == 0
    wide = torch.randn(9, 128, generator=gen)
    Wt = torch.randn(64, 30, generator=gen).t()
    assert torch.equal(torch.ops.glm_lightning.small_matmul(wide[:, ::2], Wt),
                       torch.ops.glm_lightning.small_matmul(wide[:, ::2].contiguous(), Wt.contiguous()))


@needs_cext
@pytest.mark.parametrize("shape", [(8, 14, 192, 768), (3, 40, 50, 38), (2, 33, 17, 130), (3, 5, 20, 2)])
def test_swiglu_form_equals_swiglu_of_the_projections(shape):
    """swiglu=True: W = [W_gate; W_up] -> SiLU(x W_gate^T) * (x W_up^T) on the real rows, zeros on the padding rows,
    bit for bit the C++ SwiGLU (csrc/swiglu.cpp) of small_matmul's [gate | up] sums (hidden sizes off the lanes: a
    ragged last panel of gate and of up units; pre-activations up to ~+-15, SiLU's tails)."""
    x, W, _, counts = few_row_matmul_case(shape)
    W = 4 * W
    a = torch.ops.glm_lightning.small_matmul(x, W, counts, None, swiglu=True)
    assert a.shape == (*x.shape[:2], shape[3] // 2)
    assert torch.equal(a, torch.ops.glm_lightning.swiglu(torch.ops.glm_lightning.small_matmul(x, W, counts)))
    one = torch.ops.glm_lightning.small_matmul(x[0], W[0], None, None, swiglu=True)
    assert torch.equal(one, a[0])  # counts[0] = M: every row real
    with pytest.raises(RuntimeError, match="swiglu"):
        torch.ops.glm_lightning.small_matmul(x, W, counts, torch.zeros(shape[0], shape[3]), swiglu=True)
    with pytest.raises(RuntimeError, match="swiglu"):
        torch.ops.glm_lightning.small_matmul(x, W[:, 1:], counts, None, swiglu=True)


@needs_cext
@pytest.mark.parametrize("tokens", [1, 20, 32, 44, 96, 97])
def test_shared_expert_few_tokens_fused(tokens, monkeypatch):
    """Without autograd and outside a cached decode, the shared expert's SwiGLU MLP runs as small_matmul(swiglu=True)
    then small_matmul for 1..SMALL_TOKENS tokens: at up to SMALL_ROWS tokens bit for bit the values of the linears'
    small_matmul path before (linear, C++ SwiGLU, linear), above within float rounding of BLAS's; more tokens, autograd
    or a panel store keep the linears."""
    from glm_lightning.model.ops import matmul, moe, thresholds

    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 96)
    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, tokens, 48, generator=gen)
    w_gu, w_d = torch.randn(80, 48, generator=gen) * 0.3, torch.randn(48, 40, generator=gen) * 0.3
    calls = []
    real = moe._shared_small
    monkeypatch.setattr(moe, "_shared_small", lambda *a: calls.append(real(*a)) or calls[-1])
    with torch.no_grad():
        y = moe.swiglu_mlp(x, w_gu, w_d)
        assert calls == [tokens <= 96]
        hgu = x @ w_gu.t()
        ref = (torch.nn.functional.silu(hgu[..., :40]) * hgu[..., 40:]) @ w_d.t()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        if tokens <= 32:
            old = matmul.linear(torch.ops.glm_lightning.swiglu(matmul.linear(x, w_gu)), w_d)
            assert torch.equal(y, old)
        with matmul.packed_weights({}):
            moe.swiglu_mlp(x, w_gu, w_d)
    moe.swiglu_mlp(x, w_gu.requires_grad_(), w_d)
    assert calls[1:] == [False, False]
