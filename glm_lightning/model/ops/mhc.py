"""mHC's ops (references: ``reference.sinkhorn_knopp``, ``reference.stream_read``, ``reference.stream_write``,
``reference.site_read``): Sinkhorn-Knopp, the stream read and write, and the whole read half of a site.

Why C++ (csrc/sinkhorn.cpp, streams.cpp, site_read.cpp): as eager PyTorch a site's Sinkhorn issues ~270 dispatched ops
(20 iterations), its stream read/write ~70; as C++ ops each is one op forward and one backward. The site read does the
norm, the projection, the gates and the read in one pass over the streams (counted in the eager code, they were read ~3
times forward and ~10 times backward). In training the site's write is linked to its read (:class:`StreamsLink`): the
write's backward makes only d H_post and d y, and the read's backward forms the write's gradients of H_res and of the
streams from the write's output gradient in its own pass (a site's backward 1.12x, bit for bit the same gradients:
``python -m benchmarks.bench_mhc_ops --linked``).

Kept PyTorch twin with a hand-written backward: :class:`_Sinkhorn` (what runs beside the site read for more streams
than the C++ ops take, or without them; autograd over the iterations stores every intermediate and issued ~8 ops per
half step backward): its reference form with autograd made a training step with the C++ ops off 1.41x and 1.43x
slower on the study model and 1.12x on flash-25m (``python -m benchmarks.bench_twins``, median of alternated rounds,
a no-swap control read 0.95x-1.04x). The stream write's twin (a hand-written backward that avoided a strided bmm) went:
its reference form measured 1.09x, 1.01x (study) and 1.03x (flash-25m), within that noise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_lightning.model.ops import backend, decode, mixed_precision as mp, thresholds
from glm_lightning.model.ops.reference import site_mappings, stream_read as stream_read_reference
from glm_lightning.model.ops.reference import stream_write as stream_write_reference


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp of [N, n, n] logits on the entries-major layout [n(row), n(col), N], with a hand-written
    backward: the forward keeps only the 2 * iters - 1 denominators d; the backward walks the half steps in reverse,
    recovering each input from its output (m_in = m_out * d) and carrying P = dL/dm * m, so that each step is
    P_in = P_out - sum_dim(P_out) * m_out (one sum, one addcmul), then the softmax backward of the start."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int, eps: float) -> Tensor:  # type: ignore[override]
        soft = torch.softmax(logits.permute(1, 2, 0), dim=1).contiguous()  # [n(row), n(col), N]
        eps_t = logits.new_full((), eps)  # a tensor: a Python scalar would be wrapped into one on every add
        m = soft + eps_t
        dens = []
        for step in range(2 * iters - 1):  # column first, then (iters - 1) row/column rounds
            dim = 0 if step % 2 == 0 else 1
            d = m.sum(dim=dim, keepdim=True).add_(eps_t)
            m.div_(d)
            dens.append(d)
        ctx.save_for_backward(soft, m, *dens)
        return m.permute(2, 0, 1).contiguous()  # a strided res would send bmm to its slow path

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        soft, m, *dens = ctx.saved_tensors
        m = m.clone()
        p = grad.permute(1, 2, 0) * m
        for step in reversed(range(len(dens))):
            dim = 0 if step % 2 == 0 else 1
            p.addcmul_(p.sum(dim=dim, keepdim=True), m, value=-1.0)
            m.mul_(dens[step])  # the input of this step
        # m is now the start softmax + eps: dL/dm_start = P / m, then the softmax backward
        return torch._softmax_backward_data(p.div_(m), soft, 1, soft.dtype).permute(2, 0, 1), None, None


class _SinkhornCpp(torch.autograd.Function):
    """:class:`_Sinkhorn` as the C++ ops: one op forward, one backward (which recomputes the cheap half steps from the
    saved row softmax instead of saving 2 * iters - 1 denominators)."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int, eps: float) -> Tensor:  # type: ignore[override]
        out, soft = torch.ops.glm_lightning.sinkhorn(logits, iters, eps)
        ctx.save_for_backward(soft)
        ctx.iters, ctx.eps = iters, eps
        return out

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        (soft,) = ctx.saved_tensors
        return torch.ops.glm_lightning.sinkhorn_backward(grad, soft, ctx.iters, ctx.eps), None, None


