"""glm_lightning::panel_pack / panel_matmul (csrc/panel_matmul.cpp): the decode's few-row matmuls on weights packed
once per generation into output panels, against torch's products, the small_matmul form and the uncached model."""

from __future__ import annotations

import pytest
import torch

from glm_lightning.generation import generate, generate_naive
from glm_lightning.model import GLMConfig, GLMModel, cext
from glm_lightning.model.ops import matmul, thresholds

from conftest import few_row_matmul_case

pytestmark = pytest.mark.skipif(not cext.available(), reason="C++ ops not available")


@pytest.mark.parametrize("shape", [(4, 5, 192, 768), (3, 16, 20, 7), (2, 21, 33, 40), (21, 20, 24, 17)])
def test_panel_matmul_equals_bmm_on_the_real_rows(shape):
    """x @ W^T (+ bias) per matrix on the first counts[e] rows, zeros on the padding rows: outputs on and off the
    panel width (ragged last panels), every row count 0..20 (the last shape: each register tile and its ragged
    edges); counts None takes every row; the one-matrix form [M, in] x P [panels, in, L] as well."""
    E, M, n_in, n_out = shape
    x, W, bias, counts = few_row_matmul_case(shape)
    P = torch.ops.glm_lightning.panel_pack(W)
    assert P.shape[:3] == (E, -(-n_out // P.shape[-1]), n_in)
    ref = torch.bmm(x.double(), W.double().transpose(1, 2))
    for b in (None, bias):
        y = torch.ops.glm_lightning.panel_matmul(x, P, n_out, counts, b)
        assert y.shape == (E, M, n_out)
        for e, c in enumerate(counts.tolist()):
            want = ref[e, :c] + (0 if b is None else b[e].double())
            torch.testing.assert_close(y[e, :c].double(), want, rtol=1e-5, atol=1e-5)
            assert torch.count_nonzero(y[e, c:]) == 0
    torch.testing.assert_close(torch.ops.glm_lightning.panel_matmul(x, P, n_out).double(), ref, rtol=1e-5, atol=1e-5)
    one = torch.ops.glm_lightning.panel_matmul(x[1], torch.ops.glm_lightning.panel_pack(W[1]), n_out, None, bias[1])
    torch.testing.assert_close(one.double(), ref[1] + bias[1].double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="counts"):
        torch.ops.glm_lightning.panel_matmul(x, P, n_out, torch.full((E,), M + 1))
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.glm_lightning.panel_matmul(x, P, n_out, counts, bias[0])
    with pytest.raises(RuntimeError, match="out"):
        torch.ops.glm_lightning.panel_matmul(x, P, n_out + P.shape[-1])


@pytest.fixture
def widened():
    """bf16 panels through the widened FMA kernel (AMX switched off where the CPU has it), restored after."""
    torch.ops.glm_lightning.panel_amx(False)
    yield
    torch.ops.glm_lightning.panel_amx(True)


def pairs(P32: torch.Tensor) -> torch.Tensor:
    """fp32 panels [..., in, L] in bf16 panels' layout: `in` padded to even, rows k and k + 1 as L pairs."""
    n_in, L = P32.shape[-2], P32.shape[-1]
    padded = torch.nn.functional.pad(P32, (0, 0, 0, n_in % 2))
    return padded.unflatten(-2, (-1, 2)).transpose(-1, -2).reshape(padded.shape)


@pytest.mark.parametrize("shape", [(4, 5, 192, 768), (3, 16, 20, 7), (21, 20, 24, 17), (2, 40, 31, 33)])
def test_bf16_panels_equal_fp32_panels_of_the_rounded_inputs(shape, widened):
    """bf16 panels (half the bytes) take x rounded to bf16 (generation.py's numerics) and, widened to fp32 in
    registers, give bit for bit the fp32 kernel on the rounded x and the rounded weights (same products, same order),
    every row count and ragged edge, odd `in`, with and without counts and bias; within 1e-5 of an fp64 product of the
    rounded operands. panel_pack(W, bf16) rounds as torch does (nearest even), in the same pass as the packing, into
    pairs of rows (the AMX layout, amx_panels.h)."""
    E, M, n_in, n_out = shape
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(E, M, n_in, generator=gen)
    W = torch.randn(E, n_out, n_in, generator=gen) * n_in ** -0.5
    bias = torch.randn(E, n_out, generator=gen)
    rounded, xr = W.to(torch.bfloat16).float(), x.to(torch.bfloat16).float()
    P16 = torch.ops.glm_lightning.panel_pack(W, torch.bfloat16)
    P32 = torch.ops.glm_lightning.panel_pack(rounded)
    assert P16.dtype == torch.bfloat16 and torch.equal(P16.float(), pairs(P32))
    assert torch.equal(torch.ops.glm_lightning.panel_pack(W.to(torch.bfloat16)), P16)
    assert torch.equal(torch.ops.glm_lightning.panel_pack(W.to(torch.bfloat16), torch.float32), P32)
    counts = torch.randint(0, M + 1, (E,), generator=gen)
    ref = torch.bmm(xr.double(), rounded.double().transpose(1, 2))
    for c in (None, counts):
        for b in (None, bias):
            y = torch.ops.glm_lightning.panel_matmul(x, P16, n_out, c, b)
            assert torch.equal(y, torch.ops.glm_lightning.panel_matmul(xr, P32, n_out, c, b))
    torch.testing.assert_close(torch.ops.glm_lightning.panel_matmul(x, P16, n_out).double(), ref, rtol=1e-5,
                               atol=1e-5)
    one = torch.ops.glm_lightning.panel_matmul(x[1], torch.ops.glm_lightning.panel_pack(W[1], torch.bfloat16), n_out)
    assert torch.equal(one, torch.ops.glm_lightning.panel_matmul(xr[1], P32[1], n_out))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.glm_lightning.panel_matmul(x.to(torch.bfloat16), P16, n_out)
    if n_in % 2:  # bf16 panels hold in + 1 rows: as fp32 they do not match x
        with pytest.raises(RuntimeError, match="panel_pack"):
            torch.ops.glm_lightning.panel_matmul(x, P16.float(), n_out)


def test_linear_inside_a_bf16_decode_packs_bf16_panels(monkeypatch, widened):
    """A store of dtype bf16 (cache.PanelStore, a bf16 sampling copy's decode) packs the weight once as bf16 panels;
    on a weight holding bf16 values the linear's output is bit for bit that of fp32 panels on x rounded to bf16."""
    from glm_lightning.model.cache import PanelStore

    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(40, 24, generator=gen).to(torch.bfloat16).float()
    b, x = torch.randn(40, generator=gen), torch.randn(3, 5, 24, generator=gen)
    s16, s32 = PanelStore(torch.bfloat16), PanelStore()
    with torch.no_grad():
        with matmul.packed_weights(s16):
            y16 = matmul.linear(x, W, b)
        with matmul.packed_weights(s32):
            y32 = matmul.linear(x.to(torch.bfloat16).float(), W, b)
    assert s16[W].dtype == torch.bfloat16 and s32[W].dtype == torch.float32
    assert torch.equal(y16, y32)


def test_a_rows_output_does_not_depend_on_its_batch():
    """Every tile sums an output's products in the order k = 0, 1, ...: a row gives the same bits alone, in a batch of
    any size (other register tiles and ragged edges) and at any place in it."""
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(37, 50, generator=gen)
    P = torch.ops.glm_lightning.panel_pack(W)
    x = torch.randn(20, 50, generator=gen)
    alone = torch.cat([torch.ops.glm_lightning.panel_matmul(x[i:i + 1], P, 37) for i in range(20)])
    for rows in (2, 3, 4, 7, 8, 13, 16, 20):
        for start in (0, 20 - rows):
            y = torch.ops.glm_lightning.panel_matmul(x[start:start + rows], P, 37)
            assert torch.equal(y, alone[start:start + rows])


def test_linear_inside_a_decode_packs_each_weight_once(monkeypatch):
    """Inside packed_weights, a few-row linear packs its weight into the store on first use and reuses it; the result
    is the mm's within rounding; outside, and above SMALL_ROWS rows, nothing is packed."""
    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)  # the AVX-512 table's value (0 on AVX2: BLAS always)
    gen = torch.Generator().manual_seed(2)
    W, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(3, 5, 24, generator=gen)
    store: dict[torch.Tensor, torch.Tensor] = {}
    packs = []
    real = torch.ops.glm_lightning.panel_pack
    monkeypatch.setattr(matmul, "packed", lambda w: packs.append(w) or _packed_with(store, real, w))
    with torch.no_grad():
        y_out = matmul.linear(x, W, b)
        assert not packs
        with matmul.packed_weights(store):
            y1, y2 = matmul.linear(x, W, b), matmul.linear(x, W, b)
            matmul.linear(torch.randn(33, 24), W)  # above SMALL_ROWS: BLAS, no pack
    assert len(packs) == 2 and list(store) == [W]
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, y_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, torch.nn.functional.linear(x, W, b), rtol=1e-5, atol=1e-5)


