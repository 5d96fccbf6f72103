"""Kimi Delta Attention (KDA), the linear-attention token mixer of the "L" layers.

Follows Kimi Linear (arXiv 2510.26692, "Kimi Linear: An Expressive, Efficient Attention Architecture"), with the
GLM-5.3 "safe gate" (``g = lb * sigmoid(...)``, ``lb = -5``, so every log decay lies in ``(lb, 0)``):

* the gated delta rule with a **per-head, per-key-channel** decay (fine-grained ``Diag(exp g_t)``)::

      S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

  step form: ``S *= exp(g_t); e = v_t - S^T k_t; S += k_t (beta_t e)^T; o_t = S^T q_t``;
* the chunkwise-parallel WY / UT form of the paper for training: inside a chunk of C tokens, with the in-chunk
  ``G = cumsum(g)`` and ``Gamma = exp(G)``::

      M[i, j]   = sum_d k_id k_jd exp(G_id - G_jd)        (j < i)
      A         = (I + diag(beta) M)^-1 diag(beta)           (unit-lower triangular solve)
      U = A V,  W = A (Gamma * K)
      Aqk[r, j] = sum_d q_rd k_jd exp(G_rd - G_jd)        (j <= r)
      O         = (Gamma * Q) S + Aqk (U - W S)
      S'        = Diag(Gamma_C) S + ((Gamma_C / Gamma) * K)^T (U - W S)

  Everything except the state hand-off is computed for all chunks at once. The hand-off is rewritten as
  ``S' = P S + R`` with ``P = Diag(Gamma_C) - ((Gamma_C/Gamma) K)^T W`` and ``R = ((Gamma_C/Gamma) K)^T U``, so the
  Python loop over chunks is one batched matmul-add per chunk (:class:`StateScan`, with a hand-written backward; one
  C++ op per direction when glm_lightning/model/cext.py has built it); the outputs are then
  ``Aqk U + (Gamma Q - Aqk W) S_c`` for all chunks at once (``S_c`` the state entering chunk c).
* fp32 safety of the factorised ``exp(G_i - G_j) = exp(G_i - ref) exp(ref - G_j)``: the reference is taken per row
  block of at most 16 rows (fewer if the gate bound needs it), at the block's first row; for C = 32 that is the chunk
  start and the chunk midpoint, as fla's 16-token sub-chunks. Each factor is then at most ``exp(|lb| (s - 1))`` with
  s the block size (75 for lb = -5, s = 16), far from fp32's ~88. Unlike a reference computed from the whole chunk,
  it never looks past the row it serves, so the chunked layer is causal bit for bit. Masked (future) entries are
  removed with ``masked_fill`` on finite values (never multiplied by 0: inf * 0 = NaN would leak the future), and
  future exponents are zeroed before the ``exp``, so no inf reaches autograd either.
* the layer of the paper / fla ``KimiDeltaAttention``: q/k/v projections, a causal depthwise short convolution
  (kernel ``kda_conv_size``) + SiLU, L2-normalised q and k (eps 1e-6), ``q *= d_k^-0.5``, ``beta = sigmoid(W_b x)``,
  the safe gate ``g = lb * sigmoid(exp(A_log) * (W_f2 W_f1 x + dt_bias))`` (``A_log`` init 0, ``dt_bias`` the inverse
  softplus of log-uniform [1e-3, 1e-1]), a low-rank output gate ``W_g2 W_g1 x`` (last linear with bias), a gated
  per-head RMSNorm ``RMSNorm_head(o) * sigmoid(gate)`` and an output projection. No biases except the output gate's,
  so the parameter count matches the formula of architecture.md section 12.

Padding (``valid`` False) and the tail padding of the chunked form are identity steps: ``g = 0, beta = 0, k = 0``, and
the raw projections fed to the short conv are zeroed at pads. A left-padded row therefore gives the same outputs at
its real positions as the unpadded row. (A pad in the middle of a row is an identity for the recurrent state but
still occupies a slot of the short conv's window, identically in the prefill and decode paths.)

Decoding keeps a :class:`KDACache`: the last ``ks - 1`` raw (pre-conv) projections and the fp32 state. A prefill with
``T > 1`` runs the core (:func:`kda_core`) from the cached state; ``T == 1`` runs a single recurrent step (written
into the cache in place when autograd is off).

CPU notes: q|k|v come from one fused matmul; the short conv + SiLU is one C++ op per direction when the ops are built
(csrc/short_conv.cpp), else a depthwise ``conv2d`` on the channels-last view of the ``[B, T, 3HK]`` projections (no
transposes); q and k are normalised in one pass. With the C++ ops built, training and prefill run the core as the
per-token recurrence, one C++ op per direction (:func:`kda_core`, glm_lightning/model/kda_recurrent_cpp.py): for
heads up to 64 it does fewer FLOPs than the chunked form, which pays extra [C, C] products for matmul-shaped work a
CPU does not need (`python -m benchmarks --only kda`, fwd + bwd at 2 threads: study model 1.9 -> 0.4 ms, flash-25m
44 -> 12 ms). Without them the chunked form runs (eager, on contiguous chunk-major ``[N, B, H, C, D]`` tensors:
``L^-1`` formed once, ``P``, ``R``, ``Aqk U`` and ``Aqk W`` from two matmuls).

State and gate math are fp32 (fp64 inputs to the pure functions stay fp64, for gradcheck-style tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glm_lightning.model import cext
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.kda_chunk import KDAChunkFunction, scan, scan_backward
from glm_lightning.model.kda_fused import GatedHeadNorm, GatedHeadNormCpp, KDAFeatures, KDAFeaturesCpp, ShortConvSiLU
from glm_lightning.model.kda_recurrent_cpp import recurrent_cpp
from glm_lightning.model.kda_recurrent_cpp import supports as recurrent_cpp_supports
from glm_lightning.model.linear import linear
from glm_lightning.model.norm import RMSNorm

__all__ = ["KDACache", "KDAttention", "StateScan", "kda_chunked", "kda_core", "kda_recurrent"]


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (``t.float()`` without the no-op op call when it already is)."""
    return t if t.dtype == torch.float32 else t.float()


