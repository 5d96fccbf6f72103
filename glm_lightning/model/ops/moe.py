"""MoE's ops (references: ``reference.moe_route``, ``reference.moe_balance_loss``, ``reference.moe_experts``,
``reference.swiglu``): the routing after the router's sigmoid, the routed experts and the shared expert's SwiGLU.

Routing: as the C++ op of csrc/moe_route.cpp (selection, gates, balance loss and assignment rows, one op forward and
one backward instead of ~45 and ~20 dispatched ops per layer), else the reference forms and :func:`assignment_rows`.

Experts: the N*K (token, expert) assignments sorted by expert run as one grouped GEMM over a zero-padded [E, max load,
d] batch (no capacity limit, no dropped tokens; padding rows are zeros, give zeros and are never read), each token
then summing its K weighted rows (:class:`_GroupedExperts`, with a hand-written backward: autograd recorded ~20 nodes,
replayed as ~80 ops; this is ~10 forward and ~15 backward). Two variants compute the same (thresholds.py): large calls
with unequal loads run each expert on its own segment (:class:`_SegmentExperts`, no padding), and decoding a few rows
runs the padded batch through ``small_matmul`` (:func:`_experts_small`). The row moves are one C++ pass each when the
ops take the tensors (csrc/moe_rows.cpp), else index_select / index_copy_ and products.

Decoding: inside an fp32 decode step the whole layer (router, routing, experts, shared expert) is one C++ op
(:func:`moe_decode`, csrc/moe_decode.cpp), the same kernels in the same order as the ops one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_lightning.model.ops import backend, decode, mixed_precision as mp, thresholds
from glm_lightning.model.ops import matmul
from glm_lightning.model.ops.matmul import linear, small_matmul
from glm_lightning.model.ops.reference import moe_balance_loss, moe_route as route_reference


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _swiglu_cpp(hgu: Tensor) -> bool:
    """Whether SwiGLU runs as the C++ ops of csrc/swiglu.cpp for hgu."""
    return hgu.is_contiguous() and backend.takes(hgu, op="swiglu", bf16=True)


def _swiglu_act(hgu: Tensor) -> Tensor:
    """a = SiLU(gate) * up for the fused projections hgu [..., 2h] = [gate | up] (one pass with the C++ ops)."""
    if _swiglu_cpp(hgu):
        return torch.ops.glm_lightning.swiglu(hgu)
    gate, up = hgu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_act_backward(da: Tensor, hgu: Tensor) -> Tensor:
    """d hgu = [da up SiLU'(gate) | da SiLU(gate)] (one pass with the C++ ops; eager: SiLU recomputed, cat)."""
    if _swiglu_cpp(hgu):
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
    @mp.autocast_off_backward
    def backward(ctx, da: Tensor) -> Tensor:  # type: ignore[override]
        return _swiglu_act_backward(da, ctx.saved_tensors[0])


def _token_gates(w: Tensor, dtype: torch.dtype) -> Tensor:
    """The gates w [N, K] flat [N * K] in token order, in the activations' dtype: the row moves' weights."""
    return (w if w.dtype == dtype else w.to(dtype)).reshape(-1)


def _rows_scatter(src: Tensor, slot: Tensor, K: int, scale: Tensor | None, rows: int) -> Tensor:
    """[rows, d] zeros with row slot[f] = scale[f] * src[f // K] (slot, scale [N * K] in token order): one pass with the
    C++ ops (csrc/moe_rows.cpp), else repeat_interleave, product and index_copy_."""
    if backend.takes(src, *(() if scale is None else (scale,)), op="rows_scatter", bf16=True):
        return torch.ops.glm_lightning.rows_scatter(src.contiguous(), slot, K, scale, rows)
    rep = src.repeat_interleave(K, dim=0)
    return src.new_zeros(rows, src.shape[-1]).index_copy_(0, slot, rep if scale is None else rep * scale[:, None])


def _rows_gather_sum(src: Tensor, slot: Tensor, K: int, weight: Tensor | None) -> Tensor:
    """[N, d] with row n = sum_k weight[n K + k] * src[slot[n K + k]], k in order: one pass with the C++ ops, else
    index_select, product and sum."""
    if backend.takes(src, *(() if weight is None else (weight,)), op="rows_gather_sum", bf16=True):
        return torch.ops.glm_lightning.rows_gather_sum(src.contiguous(), slot, K, weight)
    rows = src.index_select(0, slot).view(-1, K, src.shape[-1])
    return (rows if weight is None else rows * weight.view(-1, K, 1)).sum(1)


def _rows_dot(a: Tensor, b: Tensor, slot: Tensor, K: int) -> Tensor:
    """[N * K] with entry f = <a[f // K], b[slot[f]]>: one pass with the C++ ops, else gather, product and sum."""
    if backend.takes(a, b, op="rows_dot", bf16=True):
        return torch.ops.glm_lightning.rows_dot(a.contiguous(), b.contiguous(), slot, K)
    return (a.repeat_interleave(K, dim=0) * b.index_select(0, slot)).sum(-1)


def _rows_scatter_dot(dy: Tensor, y: Tensor, slot: Tensor, K: int, gates: Tensor) -> tuple[Tensor, Tensor]:
    """The backward's first pass: (:func:`_rows_scatter` (dy, slot, K, gates, rows of y), :func:`_rows_dot`
    (dy, y, slot, K)), one C++ pass reading dy once when the ops take the tensors, else the two (same values)."""
    if backend.takes(dy, y, gates, op="rows_scatter", bf16=True) and backend.takes(dy, y, op="rows_dot", bf16=True):
        return torch.ops.glm_lightning.rows_scatter_dot(dy.contiguous(), y.contiguous(), slot, K, gates)
    return _rows_scatter(dy, slot, K, gates, y.shape[0]), _rows_dot(dy, y, slot, K)


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
        hgu = mp.bmm(xs, w_gate_up.transpose(1, 2))                                  # [E, cap, 2h]
        a = _swiglu_act(hgu)
        y_pad = mp.bmm(a, w_down.transpose(1, 2)).view(E * cap, d)
        gates = _token_gates(w, x.dtype)
        ctx.save_for_backward(xs, hgu, a, y_pad, gates, w_gate_up, w_down, slot)
        ctx.w_shape, ctx.w_dtype = w.shape, w.dtype
        return _rows_gather_sum(y_pad, slot, K, gates)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        xs, hgu, a, y_pad, gates, w_gate_up, w_down, slot = ctx.saved_tensors
        E, cap, d = xs.shape
        K = ctx.w_shape[-1]
        dy = dy.contiguous()
        dys, dw = _rows_scatter_dot(dy, y_pad, slot, K, gates)
        dw, dys = dw.view(ctx.w_shape), dys.view(E, cap, d)
        need = ctx.needs_input_grad
        dw_down = mp.bmm(dys.transpose(1, 2), a) if need[3] else None                # [E, d, h]
        da = mp.bmm(dys, w_down)                                                      # [E, cap, h]
        dhgu = _swiglu_act_backward(da, hgu)
        dw_gate_up = mp.bmm(dhgu.transpose(1, 2), xs) if need[2] else None           # [E, 2h, d]
        dx = None
        if need[0]:
            dx = _rows_gather_sum(mp.bmm(dhgu, w_gate_up).view(E * cap, d), slot, K, None)
        return dx, dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype), dw_gate_up, dw_down, None, None


