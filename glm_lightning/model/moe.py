"""Mixture of experts: sigmoid routing, a shared expert and auxiliary-loss-free load balancing.

Routing follows DeepSeek-V3 (arXiv 2412.19437, section 2.1.2); the bias-based balancing is "Auxiliary-Loss-Free Load
Balancing Strategy for Mixture-of-Experts" (Wang et al., arXiv 2408.15664).

    s      = sigmoid(x W_r^T)                      fp32 affinities, [N, E]
    idx    = TopK(s + b, K)                        b: per-expert bias buffer, used for *selection only*
    w      = s[idx] / sum s[idx]   (only if K > 1) the gates use the unbiased s, so W_r gets gradient through w
    w     *= routed_scaling
    y      = sum_k w_k E_{idx_k}(x) + Shared(x)    E(x) = W2(SiLU(W1 x) * W3 x)

After every optimizer step the owner calls :meth:`MoE.update_balance_bias`, which applies
``b_i <- b_i + gamma * sign(mean_j load_j - load_i)`` using the token counts accumulated by the training-mode forwards
since the previous update. The bias is an fp32 buffer: it is checkpointed, but never seen by the optimizer.

A small sequence-wise balance loss (DeepSeek-V3 eq. 17-20) is returned as the auxiliary output:

    f_i = E / (K T) * #{t : i in TopK_t}     (no gradient)
    P_i = mean_t s'_{i,t},  s' = s / sum_j s_j  (gradient flows here)
    L   = alpha * sum_i f_i P_i,  averaged over the sequences of the batch.

Dispatch sorts the N*K (token, expert) assignments by expert once and runs all experts as one grouped (batched)
GEMM over a zero-padded [E, max load, d] batch (no capacity limit, no dropped tokens); each token then sums its K
weighted rows of the result (one C++ pass with the ops built, csrc/moe_rows.cpp). Two variants compute the same:
large calls with unequal loads run each expert on its own segment (no padding), and decoding a few rows runs the
padded batch through a C++ matmul that reads each weight row once (``SEGMENT_TOKENS``, ``SMALL_TOKENS``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from glm_lightning.model import cext
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.linear import linear


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (``t.float()`` without the no-op op call when it already is)."""
    return t if t.dtype == torch.float32 else t.float()


def _fused_swiglu(hgu: Tensor) -> bool:
    """Whether SwiGLU runs as the C++ ops of csrc/swiglu.cpp for hgu (contiguous, and see cext.takes)."""
    return hgu.is_contiguous() and cext.takes(hgu)


def _swiglu_act(hgu: Tensor) -> Tensor:
    """a = SiLU(gate) * up for the fused projections hgu [..., 2h] = [gate | up] (one pass with the C++ ops)."""
    if _fused_swiglu(hgu):
        return torch.ops.glm_lightning.swiglu(hgu)
    gate, up = hgu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_act_backward(da: Tensor, hgu: Tensor) -> Tensor:
    """d hgu = [da up SiLU'(gate) | da SiLU(gate)] (one pass with the C++ ops; eager: SiLU recomputed, cat)."""
    if _fused_swiglu(hgu):
        return torch.ops.glm_lightning.swiglu_backward(da, hgu)
    gate, up = hgu.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * F.silu(gate)], dim=-1)


