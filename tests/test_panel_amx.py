"""bf16 panels through AMX tiles (csrc/amx_panels.h): round_bf16(x) W^T + b against an fp64 product of the rounded
operands, and against the widened FMA kernel, at every row count the decode meets; skipped without AMX.

Tolerance: the products of two bf16 values are exact in fp32 (8 + 8 significant bits), so both kernels differ from
the exact sum only by their fp32 additions, in their own orders (the widened kernel k = 0, 1, ...; the tile unit in
its pairs and 32-k blocks). With u = 2^-24 a sum of n terms in any order is within gamma_n sum |x_k w_k| of the
exact one (gamma_n = n u / (1 - n u)), plus one rounding of the bias addition: |y - ref| <= (n + 1) u (sum |x_k w_k|
+ |b|) (a bound, not an estimate: it holds for the worst order; observed errors are ~100x smaller)."""

from __future__ import annotations

import pytest
import torch

from glm_lightning.model import cext

pytestmark = pytest.mark.skipif(not cext.available() or not torch.ops.glm_lightning.panel_amx(),
                                reason="no C++ ops, or no AMX-BF16 on this CPU (or not granted)")

ops = torch.ops.glm_lightning


@pytest.fixture
def amx_then_restore():
    """AMX on for the test; on again after (panel_amx is process-wide)."""
    assert ops.panel_amx(True)
    yield
    ops.panel_amx(True)


def bound(xr: torch.Tensor, Wr: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(n + 1) u (|x| |W|^T + |b|) per output, fp64 (module docstring)."""
    n = xr.shape[-1]
    mag = torch.matmul(xr.double().abs(), Wr.double().abs().transpose(-1, -2))
    if b is not None:
        mag = mag + b.double().abs().unsqueeze(-2)
    return (n + 1) * 2.0 ** -24 * mag


def within(y: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> bool:
    return bool(((y.double() - ref).abs() <= tol).all())


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("n_out, n_in", [(40, 24), (33, 17), (192, 576), (70, 65), (16, 1), (17, 64)])
def test_amx_equals_the_rounded_input_product(rows, n_out, n_in, amx_then_restore):
    """One matrix: AMX output within the fp32 summation bound of fp64 round_bf16(x) round_bf16(W)^T + b, with and
    without bias, `in` odd / below / above 32, outputs ragged; the widened kernel within the same bound; the two never
    further apart than the bound twice."""
    gen = torch.Generator().manual_seed(rows * 1000 + n_in)
    x, W, b = (torch.randn(rows, n_in, generator=gen), torch.randn(n_out, n_in, generator=gen),
               torch.randn(n_out, generator=gen))
    xr, Wr = x.bfloat16().float(), W.bfloat16().float()
    P = ops.panel_pack(W, torch.bfloat16)
    for bias in (None, b):
        ref = xr.double() @ Wr.double().T + (0 if bias is None else bias.double())
        tol = bound(xr, Wr, bias)
        y = ops.panel_matmul(x, P, n_out, None, bias)
        assert within(y, ref, tol)
        ops.panel_amx(False)
        wide = ops.panel_matmul(x, P, n_out, None, bias)
        assert ops.panel_amx(True)
        assert within(wide, ref, tol) and within(y, wide.double(), 2 * tol)


def test_amx_counts_form_on_the_real_rows(amx_then_restore):
    """Experts [E, M, in] over counts (0, 1, a full tile, ragged, more than a tile): the real rows within the bound,
    the padding rows zero (never written with x's padding)."""
    gen = torch.Generator().manual_seed(3)
    E, M, n_in, n_out = 6, 20, 40, 70
    x, W = torch.randn(E, M, n_in, generator=gen), torch.randn(E, n_out, n_in, generator=gen)
    b = torch.randn(E, n_out, generator=gen)
    x[:, 16:] = float("nan")  # padding rows past counts must not leak into the real rows
    counts = torch.tensor([0, 1, 16, 3, 7, 15])
    xr, Wr = x.bfloat16().float(), W.bfloat16().float()
    P = ops.panel_pack(W, torch.bfloat16)
    y = ops.panel_matmul(x, P, n_out, counts, b)
    for e, c in enumerate(counts.tolist()):
        ref = xr[e, :c].double() @ Wr[e].double().T + b[e].double()
        assert within(y[e, :c], ref, bound(xr[e, :c], Wr[e], b[e]))
        assert torch.count_nonzero(y[e, c:]) == 0


def test_amx_rows_do_not_depend_on_their_batch(amx_then_restore):
    """Each output element of a tile is its own row's sum: a row gives the same bits alone or in a batch (any tile
    position, a second tile)."""
    gen = torch.Generator().manual_seed(9)
    W, x = torch.randn(50, 70, generator=gen), torch.randn(20, 70, generator=gen)
    P = ops.panel_pack(W, torch.bfloat16)
    full = ops.panel_matmul(x, P, 50)
    for r in (0, 7, 15, 16, 19):
        assert torch.equal(ops.panel_matmul(x[r:r + 1], P, 50), full[r:r + 1])


def test_the_switch_reports_and_restores(amx_then_restore):
    """panel_amx(False) turns the AMX form off (the widened kernel: bit for bit fp32 panels on the rounded x),
    panel_amx(True) back on; no argument only reports."""
    gen = torch.Generator().manual_seed(2)
    W, x = torch.randn(24, 64, generator=gen), torch.randn(16, 64, generator=gen)
    P16, P32 = ops.panel_pack(W, torch.bfloat16), ops.panel_pack(W.bfloat16().float())
    assert not ops.panel_amx(False) and not ops.panel_amx()
    assert torch.equal(ops.panel_matmul(x, P16, 24), ops.panel_matmul(x.bfloat16().float(), P32, 24))
    assert ops.panel_amx(True) and ops.panel_amx()
