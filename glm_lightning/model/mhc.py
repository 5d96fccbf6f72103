"""mHC: manifold-constrained hyper-connections (Xie et al., arXiv 2512.24880, Eq. 7-9 and Table 5).

The residual stream is widened to n parallel streams x in R^{n x C} that persist as [B, T, n, C] across ALL blocks
(expanded once after the embedding, collapsed once before the final norm, see `GLMModel`). Each sub-layer F
(attention or MoE) is wrapped by one `HyperConnection` site:

    x' = RMSNorm(vec(x))                                   unweighted norm of the flattened streams (1 x nC)
    H_pre  = sigmoid(a_pre  * x' phi_pre  + b_pre) + eps    (1 x n)   how much each stream F reads
    H_post = 2 sigmoid(a_post * x' phi_post + b_post)       (1 x n)   how much F writes into each stream
    H_res  = SinkhornKnopp(a_res * mat(x' phi_res) + b_res) (n x n)   doubly stochastic stream mixing
    x_next = H_res x + H_post^T F(H_pre x)

Following the production form (DeepSeek-V4 `HyperConnection`, also mlx-vlm): one fused projection phi of shape
[(2+n)n, nC] split as [pre, post, res]; Sinkhorn starts from a row softmax (+eps), normalises columns, then runs
(iters - 1) row/column rounds with eps in every denominator, all in fp32. We use the paper's convention
x_next_i = sum_j H_res[i, j] x_j.

Symmetry trap: the streams start identical (the embedding repeated n times); if all sites treated the streams
alike they would stay identical forever. We break the symmetry with a random phi (std 0.02, as the HF init) and
a static per-stream post bias rotated by the site index, so each stream receives a different mix of sub-layers.
b_res starts near the identity (diagonal logit `res_diag_init`) so that the untrained network is close to an
ordinary residual network.
With n = 1 the site is exactly a plain pre-norm residual x + F(x) (no parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from glm_lightning.model import cext
from glm_lightning.model.linear import linear


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp of [N, n, n] logits, iterated on the entries-major layout [n(row), n(col), N], with a
    hand-written backward.

    Each half step is m <- m / (sum_dim(m) + eps). Autograd would store every intermediate m and issue ~8 ops per half
    step in backward; here the forward keeps only the 2 * iters - 1 denominators d, and the backward walks the steps in
    reverse, recovering each input from its output (m_in = m_out * d) and applying

        dL/dm_in = (dL/dm_out - sum_dim(dL/dm_out * m_out)) / d

    (the derivative of m_out = m_in / (sum_dim(m_in) + eps)), then the softmax backward of the start. In code the
    walk carries the product dL/dm * m, which turns each step into one sum, one addcmul and one multiply.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
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
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        # Walk back through the half steps carrying P = dL/dm * m instead of dL/dm: with t = sum_dim(P_out),
        # P_in = dL/dm_in * m_in = (dL/dm_out - t) / d * (m_out * d) = P_out - t * m_out, one addcmul per step.
        soft, m, *dens = ctx.saved_tensors
        m = m.clone()
        p = grad.permute(1, 2, 0) * m
        for step in reversed(range(len(dens))):
            dim = 0 if step % 2 == 0 else 1
            p.addcmul_(p.sum(dim=dim, keepdim=True), m, value=-1.0)
            m.mul_(dens[step])  # the input of this step
        # m is now the start softmax + eps: dL/dm_start = P / m, then the softmax backward
        return torch._softmax_backward_data(p.div_(m), soft, 1, soft.dtype).permute(2, 0, 1), None, None


class _SinkhornFused(torch.autograd.Function):
    """The same Sinkhorn as `_Sinkhorn`, as the C++ ops of csrc/sinkhorn.cpp: one op forward, one backward (which
    recomputes the cheap half steps from the saved row softmax instead of saving 2 * iters - 1 denominators)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        out, soft = torch.ops.glm_lightning.sinkhorn(logits, iters, eps)
        ctx.save_for_backward(soft)
        ctx.iters, ctx.eps = iters, eps
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (soft,) = ctx.saved_tensors
        return torch.ops.glm_lightning.sinkhorn_backward(grad, soft, ctx.iters, ctx.eps), None, None


