"""y = x W^T + b with a hand-written backward: the model's linear layers as two matmuls back instead of autograd's chain.

Why: the study model is dispatch-bound (~15 us per op). ``F.linear`` on a [B, T, d] input records matmul's reshape
and view nodes plus ``MmBackward0`` and the weight's ``TBackward0``, which replay as ~23 dispatched ops per layer in
backward; this Function replays as ~9 (dx = dy W, dW = dy^T x, db = sum(dy)). The forward is the same ``addmm``/``mm``
that ``F.linear`` runs, so values are bit for bit those of ``F.linear``; without autograd (decoding) it is the same
``mm``/``addmm`` called directly (7 dispatched ops instead of ``F.linear``'s 11-12 on a [B, T, d] input), or for a
few rows (a decode step) ``glm_lightning::small_matmul``, which streams each weight row once (``SMALL_ROWS``; values
within float rounding of ``mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model import cext

SMALL_ROWS = 32
"""Without autograd, fp32 inputs of at most this many rows (decoding) run through ``glm_lightning::small_matmul``
(csrc/small_matmul.cpp) instead of BLAS's ``mm``, which packs the whole weight matrix on every call. In a decode
step every weight is cold (the step streams the whole model), and there, 1 thread, the C++ op was 1.3-1.7x faster
than ``mm`` at 16 rows and 1.6-2.2x at 1-4 rows (the model's [192-768] x [192-384] weights), 1.06-1.17x at 32 and
0.86-1.09x at 64. The choice depends on the shape only, and the op sums each row in the same order whatever the other
rows are."""


def _rows(x: Tensor) -> Tensor:
    """x [..., n] as [rows, n]: a view when x is contiguous (1 dispatched op; `reshape` is 2)."""
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])


class _Linear(torch.autograd.Function):
    """x [..., in], weight [out, in], bias [out] or None -> [..., out]."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        x2, wt = _rows(x), weight.transpose(0, 1)  # transpose: 2 ops, .t() is 3
        y = torch.mm(x2, wt) if bias is None else torch.addmm(bias, x2, wt)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        g2 = _rows(grad)
        gx = torch.mm(g2, weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        gw = torch.mm(g2.transpose(0, 1), x2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _small_matmul(x2: Tensor, weight: Tensor, counts: None, bias: Tensor | None) -> Tensor:
    """x2 [rows, in] W^T + bias through the C++ op (one place, so tests can see that the path ran)."""
    return torch.ops.glm_lightning.small_matmul(x2, weight, counts, bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; while autograd records, through :class:`_Linear` (fewer backward ops)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    if x.dim() < 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    x2 = _rows(x)
    if x2.shape[0] <= SMALL_ROWS and cext.takes(x2, weight, *(() if bias is None else (bias,)), fp64=False):
        y = _small_matmul(x2, weight, None, bias)
    else:  # the same mm/addmm that F.linear runs on the flattened rows, in 7 dispatched ops instead of 11-12
        wt = weight.transpose(0, 1)
        y = torch.mm(x2, wt) if bias is None else torch.addmm(bias, x2, wt)
    return y.view(*x.shape[:-1], weight.shape[0])
