"""KDA over T tokens (training and prefill): the layer's core between its input projections and its output projection,
as one op, the T-token sibling of ``kda_decode_step`` (reference: ``reference.short_conv``, ``reference.kda_features``
and ``reference.kda_recurrent`` in that order, then the gated head norm).

The steps: the raw q|k|v projections with pads zeroed go through the causal short conv + SiLU (from the cached raw
inputs when continuing a sequence), then the features (unit-norm q and k, v, the gates g and beta) with pads made
identity steps of the state, then the gated delta rule from the cached state (or zeros), then the per-head RMSNorm
gated by sigmoid(gate). Each step is its own op in this package; this function only orders them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_lightning.model.ops import mixed_precision as mp
from glm_lightning.model.ops.kda_inputs import kda_features, pads_as_identity, short_conv
from glm_lightning.model.ops.kda_recurrent import kda_core
from glm_lightning.model.ops.norm import gated_head_norm


@mp.fp32_op
def kda_sequence(raw: Tensor, f: Tensor, b: Tensor, gate: Tensor, valid: Tensor | None, conv_weight: Tensor,
                 A_log: Tensor, rescale: Tensor, lb: float, chunk_size: int, norm_weight: Tensor, norm_eps: float,
                 conv_state: Tensor | None = None,
                 state: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """T tokens of a KDA layer: raw q|k|v [B, T, 3HK] (before the short conv), f [B, T, HK] and b [B, T, H] (fp32, the
    gates' pre-activations), the output gate's pre-activation [B, T, HK], valid [B, T] bool or None; the conv weight
    [3HK, 1, ks], A_log [H], rescale [2H, 1] (the q|k L2-norm divisors), the gate's lower bound lb < 0, the chunk size of
    the chunked core, the head norm's weight and eps. ``conv_state`` [B, ks-1, 3HK] and ``state`` [B, H, K, V] continue
    cached sequences (both None: whole sequences from zeros).

    Returns the gated, normed output [B, T, HK] (fp32), the next conv state (the last ks-1 raw inputs; None without a
    conv state) and the final recurrent state [B, H, K, V]."""
    if valid is not None:
        raw = raw.masked_fill(~valid.unsqueeze(-1), 0.0)
    y, raw_ext = short_conv(raw, conv_weight, conv_state)
    q, k, v, g, beta = kda_features(_f32(y), f, b, _f32(A_log), rescale, lb)
    k, g, beta = pads_as_identity(k, g, beta, valid)
    o, S = kda_core(q, k, v, g, beta, chunk_size, initial_state=state, gate_bound=-lb)
    next_conv = None if raw_ext is None else raw_ext[:, raw_ext.shape[1] - (conv_weight.shape[-1] - 1):]
    return gated_head_norm(o, gate, norm_weight, norm_eps), next_conv, S


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (fp64 stays fp64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