CPP_MAX_STREAMS = 8
"""The C++ Sinkhorn and stream read/write ops' limit (kMaxStreams, csrc/kernel_helpers.h: Sinkhorn is compiled for
each stream count); a site with more streams runs their eager forms."""
SITE_READ_MAX_STREAMS = 6
"""The C++ site read's limit (csrc/site_read.cpp: at most 64 logits, (2 + n) n); more runs the eager mappings."""


def sinkhorn_knopp(logits: torch.Tensor, iters: int = 20, eps: float = 1e-6,
                   fused: bool | None = None) -> torch.Tensor:
    """Project [..., n, n] logits onto (approximately) doubly stochastic matrices, in fp32 (fp64 stays fp64).

    Row softmax (+eps), one column normalisation, then (iters - 1) row/column rounds, eps in every denominator.
    Columns are the last-normalised axis, so column sums are exact to ~1e-6; row sums converge with `iters`.
    The iterations run in an entries-major layout [n, n, N] (N = all leading dims): every row/column sum is then a
    vectorised add over N instead of a reduction over a 4-wide inner axis, 3x faster forward+backward on a CPU.
    `fused` picks the C++ op (True), the eager autograd Function (False), or the C++ op when it is available (None,
    see glm_lightning/model/cext.py); both give the same numbers (tests/test_sinkhorn_fused.py).
    """
    shape = logits.shape
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    flat = logits.reshape(-1, *shape[-2:])
    if fused and not cext.available():
        raise RuntimeError("the C++ Sinkhorn op is not available (see glm_lightning/model/cext.py)")
    if fused and shape[-1] > CPP_MAX_STREAMS:
        raise ValueError(f"the C++ Sinkhorn op takes at most {CPP_MAX_STREAMS} streams, got {shape[-1]}")
    use_fused = ((cext.available() if fused is None else fused) and flat.device.type == "cpu"
                 and shape[-1] <= CPP_MAX_STREAMS)
    return (_SinkhornFused if use_fused else _Sinkhorn).apply(flat, iters, eps).view(shape)


