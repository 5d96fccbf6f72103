"""KDA's core over T tokens, for training and prefill (reference: ``reference.kda_recurrent``).

On a CPU with the C++ ops the core is the per-token recurrence in C++ (csrc/kda_recurrent.cpp), one op per direction.
Why the recurrence and not the chunked (WY / UT) form of the paper: for heads of up to 64 channels it does fewer FLOPs,
4 K V multiply-adds per token (decay, S^T k, rank-1 update, S^T q) against ~8 K V for the chunked form at C = 32, and
the B * H independent sequences already keep the cores busy. The chunked form buys matmul-shaped work for GPU tensor
cores; a CPU core gains nothing from it, while a head's [K, V] state fits in its vector registers or L1. Measured
(core forward + backward, 2 threads): against the chunked core, study model (8 x 128, 3 heads of 16) 2.5 -> 0.6 ms,
flash-25m (32 x 128, 6 heads of 32) 39.0 -> 12.2 ms (`python -m benchmarks --only kda`).

The forward saves the state every :data:`SEGMENT` tokens; the backward recomputes a segment's states from its
checkpoint and walks it back (the formulas are in the C++ file). Elsewhere (other devices, dtypes, larger heads) the
chunked form runs (glm_lightning/model/ops/kda_chunkwise.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, mixed_precision as mp, thresholds
from glm_lightning.model.ops.kda_chunkwise import kda_chunked

SEGMENT = 32
"""Tokens between the forward's saved states: the backward recomputes at most this many states from each (memory:
one [K, V] state per head and segment, 3 MB per flash-25m layer at 32 x 128)."""


def recurrent_cpp_takes(K: int, V: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the C++ recurrence is compiled for key size K and value size V (zero-padded up to a square size) in
    this dtype (fp64 only for small heads: gradcheck)."""
    largest = (thresholds.KDA_RECURRENT_FP64_SIZES if dtype is torch.float64 else thresholds.KDA_RECURRENT_SIZES)[-1]
    return 0 < K <= largest and 0 < V <= largest


class _KDARecurrentCpp(torch.autograd.Function):
    """(q, k, v, g [B, T, H, K or V], beta [B, T, H], S0 [B, H, K, V]) -> (o [B, T, H, V], final state [B, H, K, V])
    through ``glm_lightning::kda_recurrent_fwd`` / ``_bwd``; K == V a compiled size, q already scaled by K^-0.5."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # type: ignore[override]
                S0: Tensor) -> tuple[Tensor, Tensor]:
        o, S_ckpt = torch.ops.glm_lightning.kda_recurrent_fwd(q, k, v, g, beta, S0, SEGMENT)
        ctx.save_for_backward(q, k, v, g, beta, S_ckpt)
        return o, S_ckpt[:, -1].reshape(S0.shape).clone()

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dO: Tensor, dS_last: Tensor):  # type: ignore[override]
        q, k, v, g, beta, S_ckpt = ctx.saved_tensors
        return torch.ops.glm_lightning.kda_recurrent_bwd(dO, dS_last, q, k, v, g, beta, S_ckpt, SEGMENT)


def recurrent_cpp(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """The core through :class:`_KDARecurrentCpp`. Other head shapes are zero-padded to the smallest compiled square:
    extra key channels (q = k = g = 0) never reach the state's real rows or the output, extra value channels are
    dropped."""
    K, V = q.shape[-1], v.shape[-1]
    PK = PV = next(n for n in thresholds.KDA_RECURRENT_SIZES if n >= max(K, V))
    if PK != K:
        q, k, g = (F.pad(x, (0, PK - K)) for x in (q, k, g))
    if PV != V:
        v = F.pad(v, (0, PV - V))
    if PK != K or PV != V:
        S0 = F.pad(S0, (0, PV - V, 0, PK - K))
    q, k, v, g = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g))
    o, S = _KDARecurrentCpp.apply(q, k, v, g, beta, S0)
    return (o, S) if PK == K and PV == V else (o[..., :V], S[:, :, :K, :V])


@mp.fp32_op
def kda_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 32,
             initial_state: Tensor | None = None, *, gate_bound: float | None = None,
             cpp: bool | None = None) -> tuple[Tensor, Tensor]:
    """o [B, T, H, V] and the final state [B, H, K, V] of the gated delta rule over T tokens (the shapes of
    ``reference.kda_recurrent``): the C++ recurrence when the C++ ops take the tensors and the head size (``cpp``
    None) or when asked (True), else the chunked form (``chunk_size`` and ``gate_bound`` only serve it)."""
    K, V = q.shape[-1], v.shape[-1]
    use_cpp = (backend.takes(q, k, v, g, beta, op="kda_recurrent") if cpp is None else cpp) and q.shape[1] > 0
    if use_cpp and recurrent_cpp_takes(K, V, q.dtype):
        B, _, H, _ = q.shape
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(q.dtype)
        return recurrent_cpp(q, k, v, g, beta, S)
    return kda_chunked(q, k, v, g, beta, chunk_size, initial_state, gate_bound=gate_bound, cpp=cpp)