def _compute_dtype(*xs: Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


_EXP_LIMIT = 80.0
"""Largest exponent the factorised exp may reach inside a row block (fp32 exp overflows above ~88.7)."""


def _n_row_blocks(C: int, gate_bound: float, max_rows: int = 16) -> int:
    """Number of row blocks of the factorised exp: the smallest divisor ns of C whose blocks of s = C / ns rows have
    s <= max_rows and (s - 1) * gate_bound <= _EXP_LIMIT."""
    ns = 1
    while C % ns or C // ns > max_rows or (C // ns - 1) * gate_bound > _EXP_LIMIT:
        ns += 1
    return ns


def kda_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token KDA recurrence (reference and decode form).

    Shapes: q, k, g ``[B, T, H, K]`` (g is the log decay, <= 0), v ``[B, T, H, V]``, beta ``[B, T, H]``,
    initial_state ``[B, H, K, V]``. q must already be scaled by ``K^-0.5``. Returns ``o [B, T, H, V]`` and the final
    state ``[B, H, K, V]``, both fp32 (fp64 if any input is fp64).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    q, k, v, g, beta = (x if x.dtype == dt else x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    decay = g.exp()
    outs = []
    for t in range(T):
        kt = k[:, t]                                                   # [B, H, K]
        S = S * decay[:, t].unsqueeze(-1)                              # Diag(exp g_t) S
        e = v[:, t] - (kt.unsqueeze(-2) @ S).squeeze(-2)               # v_t - S^T k_t      [B, H, V]
        S = S + kt.unsqueeze(-1) * (beta[:, t].unsqueeze(-1) * e).unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))           # S^T q_t
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, S


