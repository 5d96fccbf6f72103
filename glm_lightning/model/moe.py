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

The routing and the experts are ops (glm_lightning/model/ops/moe.py: a grouped GEMM over the assignments sorted by
expert, no capacity limit, no dropped tokens); their references, token by token, are in ops/reference.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from glm_lightning.model import ops
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.ops import linear


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

    def forward(self, x: Tensor, want_aux: bool = True) -> tuple[Tensor, Tensor]:
        """``x`` [B, T, d] -> (``y`` [B, T, d], scalar fp32 balance loss; 0 if its weight is 0, no tokens, or not
        ``want_aux``: decoding with a cache skips it, ~29 dispatched ops per layer and token that nothing reads)."""
        B, T, d = x.shape
        xf = x.reshape(B * T, d)
        if not want_aux:  # a decode step: the whole layer as one op where it takes the tensors
            y = ops.moe_decode(xf, self.router_weight, self.expert_bias, self.top_k, self.routed_scaling,
                               self.w_gate_up, self.w_down, self.shared_gate_up, self.shared_down)
            if y is not None:
                return y.view(B, T, d), self._no_aux
        weight = self.balance_loss_weight if want_aux and B * T > 0 else 0.0
        w, aux, idx, counts, rows = ops.moe_route(self._scores(xf), self.expert_bias, self.top_k, self.routed_scaling,
                                                  B, weight)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.load_counts += counts.to(self.load_counts.dtype)
        y = ops.moe_experts(xf, idx, w, self.w_gate_up, self.w_down, counts, rows)
        if self.shared_gate_up is not None:
            y = y + ops.swiglu_mlp(xf, self.shared_gate_up, self.shared_down)
        return y.view(B, T, d), self._no_aux if aux is None else aux

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens ``x`` [..., d]: returns fp32 scores ``s`` [..., E], expert ids ``idx`` [..., K] and fp32 gate
        weights ``w`` [..., K] (unbiased ``s`` of the chosen experts, renormalised when K > 1, times the scaling)."""
        s = self._scores(x)
        return (s, *ops.reference.moe_route(s, _f32(self.expert_bias), self.top_k, self.routed_scaling))

    def _scores(self, x: Tensor) -> Tensor:
        """The router's fp32 affinities s = sigmoid(x W_r^T) [..., E]."""
        return torch.sigmoid(linear(x, self.router_weight, fp32=True))

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


def _f32(t: Tensor) -> Tensor:
    """t in fp32 (``t.float()`` without the no-op op call when it already is)."""
    return t if t.dtype == torch.float32 else t.float()