class _SegmentExperts(torch.autograd.Function):
    """The routed experts over sorted tokens without padding, one expert at a time: each expert's two (and in backward
    four) GEMMs run on its own contiguous segment of the sorted assignments, with its activation in between.

    Same math and backward as :class:`_GroupedExperts`. Why: no zero padding (the padded [E, max load, d] batch wastes
    what the loads are unequal by: a 96-prompt RL prefill shares its prompts' prefix, so identical tokens pick
    identical experts, the largest load 1.8x the mean), and one expert's intermediates at a time (at flash-25m's 32 x
    128, ~1,000 rows: [rows, 2h] is 3 MB, where the whole padded batch's is 28 MB), so that the activation and its
    backward read what the GEMM just wrote from the cache instead of memory (the SwiGLU backward over the whole batch
    ran at ~3x its in-cache time per element). The segments are views from one ``split`` per tensor, so each expert
    costs a few dispatched ops. ``token`` [A] is the token of each sorted assignment (the forward's gather), ``pos``
    [N * K] the sorted row of token n's k-th choice (the gated combine and the backward, with the row moves of
    :class:`_GroupedExperts`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor,  # type: ignore[override]
                token: Tensor, pos: Tensor, counts: list[int]) -> Tensor:
        A, h = token.numel(), w_down.shape[-1]
        used = [e for e, n in enumerate(counts) if n]
        xs = x.index_select(0, token)                                                  # [A, d] sorted by expert
        hgu, ys = x.new_empty(A, 2 * h), x.new_empty(A, x.shape[-1])
        xs_e, hgu_e, ys_e = xs.split(counts), hgu.split(counts), ys.split(counts)
        wgu_t, wd_t = w_gate_up.transpose(1, 2).unbind(0), w_down.transpose(1, 2).unbind(0)
        a_e: list[Tensor] = []                                                         # [n_e, h] per used expert
        for e in used:
            mp.mm(xs_e[e], wgu_t[e], out=hgu_e[e])
            a_e.append(_swiglu_act(hgu_e[e]))
            mp.mm(a_e[-1], wd_t[e], out=ys_e[e])
        gates = _token_gates(w, x.dtype)
        ctx.save_for_backward(xs, hgu, ys, gates, w_gate_up, w_down, pos, *a_e)
        ctx.counts, ctx.used, ctx.w_shape, ctx.w_dtype = counts, used, w.shape, w.dtype
        return _rows_gather_sum(ys, pos, w.shape[-1], gates)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        xs, hgu, ys, gates, w_gate_up, w_down, pos, *a_e = ctx.saved_tensors
        counts, used, need = ctx.counts, ctx.used, ctx.needs_input_grad
        K = ctx.w_shape[-1]
        dy = dy.contiguous()
        dys, dw = _rows_scatter_dot(dy, ys, pos, K, gates)                            # [A, d], every row written
        dw = dw.view(ctx.w_shape)
        dw_gate_up = _expert_grad(w_gate_up, used) if need[2] else None               # [E, 2h, d]
        dw_down = _expert_grad(w_down, used) if need[3] else None                     # [E, d, h]
        dxs = xs.new_empty(xs.shape) if need[0] else None
        dys_e, xs_e, hgu_e = dys.split(counts), xs.split(counts), hgu.split(counts)
        wd, wgu = w_down.unbind(0), w_gate_up.unbind(0)
        dxs_e = None if dxs is None else dxs.split(counts)
        for a, e in zip(a_e, used):
            if dw_down is not None:
                mp.mm(dys_e[e].t(), a, out=dw_down[e])
            dhgu = _swiglu_act_backward(mp.mm(dys_e[e], wd[e]), hgu_e[e])              # [n_e, 2h]
            if dw_gate_up is not None:
                mp.mm(dhgu.t(), xs_e[e], out=dw_gate_up[e])
            if dxs_e is not None:
                mp.mm(dhgu, wgu[e], out=dxs_e[e])
        dx = None if dxs is None else _rows_gather_sum(dxs, pos, K, None)
        return (dx, dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype), dw_gate_up, dw_down, None, None, None)


def _expert_grad(weight: Tensor, used: list[int]) -> Tensor:
    """An uninitialised gradient for the experts' stacked ``weight`` [E, ...] with the experts not in ``used`` zeroed:
    the used experts' slices are then each written whole by one ``mm(out=)`` (zeros_like wrote all E slices first,
    ~14 MB per flash-25m layer, then the GEMMs wrote the used ones again)."""
    grad = torch.empty_like(weight)
    if len(used) < weight.shape[0]:
        busy = set(used)
        grad[[e for e in range(weight.shape[0]) if e not in busy]] = 0
    return grad


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
    @mp.autocast_off_backward
    def backward(ctx, dw: Tensor, daux: Tensor, *_: Tensor):  # type: ignore[override]
        s, idx, coef = ctx.saved_tensors
        ds = torch.ops.glm_lightning.moe_route_backward(dw, daux, s, idx, coef, ctx.scale)
        return ds, None, None, None, None, None


def _experts_small(x: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor, slot: Tensor, cap: int,
                   counts: Tensor) -> Tensor:
    """The forward of :class:`_GroupedExperts` without autograd, its two bmm over each expert's ``counts`` real rows as
    ``panel_matmul`` on the experts' panel-packed weights inside a cached decode (matmul.packed_weights), else
    ``small_matmul`` (same row moves, same values within float rounding; panel_matmul's bit for bit). Where the SwiGLU
    runs as its C++ op, small_matmul applies it to the gate and up sums it has just computed (the same values bit for
    bit): no [E, cap, 2h] projections written and read back, no SwiGLU over the padding rows (a prefill's batch has
    half of them padding at 16 tokens), one dispatched op less per layer."""
    E, K, d = w_gate_up.shape[0], w.shape[-1], x.shape[-1]
    xs = _rows_scatter(x, slot, K, None, E * cap).view(E, cap, d)
    p_gate_up = matmul.packed(w_gate_up) if matmul._packs is not None else None
    if p_gate_up is None:
        if backend.takes(xs, op="swiglu", bf16=True):
            a = small_matmul(xs, w_gate_up, counts, swiglu=True)
        else:
            a = _swiglu_act(small_matmul(xs, w_gate_up, counts))
        y_pad = small_matmul(a, w_down, counts).view(E * cap, d)
    else:
        a = _swiglu_act(matmul.panel_matmul(xs, p_gate_up, w_gate_up.shape[1], counts))
        y_pad = matmul.panel_matmul(a, matmul.packed(w_down), d, counts).view(E * cap, d)
    return _rows_gather_sum(y_pad, slot, K, _token_gates(w, x.dtype))


def assignment_rows(idx: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
    """(pos, slot) [N * K] for choices idx [N, K] (what ``moe_route`` returns in C++): token n's k-th choice, at
    n * K + k, is row ``pos`` of the assignments sorted stably by expert, and row ``slot`` of the zero-padded [E, cap]
    batch (expert e's j-th assignment at e * cap + j, cap = the largest load)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(flat.numel(), device=idx.device))
    cap, starts = max(counts), [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    shift = torch.tensor([e * cap - s0 for e, s0 in enumerate(starts)], device=idx.device)
    return pos, pos + shift.index_select(0, flat)


def moe_route(s: Tensor, bias: Tensor, top_k: int, scale: float, batch: int,
              balance_weight: float) -> tuple[Tensor, Tensor | None, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Route N = batch * T tokens from their fp32 affinities s [N, E]: gates w [N, K], the balance loss (None when
    ``balance_weight`` is 0), choices idx [N, K], per-expert counts [E] and, from the C++ op, the assignment rows
    (pos, slot) (else None: :func:`moe_experts` builds them)."""
    if decode.cpp("moe_route") and balance_weight == 0 and s.shape[0] > 0 and s.dtype is torch.float32:
        w, _, idx, counts, pos, slot, _ = torch.ops.glm_lightning.moe_route(s, bias, top_k, scale, batch, 0.0)
        return w, None, idx, counts, (pos, slot)  # a decode step: the op itself (no loss, no autograd)
    return _moe_route(s, bias, top_k, scale, batch, balance_weight)


@mp.fp32_op
def _moe_route(s: Tensor, bias: Tensor, top_k: int, scale: float, batch: int,
               balance_weight: float) -> tuple[Tensor, Tensor | None, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    N, E = s.shape
    if N > 0 and backend.takes(s, op="moe_route"):
        if backend.needs_grad(s, bias):
            w, aux, idx, counts, *rows = _Routing.apply(s, bias, top_k, scale, batch, balance_weight)
        else:  # decoding: the op itself, no autograd node
            w, aux, idx, counts, *rows, _ = torch.ops.glm_lightning.moe_route(s, bias, top_k, scale, batch,
                                                                              balance_weight)
        return w, aux if balance_weight > 0 else None, idx, counts, tuple(rows)
    idx, w = route_reference(s, _f32(bias), top_k, scale)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    aux = None
    if balance_weight > 0 and N > 0:
        aux = moe_balance_loss(s.view(batch, -1, E), idx.view(batch, -1, top_k), E, balance_weight)
    return w, aux, idx, counts, None


def _segments(tokens: int, assignments: int, cap: int, E: int, dh: int, bf16: bool = False) -> bool:
    """Whether the experts run per segment (thresholds.py): from SEGMENT_TOKENS tokens, when the padded batch is at
    least SEGMENT_PADDING (SEGMENT_PADDING_BF16 for bf16 GEMMs) times the assignments and its padding rows' GEMM
    work (rows x d x h, per expert) reaches SEGMENT_PADDING_WORK, what a segment's extra dispatched ops cost."""
    padding = E * cap - assignments
    ratio = thresholds.SEGMENT_PADDING_BF16 if bf16 else thresholds.SEGMENT_PADDING
    return (tokens >= thresholds.SEGMENT_TOKENS and E * cap >= ratio * assignments
            and padding * dh >= thresholds.SEGMENT_PADDING_WORK * E)


def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor, counts_t: Tensor,
                rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """y_n = sum_k w_nk E_{idx_nk}(x_n) for flat tokens x [N, d], choices idx and gates w [N, K], the experts'
    w_gate_up [E, 2h, d] and w_down [E, d, h], per-expert counts [E] and the assignment rows when the routing gave
    them."""
    if mp.lowp(x, w_gate_up, w_down):  # a GEMM op: bf16 at the boundary (mixed_precision.py)
        x, w_gate_up, w_down = mp.to_bf16(x), mp.to_bf16(w_gate_up), mp.to_bf16(w_down)
    K = idx.shape[-1]
    counts = counts_t.tolist()
    cap = max(counts)
    if cap == 0:  # no tokens at all
        return torch.zeros_like(x)
    pos, slot = assignment_rows(idx, counts) if rows is None else rows  # token n's k-th choice at n * K + k
    if _segments(x.shape[0], pos.numel(), cap, w_gate_up.shape[0], x.shape[-1] * w_down.shape[-1],
                 bf16=x.dtype is torch.bfloat16):
        order = torch.empty_like(pos).index_copy_(0, pos, torch.arange(pos.numel(), device=x.device))
        return _SegmentExperts.apply(x, w, w_gate_up, w_down, order // K, pos, counts)
    if (x.shape[0] <= thresholds.SMALL_TOKENS and not torch.is_grad_enabled()
            and backend.takes(x, w_gate_up, fp64=False)):
        return _experts_small(x, w, w_gate_up, w_down, slot, cap, counts_t)
    return _GroupedExperts.apply(x, w, w_gate_up, w_down, slot, cap)


def moe_decode(x: Tensor, router_weight: Tensor, bias: Tensor, top_k: int, scale: float, w_gate_up: Tensor,
               w_down: Tensor, shared_gate_up: Tensor | None, shared_down: Tensor | None) -> Tensor | None:
    """Inside an fp32 decode step (ops/decode.py) with packed weights: the whole MoE layer without its balance loss,
    y = moe_experts(route(sigmoid(x W_r^T))) + swiglu_mlp(x), for flat tokens x [N, d] as one C++ op
    (csrc/moe_decode.cpp: the kernels of the ops' path in their order, as C++ calls, so the same values bit for bit;
    ~10 dispatched ops and their Python per layer before). None where that path would not take these tensors: the
    caller then runs the ops one by one."""
    if not decode.cpp("moe_decode") or matmul._packs is None:
        return None
    N, f32 = x.shape[0], torch.float32
    if not (0 < N <= thresholds.SMALL_ROWS and N <= thresholds.SMALL_TOKENS and N < thresholds.SEGMENT_TOKENS):
        return None
    if x.dtype is not f32 or router_weight.dtype is not f32 or w_gate_up.dtype is not f32 or w_down.dtype is not f32:
        return None
    shared = shared_gate_up is not None and shared_down is not None
    if shared and (shared_gate_up.dtype is not f32 or shared_down.dtype is not f32):
        return None
    packed = matmul.packed
    return torch.ops.glm_lightning.moe_decode(
        x, packed(router_weight), router_weight.shape[0], bias, top_k, scale, packed(w_gate_up), w_gate_up.shape[1],
        packed(w_down), packed(shared_gate_up) if shared else None, shared_gate_up.shape[0] if shared else 0,
        packed(shared_down) if shared else None)


def swiglu_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """The shared expert W_down (SiLU(W_gate x) * W_up x), its activation one C++ pass each way when built. Without
    autograd, outside a cached decode, for at most SMALL_TOKENS tokens (a prefill of a short prompt): as the routed
    experts run there, two ``small_matmul`` calls, the first applying the SwiGLU to its sums (:func:`_shared_small`)."""
    if _shared_small(x, w_gate_up, w_down):
        x2 = x.reshape(-1, x.shape[-1])
        a = small_matmul(x2, w_gate_up, None, swiglu=True)
        return small_matmul(a, w_down, None).view(*x.shape[:-1], w_down.shape[0])
    hgu = linear(x, w_gate_up)
    return linear(_SwiGLU.apply(hgu) if backend.needs_grad(hgu) else _swiglu_act(hgu), w_down)


def _shared_small(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> bool:
    """Whether the shared expert runs as small_matmul with its SwiGLU fused: fp32 on the CPU without autograd or bf16,
    1 to SMALL_TOKENS tokens, no panel store in force (a decode step's few-row linears run panel_matmul, and its whole
    MoE layer moe_decode), the C++ SwiGLU on (the fused form gives its values bit for bit, so at up to SMALL_ROWS
    tokens, where linear ran small_matmul already, the values are unchanged; above, BLAS's within float rounding).
    flash-25m's 12 shared experts, cold weights, 1 thread, Intel Xeon AVX-512 (issue 49, medians of 11 in turns):
    1.15x at 44 tokens (3.25 -> 2.81 ms), 1.08x at 64, 1.14x at 96 against BLAS mm + SwiGLU + mm."""
    rows = x.numel() // max(1, x.shape[-1])
    return (0 < rows <= thresholds.SMALL_TOKENS and matmul._packs is None and not mp.lowp(x, w_gate_up, w_down)
            and not backend.needs_grad(x, w_gate_up, w_down)
            and backend.takes(x, w_gate_up, w_down, fp64=False, op="swiglu"))