class StateScan(torch.autograd.Function):
    """The chunk hand-off S_{n+1} = P_n S_n + R_n for n < N: P [N, M, K, K], R [N, M, K, V], S_0 [M, K, V] ->
    all states [N + 1, M, K, V] (S_0 first).

    The one sequential part of the chunked form, written with its backward so that autograd does not record (and
    replay) N baddbmm / unbind / stack nodes:  dS_n = dS_n(direct) + P_n^T dS_{n+1},  dR_n = dS_{n+1},
    dP_n = dS_{n+1} S_n^T (the last two for all n at once).

    With the C++ ops (glm_lightning/model/cext.py, csrc/state_scan.cpp) each loop is one op; ``fused`` (the last
    argument) picks them.
    """

    @staticmethod
    def forward(ctx, P: Tensor, R: Tensor, S0: Tensor, fused: bool = False) -> Tensor:
        ctx.fused = fused
        S_all = scan(P, R, S0, fused)
        ctx.save_for_backward(P, S_all)
        return S_all

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        P, S_all = ctx.saved_tensors
        g = scan_backward(grad, P, ctx.fused)
        g_next = g[1:]
        return torch.matmul(g_next, S_all[:-1].transpose(-1, -2)), g_next, g[0], None


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 32,
    initial_state: Tensor | None = None,
    *,
    gate_bound: float | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel (WY / UT) KDA, numerically equal to :func:`kda_recurrent`.

    Same shapes and return values as :func:`kda_recurrent`. T is padded to a multiple of ``chunk_size`` with identity
    steps. ``gate_bound`` is an upper bound of ``|g|`` (the safe gate's ``|lb|``); it sets the row blocks of the
    factorised exp so that fp32 cannot overflow. If None it is read from the data (``max(-g)``). ``fused`` picks the
    chunk hand-off: the C++ op (True), the eager loop (False), or the C++ op when it is built (None). The layer runs
    :func:`kda_core`, which prefers the C++ recurrence.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=dt), S
    q, k, v, g, beta = (x if x.dtype == dt else x.to(dt) for x in (q, k, v, g, beta))
    # Factorised exp(G_i - G_j) = exp(G_i - ref_a) * exp(ref_a - G_j), one reference per row block a of s <= 16
    # rows: ref_a = G at the block's first row (lb = -5, C = 32: s = 16, the second block's reference is the chunk
    # midpoint). Then exp(G_i - ref_a) <= 1, and exp(ref_a - G_j) is <= 1 for j before the block and
    # <= exp(|lb| (s - 1)) <= exp(80) inside it (s is chosen so). The reference never looks past row i, which keeps the
    # layer causal bit for bit, and the result does not depend on it (no gradient flows through it). Columns after
    # the block are never needed: their exponent is zeroed *before* the exp (no inf, no inf * 0 in backward).
    if gate_bound is None:
        gate_bound = float(-g.detach().min().clamp(max=0.0))
    ns = _n_row_blocks(chunk_size, abs(gate_bound))
    use_cpp = cext.takes(q) if fused is None else fused
    return KDAChunkFunction.apply(q, k, v, g, beta, S, chunk_size, ns, use_cpp)


def kda_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 32,
    initial_state: Tensor | None = None,
    *,
    gate_bound: float | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """The core the layer runs over T tokens (training, prefill): the per-token recurrence as one C++ op per direction
    (glm_lightning/model/kda_recurrent_cpp.py: fewer FLOPs than the chunked form for heads up to 64 on a CPU) when the
    C++ ops take the tensors (``fused`` None) or when asked (True); else :func:`kda_chunked` (False, or no C++ ops).
    Same arguments and results as :func:`kda_chunked` (``chunk_size`` and ``gate_bound`` only serve the chunked form).
    """
    K, V = q.shape[-1], v.shape[-1]
    use_cpp = (cext.takes(q, k, v, g, beta) if fused is None else fused) and q.shape[1] > 0
    if use_cpp and recurrent_cpp_supports(K, V):
        B, _, H, _ = q.shape
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(q.dtype)
        return recurrent_cpp(q, k, v, g, beta, S)
    return kda_chunked(q, k, v, g, beta, chunk_size, initial_state, gate_bound=gate_bound, fused=fused)


def _fusable(*ts: Tensor) -> bool:
    """Whether the C++ decode ops (csrc/kda_decode.cpp, fp32 only) take these tensors."""
    return cext.takes(*ts, fp64=False)


def _delta_step_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
                 fused: bool | None = None) -> Tensor:
    """One recurrent step written into S in place (decode, no autograd). q, k, g [B, H, K]; v [B, H, V]; beta [B, H];
    S [B, H, K, V] fp32, contiguous. Returns o [B, H, V].

    ``fused`` (default: when the C++ ops are loaded and everything is fp32) runs ``glm_lightning::delta_step_``: one
    pass over each head's state instead of six over the whole cache (the state is 38 MB per layer at 1,536 rows).
    The eager form flattens the heads into the batch ([B*H, ...] views, one bmm per product), ~25 dispatched ops."""
    if fused if fused is not None else _fusable(q, k, v, g, beta, S):
        return torch.ops.glm_lightning.delta_step_(q, k, v, g, beta, S)
    B, H, K, V = S.shape
    Sf = S.view(B * H, K, V)
    kf = _f32(k).reshape(B * H, K, 1)
    Sf.mul_(_f32(g).reshape(B * H, K, 1).exp())                                # Diag(exp g) S
    e = _f32(v).reshape(B * H, 1, V) - torch.bmm(kf.transpose(1, 2), Sf)       # v - S^T k   [BH, 1, V]
    Sf.addcmul_(kf, e.mul_(_f32(beta).reshape(B * H, 1, 1)))                   # S += k (beta e)^T
    return torch.bmm(_f32(q).reshape(B * H, 1, K), Sf).view(B, H, V)          # S^T q


