"""Dense baseline for the training benchmark: plain pre-norm transformer with causal SDPA attention and a SwiGLU
MLP, same width and depth as the hybrid, the MLP sized so the total parameter count equals the hybrid's ACTIVE count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_lightning.model import GLMConfig
from glm_lightning.model.norm import RMSNorm


class DenseBlock(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class DenseLM(nn.Module):
    def __init__(self, cfg: GLMConfig, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(DenseBlock(cfg.d_model, cfg.n_heads, cfg.head_dim, hidden)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.norm(x), self.embed.weight)


def dense_matching_active(cfg: GLMConfig, active_params: int) -> DenseLM:
    """A DenseLM whose parameter count is as close as possible to `active_params`."""
    d, layers = cfg.d_model, cfg.n_layers
    fixed = cfg.vocab_size * d + d + layers * (2 * d + 4 * d * cfg.n_heads * cfg.head_dim)
    hidden = max(1, round((active_params - fixed) / (3 * d * layers)))
    return DenseLM(cfg, hidden)
