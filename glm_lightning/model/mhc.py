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

The maps, Sinkhorn and the stream read/write are ops (glm_lightning/model/ops/mhc.py, references in
ops/reference.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from glm_lightning.model import ops


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
        # H_pre = sigmoid + eps, H_post = 2 sigmoid
        self.register_buffer("_alpha_index", torch.tensor([0] * n + [1] * n + [2] * n * n), persistent=False)
        self.register_buffer("_gate_scale", torch.tensor([1.0] * n + [2.0] * n), persistent=False)
        self.register_buffer("_gate_shift", torch.tensor([eps] * n + [0.0] * n), persistent=False)

    def _params(self) -> tuple:
        """The site's parameters and constants, in the ops' order. Read from the module's dicts: six nn.Module
        ``__getattr__`` calls were ~10 us of a ~45 us decode-step site read (Intel Xeon, 1 thread). A parametrized phi
        (an adapter of glm_lightning.lora, which takes 2-D weights) is not in the dict but a property."""
        p, b = self._parameters, self._buffers
        phi = p["phi"] if "phi" in p else self.phi
        return (phi, p["alpha"], p["bias"], b["_alpha_index"], b["_gate_scale"], b["_gate_shift"], self.norm_eps,
                self.iters, self.eps)

    def mappings(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H_pre [B,T,n], H_post [B,T,n], H_res [B,T,n,n] from the streams x [B,T,n,C] (fp32)."""
        return ops.reference.site_mappings(x, *self._params(), sinkhorn=ops.sinkhorn)

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The sub-layer input H_pre x [B,T,C] and the (H_post, H_res, x) that `write` needs (x as the read passes it
        on: in training with the C++ ops an ops.mhc.StreamsLink, through which the write hands its output gradient to
        the read's backward, which forms the write's gradients of H_res and x in its own pass; ops.site_read)."""
        if self.n == 1:
            return x[..., 0, :], None
        h, post, res, xw = ops.site_read(x, *self._params(), streams_out=True, link=True)
        return h, (post, res, xw)

    def write(self, x: torch.Tensor, maps: tuple[torch.Tensor, ...] | None, y: torch.Tensor) -> torch.Tensor:
        """x_next = H_res x + H_post^T y, for the sub-layer output y [B,T,C] and `maps` from `read` (H_post, H_res
        and x as the read passed it on, the same values, which is then the one used; or just (H_post, H_res))."""
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        if maps is None:
            return x + y.unsqueeze(-2)
        post, res, *passed = maps
        return ops.stream_write(res, passed[0] if passed else x, post, y)

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
