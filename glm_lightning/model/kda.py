"""Kimi Delta Attention (KDA), the linear-attention token mixer of the "L" layers.

Follows Kimi Linear (arXiv 2510.26692, "Kimi Linear: An Expressive, Efficient Attention Architecture"), with the
GLM-5.3 "safe gate" (``g = lb * sigmoid(...)``, ``lb = -5``, so every log decay lies in ``(lb, 0)``):

* the gated delta rule with a **per-head, per-key-channel** decay (fine-grained ``Diag(exp g_t)``)::

      S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

  step form: ``S *= exp(g_t); e = v_t - S^T k_t; S += k_t (beta_t e)^T; o_t = S^T q_t``
  (``ops.reference.kda_recurrent``; the layer calls ``ops.kda_sequence`` for T tokens, whose core is the C++
  recurrence or the paper's chunkwise-parallel WY / UT form, and ``ops.kda_decode_step`` for one);
* the layer of the paper / fla ``KimiDeltaAttention``: q/k/v projections, a causal depthwise short convolution
  (kernel ``kda_conv_size``) + SiLU, L2-normalised q and k (eps 1e-6), ``q *= d_k^-0.5``, ``beta = sigmoid(W_b x)``,
  the safe gate ``g = lb * sigmoid(exp(A_log) * (W_f2 W_f1 x + dt_bias))`` (``A_log`` init 0, ``dt_bias`` the inverse
  softplus of log-uniform [1e-3, 1e-1]), a low-rank output gate ``W_g2 W_g1 x`` (last linear with bias), a gated
  per-head RMSNorm ``RMSNorm_head(o) * sigmoid(gate)`` and an output projection. No biases except the output gate's.

Padding (``valid`` False) steps are identity steps: ``g = 0, beta = 0, k = 0``, and the raw projections fed to the
short conv are zeroed at pads. A left-padded row therefore gives the same outputs at its real positions as the
unpadded row. (A pad in the middle of a row is an identity for the recurrent state but still occupies a slot of the
short conv's window, identically in the prefill and decode paths.)

Decoding keeps a :class:`~glm_lightning.model.cache.KDACache`: the last ``ks - 1`` raw (pre-conv) projections and the
fp32 state. A prefill runs the core from the cached state; a one-token step without autograd is written into the cache
in place. State and gate math are fp32 (fp64 inputs to the ops stay fp64, for gradcheck-style tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from glm_lightning.model import ops
from glm_lightning.model.cache import KDACache
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.kept_panels import KeptPanels
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import linear

__all__ = ["KDACache", "KDAttention"]


class KDAttention(nn.Module):
    """Kimi Delta Attention layer (arXiv 2510.26692) with the safe gate; see the module docstring."""

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        d, H, K = cfg.d_model, cfg.n_heads, cfg.head_dim
        HK = H * K
        self.n_heads, self.head_dim = H, K
        self.chunk_size = cfg.kda_chunk_size
        self.conv_size = cfg.kda_conv_size
        self.lower_bound = float(cfg.kda_gate_lower_bound)
        self.init_std = cfg.init_std
        self.q_proj = nn.Linear(d, HK, bias=False)
        self.k_proj = nn.Linear(d, HK, bias=False)
        self.v_proj = nn.Linear(d, HK, bias=False)
        # one causal depthwise conv over the concatenated q|k|v channels (weight [3HK, 1, ks], no bias)
        self.conv = nn.Conv1d(3 * HK, 3 * HK, cfg.kda_conv_size, groups=3 * HK, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.f_a_proj = nn.Linear(d, K, bias=False)      # W_f1
        self.f_b_proj = nn.Linear(K, HK, bias=False)     # W_f2
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(HK))
        self.g_a_proj = nn.Linear(d, K, bias=False)      # W_g1
        self.g_b_proj = nn.Linear(K, HK, bias=True)      # W_g2 (with bias)
        self.o_norm = RMSNorm(K, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(HK, d, bias=False)
        # per (q heads | k heads) divisor of the L2 norm: sqrt(K) for q (q / |q| * K^-0.5), 1 for k
        self.register_buffer("_qk_rescale", torch.tensor([K ** 0.5] * H + [1.0] * H).view(2 * H, 1), persistent=False)
        self.register_buffer("_no_aux", torch.zeros(()), persistent=False)  # KDA's aux loss (none), made once
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.f_b_proj,
                    self.g_a_proj, self.g_b_proj, self.o_proj):
            nn.init.normal_(lin.weight, 0.0, self.init_std)
        nn.init.zeros_(self.g_b_proj.bias)
        self.conv.reset_parameters()  # PyTorch default (kaiming-uniform over the kernel), as fla's ShortConvolution
        self.A_log.zero_()            # safe gate: A_log = 0
        # dt_bias = inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm.weight.fill_(1.0)

    def forward(self, x: Tensor, valid: Tensor | None = None, cache: KDACache | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, C] -> (y [B, T, C], aux loss: a zero scalar, KDA has none; the same contract as DSA's mixer).
        ``valid`` [B, T] bool (False = pad); ``cache`` is updated in place (one token without autograd: the decode
        step writes into it; otherwise the prefill's final states replace it)."""
        if valid is not None:
            valid = valid.to(device=x.device, dtype=torch.bool)
        raw, f, b, gate = self._projections(x, cache)
        layer = (self.conv.weight, self.A_log, self._qk_rescale, self.lower_bound)
        norm = (self.o_norm.weight, self.o_norm.eps)
        if cache is None:                                                            # training: whole sequences
            o, _, _ = ops.kda_sequence(raw, f, b, gate, valid, *layer, self.chunk_size, *norm)
        elif x.shape[1] == 1 and not torch.is_grad_enabled() and cache.writable():   # decode: one token, in place
            o = ops.kda_decode_step(raw, f, b, gate, valid, cache.conv_state, cache.state, *layer, *norm)
        else:                                                                        # prefill: from the cache
            o, conv_state, S = ops.kda_sequence(raw, f, b, gate, valid, *layer, self.chunk_size, *norm,
                                                conv_state=cache.conv_state, state=cache.state)
            cache.update(conv_state, S)
        return linear(o if o.dtype == x.dtype else o.to(x.dtype), self.o_proj.weight), self._no_aux

    def _projections(self, x: Tensor, cache: KDACache | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The input projections of x [B, T, C]: raw q|k|v [B, T, 3HK] (before the short conv), f = W_f2 f1 + dt_bias
        [B, T, HK] and b [B, T, H] (fp32, the gates' pre-activations) and the output gate's pre-activation
        [B, T, HK]."""
        H, K = self.n_heads, self.head_dim
        w_qkv, w_small = self._in_weights(cache)
        raw = linear(x, w_qkv)                                                     # [B, T, 3HK] q|k|v
        f1, g1, b = linear(x, w_small).split([K, K, H], dim=-1)
        f = linear(f1, self.f_b_proj.weight, self.dt_bias, fp32=True)
        return raw, f, _f32(b), linear(g1, self.g_b_proj.weight, self.g_b_proj.bias)

    def _in_weights(self, cache: KDACache | None) -> tuple[Tensor, Tensor]:
        """The concatenated input projections [W_q; W_k; W_v] and [W_f1; W_g1; W_b]: rebuilt on every call, except
        while decoding without autograd, where the decode cache keeps them for the rest of that generation."""
        decoding = cache is not None and not torch.is_grad_enabled()
        if decoding and cache.in_weights is not None:  # first: the twelve module lookups below cost a step ~15 us
            return cache.in_weights
        qkv, small = self._in_weight_parts()
        if not decoding:
            return torch.cat(qkv), torch.cat(small)
        if cache.in_weights is None:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in and out of inference mode
                cache.in_weights = (torch.cat(qkv), torch.cat(small))
        return cache.in_weights

    def _in_weight_parts(self) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        return ((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight),
                (self.f_a_proj.weight, self.g_a_proj.weight, self.b_proj.weight))

    def kept_in_weights(self, kept: KeptPanels) -> tuple[Tensor, Tensor]:
        """The fused input projections for a decode cache, the ones ``kept`` holds while their parts are unchanged
        (so that their panels are kept too: model/kept_panels.py)."""
        qkv, small = self._in_weight_parts()
        return (kept.derive((self, "qkv"), qkv, lambda: torch.cat(qkv)),
                kept.derive((self, "small"), small, lambda: torch.cat(small)))

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(g, beta) for input x: g [B, T, H, K] in [lb, 0], beta [B, T, H] in (0, 1), fp32."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        f = linear(self.f_a_proj(x), self.f_b_proj.weight, self.dt_bias, fp32=True).view(B, T, H, K)
        g = self.lower_bound * torch.sigmoid(_f32(self.A_log).exp().view(H, 1) * f)
        return g, torch.sigmoid(_f32(self.b_proj(x)))


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (``t.float()`` without the no-op op call when it already is)."""
    return t if t.dtype == torch.float32 else t.float()