def _packed_with(store, pack, w):
    if w not in store:
        store[w] = pack(w)
    return store[w]


@pytest.mark.parametrize("tokens", [1, 6, 16])
def test_decode_experts_from_panels_equal_small_matmul(tokens, monkeypatch):
    """The MoE's few-token expert path inside a decode runs on the experts' packed weights (both matrices packed
    once) and equals its small_matmul form outside one."""
    from glm_lightning.model.moe import MoE

    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 64)
    torch.manual_seed(3)
    m = MoE(GLMConfig(d_model=32, n_heads=2, n_kv_heads=2, n_experts=4, moe_top_k=2, expert_hidden=24,
                      shared_expert_hidden=8, init_std=0.3))
    x = torch.randn(1, tokens, 32)
    store: dict[torch.Tensor, torch.Tensor] = {}
    calls = []
    real = matmul.panel_matmul
    monkeypatch.setattr(matmul, "panel_matmul", lambda *a: calls.append(a[1].shape) or real(*a))
    with torch.no_grad():
        y_small = m(x, want_aux=False)[0]
        assert not calls
        with matmul.packed_weights(store):
            y_panel = m(x, want_aux=False)[0]
    assert len(calls) >= 2 and m.w_gate_up in store and m.w_down in store
    torch.testing.assert_close(y_panel, y_small, rtol=1e-5, atol=1e-6)


