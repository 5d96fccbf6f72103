"""KDA's core as the per-token recurrence in C++ (csrc/kda_recurrent.cpp): what the layer runs on a CPU for training
and prefill when the C++ ops are built.

Why the recurrence and not the chunked (WY / UT) form: for heads of up to 64 channels it does fewer FLOPs, 4 K V
multiply-adds per token (decay, S^T k, rank-1 update, S^T q) against ~8 K V for the chunked form at C = 32, and the
B * H independent sequences already keep the cores busy. The chunked form buys matmul-shaped work for GPU tensor cores;
a CPU core gains nothing from it, while a head's [K, V] state fits in its vector registers (K = V = 16) or L1.
Measured (core forward + backward, 2 threads, the same inputs, one run): against the eager chunked core, study model
(8 x 128, 3 heads of 16) 2.5 -> 0.6 ms, flash-25m (32 x 128, 6 heads of 32) 39.0 -> 12.2 ms (`python -m benchmarks
--only kda`); against the C++ chunked core it replaced (csrc/kda_chunk.cpp, removed), 5.2 -> 0.76, 23.0 -> 20.9 and,
for heads of 64, 11.3 -> 9.9 ms.

The forward saves the state every :data:`SEGMENT` tokens; the backward recomputes a segment's states from its
checkpoint and walks it back (the formulas are in the C++ file). The chunked form (glm_lightning/model/kda.py,
``kda_chunked``) stays the reference of the paper's algorithm and the path without the C++ ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SEGMENT", "KDARecurrentCpp", "recurrent_cpp", "supports"]

SEGMENT = 32
"""Tokens between the forward's saved states: the backward recomputes at most this many states from each (memory:
one [K, V] state per head and segment, 3 MB per flash-25m layer at 32 x 128)."""

_SIZES = (16, 32, 64)
"""Head sizes the op is compiled for, square (K == V, as the model's heads are); other shapes are zero-padded up to the
smallest that holds both K and V."""


def supports(K: int, V: int) -> bool:
    """Whether :func:`recurrent_cpp` takes key size K and value size V."""
    return 0 < K <= _SIZES[-1] and 0 < V <= _SIZES[-1]


class KDARecurrentCpp(torch.autograd.Function):
    """(q, k, v, g [B, T, H, K or V], beta [B, T, H], S0 [B, H, K, V]) -> (o [B, T, H, V], final state [B, H, K, V])
    through ``glm_lightning::kda_recurrent_fwd`` / ``_bwd``; K == V in (16, 32, 64), q already scaled by K^-0.5."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # type: ignore[override]
                S0: Tensor) -> tuple[Tensor, Tensor]:
        o, S_ckpt = torch.ops.glm_lightning.kda_recurrent_fwd(q, k, v, g, beta, S0, SEGMENT)
        ctx.save_for_backward(q, k, v, g, beta, S_ckpt)
        return o, S_ckpt[:, -1].reshape(S0.shape).clone()

    @staticmethod
    def backward(ctx, dO: Tensor, dS_last: Tensor):  # type: ignore[override]
        q, k, v, g, beta, S_ckpt = ctx.saved_tensors
        return torch.ops.glm_lightning.kda_recurrent_bwd(dO, dS_last, q, k, v, g, beta, S_ckpt, SEGMENT)


def recurrent_cpp(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """The core through :class:`KDARecurrentCpp` (see :func:`supports`). Other head shapes are zero-padded to the
    smallest compiled square: extra key channels (q = k = g = 0) never reach the state's real rows or the output, extra
    value channels are dropped."""
    K, V = q.shape[-1], v.shape[-1]
    PK = PV = next(n for n in _SIZES if n >= max(K, V))
    if PK != K:
        q, k, g = (F.pad(x, (0, PK - K)) for x in (q, k, g))
    if PV != V:
        v = F.pad(v, (0, PV - V))
    if PK != K or PV != V:
        S0 = F.pad(S0, (0, PV - V, 0, PK - K))
    q, k, v, g = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g))
    o, S = KDARecurrentCpp.apply(q, k, v, g, beta, S0)
    return (o, S) if PK == K and PV == V else (o[..., :V], S[:, :, :K, :V])