@mp.fp32_op
def sinkhorn(logits: Tensor, iters: int = 20, eps: float = 1e-6) -> Tensor:
    """Project [..., n, n] logits onto (approximately) doubly stochastic matrices, in fp32 (fp64 stays fp64): row
    softmax (+eps), one column normalisation, then (iters - 1) row/column rounds, eps in every denominator."""
    shape = logits.shape
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    flat = logits.reshape(-1, *shape[-2:])
    cpp = shape[-1] <= thresholds.CPP_MAX_STREAMS and backend.takes(flat, op="sinkhorn")
    return (_SinkhornCpp if cpp else _Sinkhorn).apply(flat, iters, eps).view(shape)


class _StreamReadCpp(torch.autograd.Function):
    """h = sum_i H_pre[i] x_i as the C++ ops of csrc/streams.cpp (any leading dims)."""

    @staticmethod
    def forward(ctx, pre: Tensor, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(pre, x)
        return torch.ops.glm_lightning.stream_read(pre, x)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return torch.ops.glm_lightning.stream_read_backward(grad, *ctx.saved_tensors)


@mp.fp32_op
def stream_read(pre: Tensor, x: Tensor) -> Tensor:
    """h = sum_i H_pre[i] x_i: [..., n] x [..., n, C] -> [..., C]."""
    if x.shape[-2] <= thresholds.CPP_MAX_STREAMS and backend.takes(x, op="stream_read"):
        return _StreamReadCpp.apply(pre, x)
    return stream_read_reference(pre, x)


class _StreamWriteCpp(torch.autograd.Function):
    """x_next = H_res x + H_post^T y as the C++ ops of csrc/streams.cpp: one op forward, one backward."""

    @staticmethod
    def forward(ctx, res: Tensor, x: Tensor, post: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(res, x, post, y)
        return torch.ops.glm_lightning.stream_write(res, x, post, y)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return torch.ops.glm_lightning.stream_write_backward(grad, *ctx.saved_tensors)


class StreamsLink:
    """The streams x as a linked site read passes them on to its write (``site_read(..., link=True)``): the write
    (:func:`stream_write` given this instead of x) then returns its output gradient g itself as the gradient of this
    x, and none for H_res; the read's backward forms the write's gradients of H_res (g x^T) and of the streams (H_res^T
    g) from g in its own pass over x (``site_read_backward_linked``). Why: the write's backward no longer reads x nor
    writes an [N, n, C] gradient that the read's backward reads back (two of its three [N, n, C] passes).

    Not a tensor, so that it cannot reach anything but the write by mistake; one write per link."""

    __slots__ = ("x", "_taken")

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self._taken = False

    def take(self) -> Tensor:
        """x, for the one write of this link."""
        if self._taken:
            raise RuntimeError("a linked site read's streams go to one write only")
        self._taken = True
        return self.x


class _StreamWriteLinked(torch.autograd.Function):
    """x_next = H_res x + H_post^T y for the x of a :class:`StreamsLink`: the forward is the stream write's op; the
    backward computes only d H_post and d y, and passes g on as the gradient of the link's x (see StreamsLink)."""

    @staticmethod
    def forward(ctx, res: Tensor, x: Tensor, post: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(post, y)
        return torch.ops.glm_lightning.stream_write(res, x, post, y)

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        post, y = ctx.saved_tensors
        dpost, dy = torch.ops.glm_lightning.stream_write_backward_linked(grad, post, y)
        return None, grad, dpost, dy


def stream_write(res: Tensor, x: Tensor | StreamsLink, post: Tensor, y: Tensor) -> Tensor:
    """x_next = H_res x + H_post^T y: [..., n, n], [..., n, C], [..., n], [..., C] -> [..., n, C]; x may be the
    :class:`StreamsLink` of a linked site read."""
    if isinstance(x, StreamsLink):
        return _stream_write_linked(res, x.take(), post, y)
    if decode.cpp("stream_write") and x.dtype is torch.float32 and x.shape[-2] <= thresholds.CPP_MAX_STREAMS:
        return torch.ops.glm_lightning.stream_write(res, x, post, y)  # a decode step (its tensors all fp32)
    return _stream_write(res, x, post, y)


@mp.fp32_op
def _stream_write(res: Tensor, x: Tensor, post: Tensor, y: Tensor) -> Tensor:
    if x.shape[-2] <= thresholds.CPP_MAX_STREAMS and backend.takes(x, op="stream_write"):
        if not backend.needs_grad(res, x, post, y):  # decoding: the op itself, no autograd node
            return torch.ops.glm_lightning.stream_write(res, x, post, y)
        return _StreamWriteCpp.apply(res, x, post, y)
    return stream_write_reference(res, x, post, y)


@mp.fp32_op
def _stream_write_linked(res: Tensor, x: Tensor, post: Tensor, y: Tensor) -> Tensor:
    return _StreamWriteLinked.apply(res, x, post, y)


def _site_read_no_grad(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, alpha_index: Tensor, gate_scale: Tensor,
                       gate_shift: Tensor, norm_eps: float, iters: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`_SiteReadCpp`'s forward without autograd (decoding) for x [..., n, C]: site read and Sinkhorn as one op
    (``site_read_decode``: the same values, no node, nothing saved, only the three outputs made, already shaped)."""
    dt = x.dtype
    alpha, bias, gate_scale, gate_shift = (t if t.dtype == dt else t.to(dt) for t in (alpha, bias, gate_scale,
                                                                                       gate_shift))
    return torch.ops.glm_lightning.site_read_decode(x if x.is_contiguous() else x.contiguous(), phi, alpha,
                                                     alpha_index, bias, gate_scale, gate_shift, norm_eps, iters, eps)


class _SiteReadCpp(torch.autograd.Function):
    """The read half of a site on the C++ ops: streams x [N, n, C] -> (h [N, C], H_post [N, n], H_res [N, n, n], x).

    The last output is x itself (a view), for the site's write to take instead of x: the write's gradient of the
    streams then arrives here as that output's gradient and the C++ backward adds it to its own dx while each block is
    in cache (``dx_acc``), where autograd would add the two [N, n, C] gradients in a separate pass.

    Autograd records one node instead of ~20. With z = (x phi^T) * inv_rms and logits = bias + alpha z:
        dlogits = [dgates * scale * sig (1 - sig) | SinkhornBackward(dres)],  dbias = sum dlogits,
        dalpha = segment sums of dlogits * z,  draw = dlogits * alpha * inv_rms,  dphi = draw^T x,
        dx = draw phi - x * inv_rms^3 / (nC) * rowsum(dlogits * alpha * raw) + ReadBackward(dh).
    """

    @staticmethod
    def forward(ctx, x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, alpha_index: Tensor,  # type: ignore[override]
                gate_scale: Tensor, gate_shift: Tensor, norm_eps: float, iters: int, eps: float,
                linked: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n = x.shape[1]
        x = x if x.is_contiguous() else x.contiguous()
        alpha_e = alpha.index_select(0, alpha_index)
        h, gates, res_logits, inv_rms, raw, sig = torch.ops.glm_lightning.site_read(
            x, phi, alpha_e, bias, gate_scale, gate_shift, norm_eps)
        res, res_soft = torch.ops.glm_lightning.sinkhorn(res_logits, iters, eps)
        saved = (x, phi, alpha, alpha_e, alpha_index, gate_scale, inv_rms, raw, sig, gates, res_soft)
        ctx.save_for_backward(*saved, res) if linked else ctx.save_for_backward(*saved)
        ctx.iters, ctx.eps, ctx.linked = iters, eps, linked
        ctx.set_materialize_grads(False)  # no [N, n, C] of zeros for an x that no write took
        return h, gates[:, n:], res, x

    @staticmethod
    @mp.autocast_off_backward
    def backward(ctx, dh: Tensor, dpost: Tensor, dres: Tensor, dx_write: Tensor | None):  # type: ignore[override]
        x, phi, alpha, alpha_e, alpha_index, gate_scale, inv_rms, raw, sig, gates, res_soft, *res = ctx.saved_tensors
        N, n, C = x.shape
        dh, dpost = (x.new_zeros(shape) if g is None else g for g, shape in ((dh, (N, C)), (dpost, (N, n))))
        if ctx.linked:  # dx_write is the linked write's output gradient (StreamsLink)
            dx, dphi, dbias, dalpha_l = torch.ops.glm_lightning.site_read_backward_linked(
                dh, dpost, dres, dx_write, res[0], res_soft, ctx.iters, ctx.eps, x, phi, alpha_e, gate_scale,
                inv_rms, raw, sig, gates)
        else:
            dres = x.new_zeros(N, n, n) if dres is None else dres
            dres_logits = torch.ops.glm_lightning.sinkhorn_backward(dres, res_soft, ctx.iters, ctx.eps)
            dx, dphi, dbias, dalpha_l = torch.ops.glm_lightning.site_read_backward(
                dh, dpost, dres_logits, x, phi, alpha_e, gate_scale, inv_rms, raw, sig, gates, dx_write)
        dalpha = torch.zeros_like(alpha).index_add_(0, alpha_index, dalpha_l)
        return dx, dphi, dalpha, dbias, None, None, None, None, None, None, None


LINK_WRITES = True
"""Whether ``site_read(..., link=True)`` links the read to its write (:class:`StreamsLink`) where it can; off, the
write takes the plain x view (benchmarks/bench_mhc_ops.py compares the two)."""


def site_read(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, alpha_index: Tensor, gate_scale: Tensor,
              gate_shift: Tensor, norm_eps: float, iters: int, eps: float, streams_out: bool = False,
              link: bool = False) -> tuple:
    """The read half of an mHC site: streams x [..., n, C] -> (h = H_pre x [..., C], H_post [..., n],
    H_res [..., n, n]) in x's dtype; the parameters as :class:`glm_lightning.model.mhc.HyperConnection` holds them.
    With ``streams_out`` also x as the site's write should take it (:class:`_SiteReadCpp`: a view through which the
    write's gradient of the streams joins the read's in one pass; else x itself); with ``link`` too, a
    :class:`StreamsLink` where the C++ ops run both halves with autograd (for the one :func:`stream_write` of the
    site), else the same as without."""
    if (decode.cpp("site_read") and x.dtype is torch.float32 and phi.dtype is torch.float32
            and x.shape[-2] <= thresholds.SITE_READ_MAX_STREAMS and x.is_contiguous()):  # a decode step: the op itself
        out = torch.ops.glm_lightning.site_read_decode(x, phi, alpha, alpha_index, bias, gate_scale, gate_shift,
                                                        norm_eps, iters, eps)
        return (*out, x) if streams_out else out
    out = _site_read(x, phi, alpha, bias, alpha_index, gate_scale, gate_shift, norm_eps, iters, eps,
                     streams_out and link and LINK_WRITES)
    return out if streams_out else out[:3]


@mp.fp32_op
def _site_read(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, alpha_index: Tensor, gate_scale: Tensor,
               gate_shift: Tensor, norm_eps: float, iters: int, eps: float, link: bool = False
               ) -> tuple[Tensor, Tensor, Tensor, Tensor | StreamsLink]:
    lead, (n, C) = x.shape[:-2], x.shape[-2:]
    if n <= thresholds.SITE_READ_MAX_STREAMS and backend.takes(x, phi, op="site_read"):
        if not backend.needs_grad(x, phi, alpha, bias):  # decoding: one op, shaped outputs, no node
            return (*_site_read_no_grad(x, phi, alpha, bias, alpha_index, gate_scale, gate_shift, norm_eps, iters,
                                        eps), x)
        # linked only where the write runs its C++ op (it takes x as the read passes it on, fp32 or fp64 alike)
        link = link and n <= thresholds.CPP_MAX_STREAMS and backend.takes(x, op="stream_write")
        h, post, res, xw = _SiteReadCpp.apply(x.reshape(-1, n, C), phi, alpha, bias, alpha_index, gate_scale,
                                              gate_shift, norm_eps, iters, eps, link)
        xw = xw.view(x.shape)
        return (h.view(*lead, C), post.view(*lead, n), res.view(*lead, n, n), StreamsLink(xw) if link else xw)
    pre, post, res = (m if m.dtype == x.dtype else m.to(x.dtype) for m in site_mappings(
        x, phi, alpha, bias, alpha_index, gate_scale, gate_shift, norm_eps, iters, eps, sinkhorn))
    return stream_read(pre, x), post, res, x