def read_streams(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h = sum_i H_pre[i] x_i: [B,T,n] x [B,T,n,C] -> [B,T,C] (broadcast-sum; einsum/bmm runs N tiny GEMMs)."""
    return (pre.unsqueeze(-1) * x).sum(dim=-2)


class StreamReadFused(torch.autograd.Function):
    """`read_streams` as the C++ ops of csrc/streams.cpp (one op forward, one backward, any leading dims)."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre, x)
        return torch.ops.glm_lightning.stream_read(pre, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.glm_lightning.stream_read_backward(grad, *ctx.saved_tensors)


def _mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token a @ b for a [..., i, j] (tiny) and b [..., j, C] -> [..., i, C].

    A batched matmul with inner dimension j runs one tiny GEMM per token; for j <= 2 streams the j broadcast
    multiply-adds are several times faster (1024 tokens, 2 x 2 @ 2 x 48: 0.16 vs 1.05 ms), for j = 4 they are not.
    """
    j = a.shape[-1]
    if j > 2:
        return torch.matmul(a, b)
    out = a[..., 0:1] * b[..., 0:1, :]
    for i in range(1, j):
        out.addcmul_(a[..., i:i + 1], b[..., i:i + 1, :])
    return out


class StreamWrite(torch.autograd.Function):
    """x_next = H_res x + H_post^T y, per token: [B,T,n,n] x [B,T,n,C] + [B,T,n] x [B,T,C] -> [B,T,n,C].

    Written out because autograd's own backward of a batched [n,n] @ [n,C] matmul transposes an operand into a
    non-contiguous view, which sends PyTorch's CPU bmm to a per-token loop of tiny GEMMs (8x slower than this, and
    the single biggest item in a profiled training step). Every product here keeps contiguous operands.
    """

    @staticmethod
    def forward(ctx, res: torch.Tensor, x: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(res, x, post, y)
        return _mix(res, x).addcmul_(post.unsqueeze(-1), y.unsqueeze(-2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        res, x, post, y = ctx.saved_tensors
        grad = grad.contiguous()
        grad_res = torch.matmul(grad, x.transpose(-1, -2))                 # [n,C] @ [C,n]
        grad_x = _mix(res.transpose(-1, -2).contiguous(), grad)             # [n,n] @ [n,C]
        grad_post = torch.matmul(grad, y.unsqueeze(-1)).squeeze(-1)        # [n,C] @ [C,1]
        grad_y = read_streams(post, grad)                                   # [1,n] @ [n,C]
        return grad_res, grad_x, grad_post, grad_y


class StreamWriteFused(torch.autograd.Function):
    """`StreamWrite` as the C++ ops of csrc/streams.cpp: one op forward, one backward, no per-token tiny GEMMs."""

    @staticmethod
    def forward(ctx, res: torch.Tensor, x: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(res, x, post, y)
        return torch.ops.glm_lightning.stream_write(res, x, post, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.glm_lightning.stream_write_backward(grad, *ctx.saved_tensors)


class SiteReadFused(torch.autograd.Function):
    """The whole read half of a site as one Function on the C++ ops: streams x [N, n, C] -> (h [N, C], H_post [N, n],
    H_res [N, n, n]), with a hand-written backward.

    Same math as `HyperConnection.mappings` + `StreamReadFused`, but autograd records one node instead of ~20 (norm,
    projection, addcmuls, alpha gather, sigmoid, slices, Sinkhorn, read), and ``glm_lightning::site_read`` (csrc/
    site_read.cpp) does the norm, the projection, the gates and the read in one pass over the streams (its backward
    likewise: counted in the eager code, they were read ~3 times forward and ~10 times backward). With
    z = (x phi^T) * inv_rms and logits = bias + alpha z:
        dlogits = [dgates * scale * sig (1 - sig) | SinkhornBackward(dres)],  dbias = sum dlogits,
        dalpha = segment sums of dlogits * z,  draw = dlogits * alpha * inv_rms,  dphi = draw^T x,
        dx = draw phi - x * inv_rms^3 / (nC) * rowsum(dlogits * alpha * raw) + ReadBackward(dh).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,  # type: ignore[override]
                site: HyperConnection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[1]
        x = x if x.is_contiguous() else x.contiguous()
        alpha_e = alpha.index_select(0, site._alpha_index)
        h, gates, res_logits, inv_rms, raw, sig = torch.ops.glm_lightning.site_read(
            x, phi, alpha_e, bias, site._gate_scale, site._gate_shift, site.norm_eps)
        res, res_soft = torch.ops.glm_lightning.sinkhorn(res_logits, site.iters, site.eps)
        ctx.save_for_backward(x, phi, alpha_e, inv_rms, raw, sig, gates, res_soft)
        ctx.site = site
        return h, gates[:, n:], res

    @staticmethod
    def backward(ctx, dh: torch.Tensor, dpost: torch.Tensor, dres: torch.Tensor):  # type: ignore[override]
        x, phi, alpha_e, inv_rms, raw, sig, gates, res_soft = ctx.saved_tensors
        site = ctx.site
        dres_logits = torch.ops.glm_lightning.sinkhorn_backward(dres, res_soft, site.iters, site.eps)
        dx, dphi, dbias, dalpha_l = torch.ops.glm_lightning.site_read_backward(
            dh, dpost, dres_logits, x, phi, alpha_e, site._gate_scale, inv_rms, raw, sig, gates)
        dalpha = torch.zeros_like(site.alpha).index_add_(0, site._alpha_index, dalpha_l)
        return dx, dphi, dalpha, dbias, None


class HyperConnection(nn.Module):
    """One mHC site around a sub-layer: streams [B, T, n, C] -> streams [B, T, n, C]."""

    res_diag_init: float = 4.0

    def __init__(self, n: int, dim: int, iters: int = 20, eps: float = 1e-6, alpha_init: float = 0.01,
                 norm_eps: float = 1e-5, site_index: int = 0) -> None:
        super().__init__()
        self.n, self.dim, self.iters, self.eps, self.norm_eps = n, dim, iters, eps, norm_eps
        if n == 1:
            return
        self.phi = nn.Parameter(torch.randn((2 + n) * n, n * dim) * 0.02)
        self.alpha = nn.Parameter(torch.full((3,), alpha_init))
        b_pre = torch.zeros(n)
        b_post = torch.linspace(0.5, -0.5, n).roll(site_index % n)
        b_res = torch.full((n, n), 0.0) + self.res_diag_init * torch.eye(n)
        self.bias = nn.Parameter(torch.cat([b_pre, b_post, b_res.flatten()]))
        # alpha index of every logit ([pre] * n, [post] * n, [res] * n^2), and the affine map after the sigmoid:
        # H_pre = sigmoid + eps, H_post = 2 sigmoid (one addcmul for both)
        self.register_buffer("_alpha_index", torch.tensor([0] * n + [1] * n + [2] * n * n), persistent=False)
        self.register_buffer("_gate_scale", torch.tensor([1.0] * n + [2.0] * n), persistent=False)
        self.register_buffer("_gate_shift", torch.tensor([eps] * n + [0.0] * n), persistent=False)
        self.register_buffer("_norm_eps", torch.tensor(norm_eps), persistent=False)

    def mappings(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H_pre [B,T,n], H_post [B,T,n], H_res [B,T,n,n] from the streams x [B,T,n,C] (fp32)."""
        n = self.n
        flat = x.flatten(-2)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        # RMSNorm(flat) @ phi^T == (flat @ phi^T) * rsqrt(mean(flat^2) + eps): the norm has no weight, so it is
        # applied to the 24 projected values instead of the n*C inputs (no normalised copy, cheaper backward).
        # mean(flat^2) comes from one vector_norm (a fused kernel and backward; square() would be a pow).
        norm = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
        inv_rms = torch.rsqrt(torch.addcmul(self._norm_eps, norm, norm, value=1.0 / (n * self.dim)))
        raw = linear(flat, self.phi if self.phi.dtype == flat.dtype else self.phi.to(flat.dtype))
        logits = torch.addcmul(self.bias, raw * inv_rms, self.alpha[self._alpha_index])
        gates = torch.addcmul(self._gate_shift, torch.sigmoid(logits[..., :2 * n]), self._gate_scale)
        pre, post = gates.split([n, n], dim=-1)
        res = sinkhorn_knopp(logits[..., 2 * n:].unflatten(-1, (n, n)), self.iters, self.eps)
        return pre, post, res

    def _stream_ops(self, x: torch.Tensor) -> bool:
        """Whether the stream read / write run as the C++ ops of csrc/streams.cpp (at most CPP_MAX_STREAMS streams)."""
        return self.n <= CPP_MAX_STREAMS and cext.takes(x)

    def _fused_read(self, x: torch.Tensor) -> bool:
        """Whether `read` runs as one `SiteReadFused` (C++ ops built, fp32/fp64 on CPU) instead of `mappings` + read."""
        return self.n <= SITE_READ_MAX_STREAMS and cext.takes(x, self.phi)

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The sub-layer input H_pre x [B,T,C] and the (H_post, H_res) that `write` needs."""
        if self.n == 1:
            return x[..., 0, :], None
        if self._fused_read(x):
            lead = x.shape[:-2]
            h, post, res = SiteReadFused.apply(x.reshape(-1, self.n, self.dim), self.phi, self.alpha, self.bias, self)
            return h.view(*lead, self.dim), (post.view(*lead, self.n), res.view(*lead, self.n, self.n))
        pre, post, res = (m if m.dtype == x.dtype else m.to(x.dtype) for m in self.mappings(x))
        return (StreamReadFused.apply(pre, x) if self._stream_ops(x) else read_streams(pre, x)), (post, res)

    def write(self, x: torch.Tensor, maps: tuple[torch.Tensor, torch.Tensor] | None, y: torch.Tensor) -> torch.Tensor:
        """x_next = H_res x + H_post^T y, for the sub-layer output y [B,T,C] and `maps` from `read`."""
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        if maps is None:
            return x + y.unsqueeze(-2)
        post, res = maps
        return (StreamWriteFused if self._stream_ops(x) else StreamWrite).apply(res, x, post, y)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x_next for the sub-layer F = `sublayer` (read, F, write in one call)."""
        h, maps = self.read(x)
        return self.write(x, maps, sublayer(h))

    def extra_repr(self) -> str:
        return f"streams={self.n}, dim={self.dim}, sinkhorn_iters={self.iters}"


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, C] -> [B, T, n, C]: the embedding repeated into n streams (done once, after the embedding)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def collapse_streams(x: torch.Tensor) -> torch.Tensor:
    """[B, T, n, C] -> [B, T, C]: the stream mean (GLM-5.3 readout), done once before the final norm."""
    return x.mean(dim=-2)