class _SwiGLU(torch.autograd.Function):
    """The shared expert's activation with :func:`_swiglu_act` / :func:`_swiglu_act_backward` (autograd recorded
    chunk, SiLU and product, and replayed them as ~6 passes over the [tokens, 2h] projections); without the C++ ops
    both run their eager forms."""

    @staticmethod
    def forward(ctx, hgu: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(hgu)
        return _swiglu_act(hgu)

    @staticmethod
    def backward(ctx, da: Tensor) -> Tensor:  # type: ignore[override]
        return _swiglu_act_backward(da, ctx.saved_tensors[0])


def _token_gates(w: Tensor, dtype: torch.dtype) -> Tensor:
    """The gates w [N, K] flat [N * K] in token order, in the activations' dtype: the row moves' weights."""
    return (w if w.dtype == dtype else w.to(dtype)).reshape(-1)


def _rows_scatter(src: Tensor, slot: Tensor, K: int, scale: Tensor | None, rows: int) -> Tensor:
    """[rows, d] zeros with row slot[f] = scale[f] * src[f // K] (slot, scale [N * K] in token order): one pass with the
    C++ ops (csrc/moe_rows.cpp), else repeat_interleave, product and index_copy_."""
    if cext.takes(src, *(() if scale is None else (scale,))):
        return torch.ops.glm_lightning.rows_scatter(src.contiguous(), slot, K, scale, rows)
    rep = src.repeat_interleave(K, dim=0)
    return src.new_zeros(rows, src.shape[-1]).index_copy_(0, slot, rep if scale is None else rep * scale[:, None])


def _rows_gather_sum(src: Tensor, slot: Tensor, K: int, weight: Tensor | None) -> Tensor:
    """[N, d] with row n = sum_k weight[n K + k] * src[slot[n K + k]], k in order: one pass with the C++ ops, else
    index_select, product and sum."""
    if cext.takes(src, *(() if weight is None else (weight,))):
        return torch.ops.glm_lightning.rows_gather_sum(src.contiguous(), slot, K, weight)
    rows = src.index_select(0, slot).view(-1, K, src.shape[-1])
    return (rows if weight is None else rows * weight.view(-1, K, 1)).sum(1)


def _rows_dot(a: Tensor, b: Tensor, slot: Tensor, K: int) -> Tensor:
    """[N * K] with entry f = <a[f // K], b[slot[f]]>: one pass with the C++ ops, else gather, product and sum."""
    if cext.takes(a, b):
        return torch.ops.glm_lightning.rows_dot(a.contiguous(), b.contiguous(), slot, K)
    return (a.repeat_interleave(K, dim=0) * b.index_select(0, slot)).sum(-1)


class _GroupedExperts(torch.autograd.Function):
    """The routed experts as one grouped GEMM over sorted tokens, with a hand-written backward.

    x [N, d], gates w [N, K] and ``slot`` [N * K]: the padded row of token n's k-th choice (expert e's j-th assignment
    at e * cap + j), in token order -> y [N, d] = sum_k w_k E_{idx_k}(x). Forward: scatter into the zero-padded
    [E, cap, d] batch, two bmm, the gated sum of each token's rows. Backward, with a = SiLU(gate) * up:
    dgates = <dy_token, y_slot>, dys = gates * dy_token, dW_down = dys^T a, da = dys W_down,
    d[gate | up] = [silu'(gate) up da | SiLU(gate) da], dW_gate_up = d[gate | up]^T xs, dx = sum over the token's rows
    of d[..] W_gate_up. The row moves are one C++ pass each when the ops are built (:func:`_rows_scatter`,
    :func:`_rows_gather_sum`, :func:`_rows_dot`). Autograd recorded ~20 nodes here (index ops, views, bmm, chunk),
    replayed as ~80 ops; this is ~10 forward and ~15 backward.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor,  # type: ignore[override]
                slot: Tensor, cap: int) -> Tensor:
        E, K, d = w_gate_up.shape[0], w.shape[-1], x.shape[-1]
        xs = _rows_scatter(x, slot, K, None, E * cap).view(E, cap, d)
        hgu = torch.bmm(xs, w_gate_up.transpose(1, 2))                               # [E, cap, 2h]
        a = _swiglu_act(hgu)
        y_pad = torch.bmm(a, w_down.transpose(1, 2)).view(E * cap, d)
        gates = _token_gates(w, x.dtype)
        ctx.save_for_backward(xs, hgu, a, y_pad, gates, w_gate_up, w_down, slot)
        ctx.w_shape, ctx.w_dtype = w.shape, w.dtype
        return _rows_gather_sum(y_pad, slot, K, gates)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        xs, hgu, a, y_pad, gates, w_gate_up, w_down, slot = ctx.saved_tensors
        E, cap, d = xs.shape
        K = ctx.w_shape[-1]
        dy = dy.contiguous()
        dw = _rows_dot(dy, y_pad, slot, K).view(ctx.w_shape)
        dys = _rows_scatter(dy, slot, K, gates, E * cap).view(E, cap, d)
        need = ctx.needs_input_grad
        dw_down = torch.bmm(dys.transpose(1, 2), a) if need[3] else None             # [E, d, h]
        da = torch.bmm(dys, w_down)                                                   # [E, cap, h]
        dhgu = _swiglu_act_backward(da, hgu)
        dw_gate_up = torch.bmm(dhgu.transpose(1, 2), xs) if need[2] else None        # [E, 2h, d]
        dx = None
        if need[0]:
            dx = _rows_gather_sum(torch.bmm(dhgu, w_gate_up).view(E * cap, d), slot, K, None)
        return dx, dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype), dw_gate_up, dw_down, None, None


class _SegmentExperts(torch.autograd.Function):
    """The routed experts over sorted tokens without padding: each expert's two (and in backward four) GEMMs run on
    its own contiguous segment of the sorted assignments, written in place with ``mm(..., out=)``.

    Same math and backward as :class:`_GroupedExperts`; for large calls, where a zero-padded [E, max load, d] batch
    wastes what the loads are unequal by (a 96-prompt RL prefill shares its prompts' prefix, so identical tokens pick
    identical experts: the largest load was 1.8x the mean). The segments are views from one ``split`` per tensor, so
    each expert costs about one dispatched op per GEMM. ``token`` [A] is the token of each sorted assignment (the
    forward's gather), ``pos`` [N * K] the sorted row of token n's k-th choice (the gated combine and the backward, with
    the row moves of :class:`_GroupedExperts`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor,  # type: ignore[override]
                token: Tensor, pos: Tensor, counts: list[int]) -> Tensor:
        A, h = token.numel(), w_down.shape[-1]
        used = [e for e, n in enumerate(counts) if n]
        xs = x.index_select(0, token)                                                  # [A, d] sorted by expert
        hgu = x.new_empty(A, 2 * h)
        xs_e, hgu_e, wgu_t = xs.split(counts), hgu.split(counts), w_gate_up.transpose(1, 2).unbind(0)
        for e in used:
            torch.mm(xs_e[e], wgu_t[e], out=hgu_e[e])
        a = _swiglu_act(hgu)
        ys = x.new_empty(A, x.shape[-1])
        a_e, ys_e, wd_t = a.split(counts), ys.split(counts), w_down.transpose(1, 2).unbind(0)
        for e in used:
            torch.mm(a_e[e], wd_t[e], out=ys_e[e])
        gates = _token_gates(w, x.dtype)
        ctx.save_for_backward(xs, hgu, a, ys, gates, w_gate_up, w_down, pos)
        ctx.counts, ctx.used, ctx.w_shape, ctx.w_dtype = counts, used, w.shape, w.dtype
        return _rows_gather_sum(ys, pos, w.shape[-1], gates)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        xs, hgu, a, ys, gates, w_gate_up, w_down, pos = ctx.saved_tensors
        counts, used, need = ctx.counts, ctx.used, ctx.needs_input_grad
        K = ctx.w_shape[-1]
        dy = dy.contiguous()
        dw = _rows_dot(dy, ys, pos, K).view(ctx.w_shape)
        dys = _rows_scatter(dy, pos, K, gates, ys.shape[0])                           # [A, d], every row written
        da = a.new_empty(a.shape)                                                      # [A, h]
        dys_e, da_e, wd = dys.split(counts), da.split(counts), w_down.unbind(0)
        for e in used:
            torch.mm(dys_e[e], wd[e], out=da_e[e])
        dw_down = None
        if need[3]:
            dw_down = torch.zeros_like(w_down)                                        # [E, d, h]
            dys_t, a_e, dwd = dys.t().split(counts, dim=1), a.split(counts), dw_down.unbind(0)
            for e in used:
                torch.mm(dys_t[e], a_e[e], out=dwd[e])
        dhgu = _swiglu_act_backward(da, hgu)
        dw_gate_up = dx = None
        if need[2]:
            dw_gate_up = torch.zeros_like(w_gate_up)                                  # [E, 2h, d]
            dhgu_t, xs_e, dwgu = dhgu.t().split(counts, dim=1), xs.split(counts), dw_gate_up.unbind(0)
            for e in used:
                torch.mm(dhgu_t[e], xs_e[e], out=dwgu[e])
        if need[0]:
            dxs = xs.new_empty(xs.shape)
            dhgu_e, dxs_e, wgu = dhgu.split(counts), dxs.split(counts), w_gate_up.unbind(0)
            for e in used:
                torch.mm(dhgu_e[e], wgu[e], out=dxs_e[e])
            dx = _rows_gather_sum(dxs, pos, K, None)
        return (dx, dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype), dw_gate_up, dw_down, None, None, None)


class _Routing(torch.autograd.Function):
    """The routing after the router's sigmoid as the C++ ops of csrc/moe_route.cpp: scores s [N, E] -> gates w [N, K]
    and the balance loss (both differentiable in s), with the choices idx [N, K], per-expert counts [E] and the
    assignment rows (pos, slot) [N * K] of :meth:`MoE._assignment_rows`. One op forward and one backward, instead of
    ~45 and ~20 dispatched ops per layer (topk, gather, normalisation, bincount, argsort, the loss and their backward).
    ``alpha`` 0 skips the loss (its output is then a zero)."""

    @staticmethod
    def forward(ctx, s: Tensor, bias: Tensor, K: int, scale: float, B: int,  # type: ignore[override]
                alpha: float) -> tuple[Tensor, ...]:
        w, aux, idx, counts, pos, slot, coef = torch.ops.glm_lightning.moe_route(s, bias, K, scale, B, alpha)
        ctx.save_for_backward(s, idx, coef)
        ctx.scale = scale
        ctx.mark_non_differentiable(idx, counts, pos, slot)
        return w, aux, idx, counts, pos, slot

    @staticmethod
    def backward(ctx, dw: Tensor, daux: Tensor, *_: Tensor):  # type: ignore[override]
        s, idx, coef = ctx.saved_tensors
        ds = torch.ops.glm_lightning.moe_route_backward(dw, daux, s, idx, coef, ctx.scale)
        return ds, None, None, None, None, None


SEGMENT_TOKENS = 2048
SEGMENT_PADDING = 1.25
"""Calls with at least SEGMENT_TOKENS tokens whose padded batch would be at least SEGMENT_PADDING times the real
assignments (the largest load 25% above the mean) run per expert segment (:class:`_SegmentExperts`, no padding):
a 96-prompt RL prefill, 1.26x faster. Otherwise the padded batch stays: ~330 fewer dispatched ops per layer (fwd +
bwd), which the dispatch-bound study model and balanced loads need more (a fresh flash-25m at 32 x 128: largest load
1.07-1.18x the mean per layer; there the two were within noise of each other)."""

SMALL_TOKENS = 64
"""Without autograd, a call with at most this many tokens (decoding a few rows) runs its experts through
``glm_lightning::small_matmul`` (csrc/small_matmul.cpp: each weight row streamed once, padding rows skipped) instead
of BLAS, which repacks every expert's whole weight matrix per call. flash-25m's 12 MoE layers, 1 thread: 1.46x faster
at 16 tokens, 1.12x at 64, 1.05x at 96. The choice depends on the shape only, never on the routing, so a token's
output never depends on what the other tokens of the batch are."""


def _experts_small(x: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor, slot: Tensor, cap: int,
                   counts: Tensor) -> Tensor:
    """The forward of :class:`_GroupedExperts` without autograd, its two bmm as ``small_matmul`` over each expert's
    ``counts`` real rows (same row moves, same values within float rounding)."""
    E, K, d = w_gate_up.shape[0], w.shape[-1], x.shape[-1]
    xs = _rows_scatter(x, slot, K, None, E * cap).view(E, cap, d)
    a = _swiglu_act(torch.ops.glm_lightning.small_matmul(xs, w_gate_up, counts))
    y_pad = torch.ops.glm_lightning.small_matmul(a, w_down, counts).view(E * cap, d)
    return _rows_gather_sum(y_pad, slot, K, _token_gates(w, x.dtype))


class MoE(nn.Module):
    """Routed SwiGLU experts (top-K of E, sigmoid gates) plus an always-on shared SwiGLU expert.

    Parameters: ``router_weight`` [E, d], ``w_gate_up`` [E, 2h, d] (gate rows first, then up rows), ``w_down``
    [E, d, h], and when ``shared_expert_hidden > 0`` ``shared_gate_up`` [2h_s, d] and ``shared_down`` [d, h_s].
    Buffers: ``expert_bias`` [E] (fp32, persistent), ``load_counts`` [E] and ``last_load`` [E] (fp32, not saved).
    """

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        d, E, h, hs = cfg.d_model, cfg.n_experts, cfg.expert_hidden, cfg.shared_expert_hidden
        self.d_model, self.n_experts, self.top_k = d, E, cfg.moe_top_k
        self.expert_hidden, self.shared_hidden = h, hs
        self.routed_scaling = cfg.routed_scaling
        self.balance_bias_rate = cfg.balance_bias_rate
        self.balance_loss_weight = cfg.balance_loss_weight

        std = cfg.init_std
        self.router_weight = nn.Parameter(torch.empty(E, d).normal_(0.0, std))
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * h, d).normal_(0.0, std))
        self.w_down = nn.Parameter(torch.empty(E, d, h).normal_(0.0, std))
        if hs > 0:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * hs, d).normal_(0.0, std))
            self.shared_down = nn.Parameter(torch.empty(d, hs).normal_(0.0, std))
        else:
            self.register_parameter("shared_gate_up", None)
            self.register_parameter("shared_down", None)

        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        self.register_buffer("load_counts", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.register_buffer("last_load", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.register_buffer("_no_aux", torch.zeros(()), persistent=False)  # the skipped loss, not re-made per call

    # ----------------------------------------------------------------------------------------------------------------
    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens ``x`` [..., d]: returns fp32 scores ``s`` [..., E], expert ids ``idx`` [..., K] and fp32 gate
        weights ``w`` [..., K] (unbiased ``s`` of the chosen experts, renormalised when K > 1, times the scaling)."""
        s = self._scores(x)
        return (s, *self._select(s))

    def _scores(self, x: Tensor) -> Tensor:
        """The router's fp32 affinities s = sigmoid(x W_r^T) [..., E]."""
        return torch.sigmoid(linear(_f32(x), _f32(self.router_weight)))

    def _select(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """(idx, w) for the scores s [..., E]: the eager form of the selection and gates of :meth:`route`."""
        choice = s.detach() + _f32(self.expert_bias)
        idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        w = s.gather(-1, idx)
        if self.top_k > 1:
            w = w / w.sum(dim=-1, keepdim=True)
        return idx, w * self.routed_scaling

    @staticmethod
    def _swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
        return linear(_SwiGLU.apply(linear(x, w_gate_up)), w_down)

    @staticmethod
    def _assignment_rows(idx: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
        """(pos, slot) [N * K] for choices idx [N, K] (the eager form of what ``moe_route`` returns): token n's k-th
        choice, at n * K + k, is row ``pos`` of the assignments sorted stably by expert, and row ``slot`` of the
        zero-padded [E, cap] batch (expert e's j-th assignment at e * cap + j, cap = the largest load)."""
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        pos = torch.empty_like(order).index_copy_(0, order, torch.arange(flat.numel(), device=idx.device))
        cap, starts = max(counts), [0]
        for n in counts[:-1]:
            starts.append(starts[-1] + n)
        shift = torch.tensor([e * cap - s0 for e, s0 in enumerate(starts)], device=idx.device)
        return pos, pos + shift.index_select(0, flat)

    def _dispatch(self, x: Tensor, idx: Tensor, w: Tensor, counts: list[int], counts_t: Tensor,
                  rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Routed output for flat tokens x [N, d] with choices idx [N, K], gates w [N, K], per-expert counts, and the
        assignment rows (pos, slot) when the routing op gave them (else :meth:`_assignment_rows`).

        Grouped GEMM over sorted tokens: the N*K assignments are sorted by expert and written into one zero-padded
        [E, cap, d] batch (cap = the largest expert load), so all experts run as two batched matmuls instead of a
        Python loop of 5 small ops per expert. Padding rows are zeros, give zeros (SiLU(0) * 0) and are never read.
        Large calls (>= SEGMENT_TOKENS) run each expert on its own segment instead (no padding); small calls without
        autograd (<= SMALL_TOKENS, decoding) run the padded batch through ``small_matmul``.
        """
        K = self.top_k
        cap = max(counts)
        if cap == 0:  # no tokens at all
            return torch.zeros_like(x)
        # every path addresses token n's k-th choice at n * K + k
        pos, slot = self._assignment_rows(idx, counts) if rows is None else rows
        if x.shape[0] >= SEGMENT_TOKENS and self.n_experts * cap >= SEGMENT_PADDING * pos.numel():
            order = torch.empty_like(pos).index_copy_(0, pos, torch.arange(pos.numel(), device=x.device))
            return _SegmentExperts.apply(x, w, self.w_gate_up, self.w_down, order // K, pos, counts)
        if x.shape[0] <= SMALL_TOKENS and not torch.is_grad_enabled() and cext.takes(x, self.w_gate_up, fp64=False):
            return _experts_small(x, w, self.w_gate_up, self.w_down, slot, cap, counts_t)
        return _GroupedExperts.apply(x, w, self.w_gate_up, self.w_down, slot, cap)

    def _balance_loss(self, s: Tensor, idx: Tensor) -> Tensor:
        """Sequence-wise balance loss from scores s [B, T, E] and choices idx [B, T, K]."""
        B, T, E = s.shape
        K = self.top_k
        with torch.no_grad():
            hits = torch.zeros(B, E, device=s.device, dtype=s.dtype)
            hits.scatter_add_(1, idx.reshape(B, T * K), torch.ones(B, T * K, device=s.device, dtype=s.dtype))
            f = hits * (E / (K * T))
            # alpha * mean_b sum_e f_be P_be = sum_{b,t,e} s'_bte * f_be * alpha / (B T): one product and one sum
            coef = f.mul_(self.balance_loss_weight / (B * T)).unsqueeze(1)
        return ((s / s.sum(dim=-1, keepdim=True)) * coef).sum()

    def forward(self, x: Tensor, want_aux: bool = True) -> tuple[Tensor, Tensor]:
        """``x`` [B, T, d] -> (``y`` [B, T, d], scalar fp32 balance loss; 0 if its weight is 0, no tokens, or not
        ``want_aux``: decoding with a cache skips it, ~29 dispatched ops per layer and token that nothing reads).

        With the C++ ops built, the routing after the router's sigmoid, the balance loss and the assignment rows are
        one op (:class:`_Routing`); else :meth:`route`, :meth:`_balance_loss` and :meth:`_assignment_rows`."""
        B, T, d = x.shape
        xf = x.reshape(B * T, d)
        with_aux = want_aux and self.balance_loss_weight > 0 and B * T > 0
        s = self._scores(xf)
        rows = None
        if B * T > 0 and cext.takes(s):
            w, aux, idx, counts_t, *rows = _Routing.apply(s, self.expert_bias, self.top_k, self.routed_scaling, B,
                                                          self.balance_loss_weight if with_aux else 0.0)
        else:
            idx, w = self._select(s)
            counts_t = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
            if with_aux:
                aux = self._balance_loss(s.view(B, T, self.n_experts), idx.view(B, T, self.top_k))
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.load_counts += counts_t.to(self.load_counts.dtype)
        y = self._dispatch(xf, idx, w, counts_t.tolist(), counts_t, rows)
        if self.shared_gate_up is not None:
            y = y + self._swiglu(xf, self.shared_gate_up, self.shared_down)
        return y.view(B, T, d), aux if with_aux else self._no_aux

    # ----------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_balance_bias(self) -> None:
        """Aux-loss-free bias step from the loads counted since the last call; call after each optimizer step.

        Under an initialised torch.distributed process group the counts are summed over ranks first (every rank
        must call this, so the collective always runs). A no-op when no training-mode tokens were counted."""
        counts = self.load_counts.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        total = counts.sum()
        if total.item() == 0:
            return
        self.expert_bias += self.balance_bias_rate * torch.sign(counts.mean() - counts)
        self.last_load.copy_(counts / total)
        self.load_counts.zero_()

    def expert_load(self) -> Tensor:
        """Load fractions [E] (summing to 1) observed at the last :meth:`update_balance_bias`; zeros before it."""
        return self.last_load.clone()

    def extra_repr(self) -> str:
        return (f"d={self.d_model}, experts={self.n_experts}, top_k={self.top_k}, hidden={self.expert_hidden}, "
                f"shared_hidden={self.shared_hidden}, routed_scaling={self.routed_scaling}")
