"""The dense feed-forward sub-layer of the MoE ablation (``ffn: dense``): one SwiGLU MLP with as many ACTIVE
parameters per token as the MoE it replaces,

    y = W_down (SiLU(W_gate x) * W_up x),      hidden = shared_expert_hidden + moe_top_k * expert_hidden

(the shared expert plus the top-k routed experts a token sees; the MoE's router, d x E weights, is not matched).
It takes the MoE's place in a block, with the MoE's call contract, and has no auxiliary loss.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm_lightning.model import ops
from glm_lightning.model.config import GLMConfig


def dense_hidden(cfg: GLMConfig) -> int:
    """The hidden width of equal active parameters: the shared expert's plus moe_top_k routed experts'."""
    return cfg.shared_expert_hidden + cfg.moe_top_k * cfg.expert_hidden


class DenseSwiGLU(nn.Module):
    """SwiGLU MLP [B, T, d] -> [B, T, d]; parameters ``w_gate_up`` [2h, d] (gate rows first) and ``w_down`` [d, h]."""

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        d, h = cfg.d_model, dense_hidden(cfg)
        self.hidden = h
        self.w_gate_up = nn.Parameter(torch.empty(2 * h, d).normal_(0.0, cfg.init_std))
        self.w_down = nn.Parameter(torch.empty(d, h).normal_(0.0, cfg.init_std))
        self.register_buffer("_no_aux", torch.zeros(()), persistent=False)

    def forward(self, x: Tensor, want_aux: bool = True) -> tuple[Tensor, Tensor]:
        """``x`` [B, T, d] -> (``y`` [B, T, d], a zero scalar: no balance loss; ``want_aux`` as MoE's, unused)."""
        B, T, d = x.shape
        return ops.swiglu_mlp(x.reshape(B * T, d), self.w_gate_up, self.w_down).view(B, T, d), self._no_aux

    def extra_repr(self) -> str:
        return f"d_model={self.w_down.shape[0]}, hidden={self.hidden}"