def test_cached_generation_on_panels_equals_the_naive_loop(monkeypatch):
    """Greedy cached generation (16 rows, its decode linears and experts on packed weights, the store filled once per
    generate call) picks the tokens of the naive full re-forward."""
    monkeypatch.setattr(thresholds, "SMALL_ROWS", 32)
    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 64)
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny")).eval()
    prompt = torch.randint(1, 256, (4, 6))
    calls = []
    real = matmul.panel_matmul
    monkeypatch.setattr(matmul, "panel_matmul", lambda *a: calls.append(1) or real(*a))
    cached = generate(model, prompt, max_new_tokens=8, temperature=0.0, eos_id=None).tokens
    assert calls, "the decode steps ran on packed weights"
    naive = generate_naive(model, prompt, max_new_tokens=8, eos_id=None)
    assert torch.equal(cached, naive)


@pytest.mark.parametrize("shape", [(40, 37), (16, 16), (3, 5, 70), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_pack_layout(shape, dtype):
    """P[..., p, k, c] = W[..., p L + c, k] (zero past the last output), in the panels' dtype rounded as torch rounds
    (nearest even), for ragged `out` and `in`, bf16 ties, and infinities and NaNs (a NaN stays a NaN)."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(*shape, generator=g) * 3
    flat = W.view(-1)
    flat[::7] = (flat[::7].to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)  # ties
    flat[1], flat[-1] = float("inf"), float("nan")
    P = torch.ops.glm_lightning.panel_pack(W, dtype)
    L = P.shape[-1]
    out, inn = W.shape[-2], W.shape[-1]
    padded = torch.zeros(*W.shape[:-2], P.shape[-3] * L, inn)
    padded[..., :out, :] = W
    want = padded.view(*W.shape[:-2], -1, L, inn).transpose(-1, -2).to(dtype)
    if dtype == torch.bfloat16:  # rows k, k + 1 as L pairs, `in` padded to even (amx_panels.h)
        want = pairs(want)
    assert P.dtype == dtype and P.shape == want.shape
    assert torch.equal(P.isnan(), want.isnan()) and torch.equal(P.nan_to_num(), want.nan_to_num())


def test_tall_row_blocks_equal_the_rows_in_short_tiles():
    """More than kTileAcc / 2 rows run as one-panel tiles read from x's transposed blocks (16 rows at a time on
    AVX-512, a shorter last block); up to half that, several panels per tile read x's rows. Both sum each output's
    products in the same order, so an expert with 9..40 rows gives the bits of the same rows taken 4 at a time, with
    the tall and short experts of one call side by side (each expert's transposed blocks at its own place)."""
    gen = torch.Generator().manual_seed(7)
    E, M, n_in, n_out = 3, 40, 36, 50
    x = torch.randn(E, M, n_in, generator=gen)
    W = torch.randn(E, n_out, n_in, generator=gen)
    bias = torch.randn(E, n_out, generator=gen)
    P = torch.ops.glm_lightning.panel_pack(W)
    for counts in ([40, 3, 17], [9, 33, 0], [16, 16, 8]):
        c = torch.tensor(counts)
        y = torch.ops.glm_lightning.panel_matmul(x, P, n_out, c, bias)
        for e, rows in enumerate(counts):
            for m in range(0, rows, 4):
                short = torch.ops.glm_lightning.panel_matmul(x[e, m:min(rows, m + 4)], P[e], n_out, None, bias[e])
                assert torch.equal(y[e, m:min(rows, m + 4)], short)
