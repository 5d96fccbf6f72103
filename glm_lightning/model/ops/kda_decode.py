"""KDA's decode step: one new token per row, written into the layer's cache in place (reference: the training path's
ops on a one-token input with the cache as context, ``reference.short_conv`` and ``reference.kda_recurrent``).

The step is: shift the raw q|k|v projection into the conv buffer and run the short conv + SiLU on the window, the
features, one delta-rule step on the state (``S *= exp(g); e = v - S^T k; S += k (beta e)^T; o = S^T q``), and the gated
head norm. Without padding, on fp32 CPU tensors with the C++ ops, the whole step is one C++ op
(``glm_lightning::kda_decode_core``, csrc/kda_decode.cpp: the same ops on the same views as the separate calls, so the
same values bit for bit; ~20 fewer top-level ops). Otherwise the separate steps run, the conv step and the delta step
each one C++ op when they take the tensors (one pass over each head's state instead of six over the whole cache: the
state is 38 MB per layer at 1,536 rows), else PyTorch (~25 dispatched ops, the heads flattened into the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, decode, mixed_precision as mp
from glm_lightning.model.ops.kda_inputs import kda_features, pads_as_identity
from glm_lightning.model.ops.norm import gated_head_norm


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (fp64 stays fp64: the PyTorch forms run in fp64 too)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def delta_step_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> Tensor:
    """One delta-rule step written into S in place (no autograd). q, k, g [B, H, K]; v [B, H, V]; beta [B, H];
    S [B, H, K, V] fp32 (or fp64), contiguous; the step computes in S's dtype. Returns o [B, H, V]."""
    if backend.takes(q, k, v, g, beta, S, fp64=False, op="kda_delta_step"):
        return torch.ops.glm_lightning.delta_step_(q, k, v, g, beta, S)
    B, H, K, V = S.shape
    dt = S.dtype
    Sf = S.view(B * H, K, V)
    kf = _as(k, dt).reshape(B * H, K, 1)
    Sf.mul_(_as(g, dt).reshape(B * H, K, 1).exp())                                # Diag(exp g) S
    e = _as(v, dt).reshape(B * H, 1, V) - torch.bmm(kf.transpose(1, 2), Sf)       # v - S^T k   [BH, 1, V]
    Sf.addcmul_(kf, e.mul_(_as(beta, dt).reshape(B * H, 1, 1)))                   # S += k (beta e)^T
    return torch.bmm(_as(q, dt).reshape(B * H, 1, K), Sf).view(B, H, V)          # S^T q


def conv_step_(conv_state: Tensor, raw: Tensor, weight: Tensor) -> Tensor:
    """One step of the causal depthwise short conv + SiLU, shifting ``raw`` into ``conv_state`` in place:
    conv_state [B, ks-1, C] (the previous raw inputs), raw [B, 1, C], weight [C, 1, ks] -> SiLU(conv) [B, 1, C]."""
    C, ks = weight.shape[0], weight.shape[-1]
    if backend.takes(conv_state, raw, weight, fp64=False, op="kda_conv_step"):
        return torch.ops.glm_lightning.conv_step_(conv_state, raw, weight.view(C, ks)).view(raw.shape)
    xp = torch.cat([conv_state.to(raw.dtype), raw], dim=1)                          # [B, ks, C]
    # the weight made contiguous [ks, C] first: broadcast as the strided view w.t(), the product over [1536, 4, 576]
    # took 1.5 ms instead of 0.6 (bad loop order)
    y = F.silu((xp * weight.view(C, ks).t().contiguous()).sum(1, keepdim=True))
    conv_state.copy_(xp[:, 1:])
    return y


def kda_decode_step(raw: Tensor, f: Tensor, b: Tensor, gate: Tensor, valid: Tensor | None, conv_state: Tensor,
                    state: Tensor, conv_weight: Tensor, A_log: Tensor, rescale: Tensor, lb: float,
                    norm_weight: Tensor, norm_eps: float) -> Tensor:
    """One decode step of a KDA layer, no autograd: raw q|k|v [B, 1, 3HK], f [B, 1, HK] and b [B, 1, H] (fp32), the
    output gate's pre-activation [B, 1, HK], valid [B, 1] or None; conv_state [B, ks-1, 3HK] and state [B, H, K, V]
    are updated in place. Returns the gated, normed output [B, 1, HK] (fp32), before the output projection."""
    if valid is None and decode.cpp("kda_decode_step") and raw.dtype is torch.float32:  # an fp32 model's step
        return _core(raw, f, b, gate, conv_state, state, conv_weight, A_log, rescale, lb, norm_weight, norm_eps)
    return _kda_decode_step(raw, f, b, gate, valid, conv_state, state, conv_weight, A_log, rescale, lb, norm_weight,
                            norm_eps)


def _core(raw: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_state: Tensor, state: Tensor, conv_weight: Tensor,
          A_log: Tensor, rescale: Tensor, lb: float, norm_weight: Tensor, norm_eps: float) -> Tensor:
    """The whole step as the C++ op kda_decode_core (fp32 tensors, no padding) -> [B, 1, HK]."""
    C, ks = conv_weight.shape[0], conv_weight.shape[-1]
    o = torch.ops.glm_lightning.kda_decode_core(raw, f, b, A_log, rescale, lb, conv_state, conv_weight.view(C, ks),
                                                state, gate, norm_weight, norm_eps)
    return o.view(raw.shape[0], 1, -1)


@mp.fp32_op
def _kda_decode_step(raw: Tensor, f: Tensor, b: Tensor, gate: Tensor, valid: Tensor | None, conv_state: Tensor,
                     state: Tensor, conv_weight: Tensor, A_log: Tensor, rescale: Tensor, lb: float,
                     norm_weight: Tensor, norm_eps: float) -> Tensor:
    """:func:`kda_decode_step` outside an fp32 decode step: the checks per call, bf16 cast at the boundary."""
    A_log = _f32(A_log)
    if valid is None and backend.takes(raw, A_log, rescale, norm_weight, state, conv_state, conv_weight, fp64=False,
                                       op="kda_decode_step"):
        return _core(raw, f, b, _f32(gate), conv_state, state, conv_weight, A_log, rescale, lb, norm_weight, norm_eps)
    if valid is not None:
        raw = raw.masked_fill(~valid.unsqueeze(-1), 0.0)
    y = conv_step_(conv_state, raw, conv_weight)
    q, k, v, g, beta = kda_features(_f32(y), f, b, A_log, rescale, lb)
    k, g, beta = pads_as_identity(k, g, beta, valid)
    o = delta_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state).unsqueeze(1)
    return gated_head_norm(o, gate, norm_weight, norm_eps)