def _conv_step_(conv_state: Tensor, raw: Tensor, weight: Tensor, fused: bool | None = None) -> Tensor:
    """One decode step of the causal depthwise short conv + SiLU, shifting ``raw`` into ``conv_state`` in place.

    conv_state [B, ks-1, C] (the previous raw inputs), raw [B, 1, C], weight [C, 1, ks] -> SiLU(conv) [B, 1, C].
    ``fused`` (default: C++ ops loaded, fp32) runs ``glm_lightning::conv_step_``, one pass instead of five (cat,
    product, sum, SiLU, shift)."""
    C, ks = weight.shape[0], weight.shape[-1]
    if fused if fused is not None else _fusable(conv_state, raw, weight):
        return torch.ops.glm_lightning.conv_step_(conv_state, raw, weight.view(C, ks)).view(raw.shape)
    xp = torch.cat([conv_state.to(raw.dtype), raw], dim=1)                          # [B, ks, C]
    # the weight made contiguous [ks, Ch] first: broadcast as the strided view w.t(), the product over [1536, 4, 576]
    # took 1.5 ms instead of 0.6 (bad loop order)
    y = F.silu((xp * weight.view(C, ks).t().contiguous()).sum(1, keepdim=True))
    conv_state.copy_(xp[:, 1:])
    return y


def _writable(t: Tensor) -> bool:
    """Whether t may be updated in place here (inference tensors only inside inference mode)."""
    return not t.is_inference() or torch.is_inference_mode_enabled()


@dataclass
class KDACache:
    """Decode state of one KDA layer.

    ``conv_state [B, ks-1, 3*H*K]``: the last ks-1 raw (pre-conv) q|k|v projections (channel order q, k, v), time
    before channels, so that decoding appends the new projection with one contiguous ``cat`` (the channel-major layout
    made that cat and the conv's product strided).
    ``state [B, H, K, V]``: the fp32 recurrent state.
    """

    conv_state: Tensor
    state: Tensor
    in_weights: tuple[Tensor, Tensor] | None = None
    """The layer's fused input projections for this decode (built on first use). They live with the cache, not the
    layer, because weights cannot change during one generation but do between generations, and an optimizer that
    writes in place need not bump the version counter (fused AdamW does not), so no cache key on the layer is safe."""

    @classmethod
    def empty(cls, batch: int, cfg: GLMConfig, device: torch.device | str | None = None) -> KDACache:
        H, K = cfg.n_heads, cfg.head_dim
        return cls(
            conv_state=torch.zeros(batch, cfg.kda_conv_size - 1, 3 * H * K, device=device),
            state=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32),
        )

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def repeat_interleave(self, n: int) -> KDACache:
        """Each row replicated n times along the batch (row i -> rows i*n .. i*n+n-1)."""
        return KDACache(self.conv_state.repeat_interleave(n, dim=0), self.state.repeat_interleave(n, dim=0),
                        self.in_weights)

    def index_select(self, rows: Tensor) -> KDACache:
        """The cache of the given batch rows (a copy)."""
        rows = rows.to(self.state.device)
        return KDACache(self.conv_state.index_select(0, rows), self.state.index_select(0, rows), self.in_weights)


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
        # One causal depthwise conv over the concatenated q|k|v channels (weight [3HK, 1, ks], no bias); run as a
        # channels-last depthwise conv2d, see _short_conv.
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
        # per (q heads | k heads) divisor of the fused L2 norm: sqrt(K) for q (q / |q| * K^-0.5), 1 for k
        self.register_buffer("_qk_rescale", torch.tensor([K ** 0.5] * H + [1.0] * H).view(2 * H, 1), persistent=False)
        self.register_buffer("_no_aux", torch.zeros(()), persistent=False)  # KDA's aux loss (none), not re-made per call
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

    # ---------------------------------------------------------------------------------------------------------------
    def _short_conv(self, raw: Tensor, ctx: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Causal depthwise conv + SiLU over time (without a ctx: the C++ op of csrc/short_conv.cpp when built).

        raw [B, T, Ch] raw projections; ctx [B, ks-1, Ch] the previous raw inputs, or None for zeros (training).
        Returns SiLU(conv) [B, T, Ch] and, with a ctx, the raw inputs after their context [B, ks-1+T, Ch].
        The [B, T, Ch] tensor viewed as [B, Ch, 1, T] is channels-last memory, which oneDNN's depthwise conv2d
        consumes and produces without any transpose copies.
        """
        T, ks, Ch = raw.shape[1], self.conv_size, raw.shape[-1]
        w = self.conv.weight                                                         # [Ch, 1, ks]
        if ctx is None and ks <= 16 and cext.takes(raw, w):  # the C++ op's kernel limit
            return ShortConvSiLU.apply(raw, w), None
        if ctx is None:
            xp = None
            y = F.conv2d(raw.transpose(1, 2).unsqueeze(2), w.unsqueeze(2), groups=Ch, padding=(0, ks - 1))
            y = y[..., :T]                                                           # causal: left context only
        else:
            xp = torch.cat([ctx, raw], dim=1)
            y = F.conv2d(xp.transpose(1, 2).unsqueeze(2), w.unsqueeze(2), groups=Ch)
        return F.silu(y.squeeze(2).transpose(1, 2)), xp

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(g, beta) for input x: g [B, T, H, K] in [lb, 0], beta [B, T, H] in (0, 1), fp32."""
        B, T, _ = x.shape
        return self._gates(self.f_a_proj(x), self.b_proj(x), B, T)

    def _gates(self, f1: Tensor, b: Tensor, B: int, T: int) -> tuple[Tensor, Tensor]:
        H, K = self.n_heads, self.head_dim
        f = linear(_f32(f1), _f32(self.f_b_proj.weight), _f32(self.dt_bias)).view(B, T, H, K)  # W_f2 f1 + dt_b
        g = self.lower_bound * torch.sigmoid(_f32(self.A_log).exp().view(H, 1) * f)
        return g, torch.sigmoid(_f32(b))

    def _in_weights(self, cache: KDACache | None) -> tuple[Tensor, Tensor]:
        """The fused input projections [W_q; W_k; W_v] and [W_f1; W_g1; W_b]: rebuilt on every call, except while
        decoding without autograd, where the decode cache keeps them for the rest of that generation."""
        qkv = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        small = (self.f_a_proj.weight, self.g_a_proj.weight, self.b_proj.weight)
        if cache is None or torch.is_grad_enabled():
            return torch.cat(qkv), torch.cat(small)
        if cache.in_weights is None:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in and out of inference mode
                cache.in_weights = (torch.cat(qkv), torch.cat(small))
        return cache.in_weights

    def forward(self, x: Tensor, valid: Tensor | None = None,
                cache: KDACache | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, C] -> (y [B, T, C], aux loss: a zero scalar, KDA has none; the same contract as DSA's mixer).
        ``valid`` [B, T] bool (False = pad); ``cache`` is updated in place."""
        # decode fast path: one step written into the cache (conv buffer and state updated in place)
        step = (cache is not None and x.shape[1] == 1 and not torch.is_grad_enabled() and _writable(cache.state)
                and _writable(cache.conv_state))
        if step and valid is None and _fusable(x, self.A_log, self.dt_bias, self._qk_rescale, self.o_norm.weight,
                                               cache.state, cache.conv_state, self.conv.weight):
            return self._decode_core(x, cache), self._no_aux
        q, k, v, g, beta, gate, raw = self._features(x, valid, cache, step)
        B, T, H, K = q.shape
        if cache is None:
            o, _ = kda_core(q, k, v, g, beta, self.chunk_size, gate_bound=-self.lower_bound)
        elif step:
            o = _delta_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache.state).unsqueeze(1)
        else:
            if T == 1:
                o, S = kda_recurrent(q, k, v, g, beta, initial_state=cache.state)
            else:
                o, S = kda_core(q, k, v, g, beta, self.chunk_size, initial_state=cache.state,
                                gate_bound=-self.lower_bound)
            self._update_cache(cache, raw, S)
        gate = _f32(gate)  # RMSNorm_head(o) * sigmoid(gate): one C++ pass each way when the ops take the tensors
        o = (GatedHeadNormCpp if cext.takes(o, gate, self.o_norm.weight) else GatedHeadNorm).apply(
            o, gate, self.o_norm.weight, self.o_norm.eps)
        return linear(o if o.dtype == x.dtype else o.to(x.dtype), self.o_proj.weight), self._no_aux

    def _decode_core(self, x: Tensor, cache: KDACache) -> Tensor:
        """A decode step without padding (x [B, 1, C] fp32): the projections, then the short conv, the features, the
        delta rule and the gated norm as one C++ op (``glm_lightning::kda_decode_core``: the same ops as the step
        path of :meth:`forward`, on the same views, so the same values; ~20 fewer top-level ops), then the output
        projection."""
        raw, f, b, gate = self._projections(x, cache)
        C, ks = self.conv.weight.shape[0], self.conv.weight.shape[-1]
        o = torch.ops.glm_lightning.kda_decode_core(raw, f, b, _f32(self.A_log), self._qk_rescale, self.lower_bound,
                                                    cache.conv_state, self.conv.weight.view(C, ks), cache.state,
                                                    _f32(gate), self.o_norm.weight, self.o_norm.eps)
        return linear(o.view(x.shape[0], 1, -1), self.o_proj.weight)

    def _features(self, x: Tensor, valid: Tensor | None, cache: KDACache | None, step: bool = False):
        """Everything before the recurrence: q, k (unit norm, q scaled), v, g, beta (fp32), the output-gate
        pre-activation and, with a cache, the raw (masked) q|k|v projections after their conv context
        [B, ks-1+T, 3HK] (None for a decode ``step``, which shifts the new projection into the cache itself)."""
        raw, f, b, gate = self._projections(x, cache)
        if valid is not None:
            valid = valid.to(device=x.device, dtype=torch.bool)
            raw = raw.masked_fill(~valid.unsqueeze(-1), 0.0)
        if step:
            y, raw_ext = _conv_step_(cache.conv_state, raw, self.conv.weight), None
        else:
            y, raw_ext = self._short_conv(raw, None if cache is None else cache.conv_state.to(raw.dtype))
        # L2-normalise q and k together (eps 1e-6, as F.normalize) and fold q's K^-0.5 into the same division; the
        # gates g = lb * sigmoid(exp(A_log) * (W_f2 f1 + dt_bias)), beta = sigmoid(b): one Function (kda_fused.py)
        y, A_log = _f32(y), _f32(self.A_log)
        features = KDAFeaturesCpp if cext.takes(y, f, b, A_log, self._qk_rescale) else KDAFeatures
        q, k, v, g, beta = features.apply(y, f, b, A_log, self._qk_rescale, self.lower_bound)
        if valid is not None:  # pads are identity steps of the state
            pad = ~valid
            k = k.masked_fill(pad[..., None, None], 0.0)
            g = g.masked_fill(pad[..., None, None], 0.0)
            beta = beta.masked_fill(pad[..., None], 0.0)
        return q, k, v, g, beta, gate, raw_ext

    def _projections(self, x: Tensor, cache: KDACache | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The input projections of x [B, T, C]: raw q|k|v [B, T, 3HK] (before the short conv), f = W_f2 f1 + dt_bias
        [B, T, HK] and b [B, T, H] (fp32, the gates' pre-activations) and the output gate's pre-activation [B, T, HK]."""
        H, K = self.n_heads, self.head_dim
        w_qkv, w_small = self._in_weights(cache)
        raw = linear(x, w_qkv)                                                     # [B, T, 3HK] q|k|v
        f1, g1, b = linear(x, w_small).split([K, K, H], dim=-1)
        f = linear(_f32(f1), _f32(self.f_b_proj.weight), _f32(self.dt_bias))
        return raw, f, _f32(b), linear(g1, self.g_b_proj.weight, self.g_b_proj.bias)

    def _update_cache(self, cache: KDACache, raw_ext: Tensor, S: Tensor) -> None:
        ks = self.conv_size
        conv_state = raw_ext[:, raw_ext.shape[1] - (ks - 1):]
        state = _f32(S)
        if (state.requires_grad or conv_state.requires_grad or not _writable(cache.state)
                or not _writable(cache.conv_state)):
            # keep the autograd graph (or an inference tensor outside inference mode): rebind instead of writing
            cache.conv_state, cache.state = conv_state.contiguous(), state
        else:
            cache.conv_state.copy_(conv_state)
            cache.state.copy_(state)
