"""The reference form of every op: plain PyTorch that follows the papers' equations, differentiated by autograd.

These are the model's definitions. The fast forms in the other files of this folder (C++ ops, hand-written backward
passes, fewer dispatched ops) compute the same values within float rounding, and the tests compare each of them with
the function here that it implements. Nothing here is tuned; read it to learn what the model computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

def _fp32(t: Tensor) -> Tensor:
    """t in fp32; fp64 stays fp64."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# --- norms -----------------------------------------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm (Zhang & Sennrich 2019): y = w * x / sqrt(mean(x^2) + eps) over the last dim, in fp32."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight).to(x.dtype)


def gated_head_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA's output norm: RMSNorm_head(o) * w * sigmoid(gate); o [B, T, H, K], gate [B, T, H*K] -> [B, T, H*K]."""
    B, T, H, K = o.shape
    return (rms_norm(o, weight, eps) * torch.sigmoid(gate.view(B, T, H, K))).reshape(B, T, H * K)


# --- linear ----------------------------------------------------------------------------------------------------------


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x W^T + b."""
    return F.linear(x, weight, bias)


# --- mHC (Xie et al., arXiv 2512.24880) -----------------------------------------------------------------------------


def sinkhorn_knopp(logits: Tensor, iters: int = 20, eps: float = 1e-6) -> Tensor:
    """[..., n, n] logits -> (approximately) doubly stochastic: row softmax + eps, one column normalisation, then
    (iters - 1) row/column rounds, eps in every denominator (fp32; fp64 stays fp64)."""
    m = torch.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def stream_read(pre: Tensor, x: Tensor) -> Tensor:
    """h = sum_i H_pre[i] x_i: [..., n] x [..., n, C] -> [..., C]."""
    return (pre.unsqueeze(-1) * x).sum(dim=-2)


def stream_write(res: Tensor, x: Tensor, post: Tensor, y: Tensor) -> Tensor:
    """x_next = H_res x + H_post^T y: [..., n, n], [..., n, C], [..., n], [..., C] -> [..., n, C]."""
    return torch.matmul(res, x) + post.unsqueeze(-1) * y.unsqueeze(-2)


def site_mappings(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, alpha_index: Tensor, gate_scale: Tensor,
                  gate_shift: Tensor, norm_eps: float, iters: int, eps: float,
                  sinkhorn=sinkhorn_knopp) -> tuple[Tensor, Tensor, Tensor]:
    """H_pre [..., n], H_post [..., n], H_res [..., n, n] of an mHC site from its streams x [..., n, C] (fp32):

        x' = RMSNorm(vec(x)),  logits = alpha * (x' phi^T) + b  (alpha per block: pre, post, res),
        H_pre = sigmoid(logits_pre) + eps,  H_post = 2 sigmoid(logits_post),  H_res = Sinkhorn(mat(logits_res)).

    ``alpha_index`` names the alpha of every logit, ``gate_scale`` / ``gate_shift`` hold (1, 2) / (eps, 0) per gate.
    The unweighted norm is applied after the projection (the same value, on (2 + n) n numbers instead of n C)."""
    n = x.shape[-2]
    flat = x.flatten(-2)
    flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    norm = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    inv_rms = torch.rsqrt(norm * norm / flat.shape[-1] + norm_eps)
    raw = F.linear(flat, phi if phi.dtype == flat.dtype else phi.to(flat.dtype))
    logits = bias + raw * inv_rms * alpha[alpha_index]
    gates = torch.sigmoid(logits[..., :2 * n]) * gate_scale + gate_shift
    pre, post = gates.split([n, n], dim=-1)
    return pre, post, sinkhorn(logits[..., 2 * n:].unflatten(-1, (n, n)), iters, eps)


# --- KDA (Kimi Linear, arXiv 2510.26692) ----------------------------------------------------------------------------


def short_conv(raw: Tensor, weight: Tensor, context: Tensor | None = None) -> Tensor:
    """SiLU(causal depthwise conv) over time: raw [B, T, C], weight [C, 1, ks], context [B, ks-1, C] the inputs
    before raw (zeros if None) -> [B, T, C]."""
    ks = weight.shape[-1]
    x = raw.transpose(1, 2)
    x = F.pad(x, (ks - 1, 0)) if context is None else torch.cat([context.to(raw.dtype).transpose(1, 2), x], -1)
    return F.silu(F.conv1d(x, weight, groups=weight.shape[0])).transpose(1, 2)


def kda_features(y: Tensor, f: Tensor, b: Tensor, A_log: Tensor, rescale: Tensor,
                 lb: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """From the short conv's output y = [q | k | v] [B, T, 3HK], the gate input f [B, T, HK] and b [B, T, H]:
    q / (|q| sqrt(K)), k / |k| (L2 eps 1e-6; ``rescale`` [2H, 1] holds sqrt(K) for q heads and 1 for k heads), v,
    the safe gate g = lb * sigmoid(exp(A_log) * f) [B, T, H, K] and beta = sigmoid(b) [B, T, H]."""
    B, T, _ = y.shape
    H = A_log.shape[0]
    K = f.shape[-1] // H
    qk = y[..., :2 * H * K].reshape(B, T, 2 * H, K)
    q, k = (qk / (torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-6) * rescale)).split(H, dim=2)
    v = y[..., 2 * H * K:].reshape(B, T, H, K)
    g = lb * torch.sigmoid(A_log.exp().view(H, 1) * f.view(B, T, H, K))
    return q, k, v, g, torch.sigmoid(b)


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule with a per-key-channel decay, token by token:

        S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

    q, k, g [B, T, H, K] (g the log decay, <= 0; q already scaled by K^-0.5), v [B, T, H, V], beta [B, T, H],
    initial_state [B, H, K, V] -> o [B, T, H, V] and the final state, fp32 (fp64 if any input is fp64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ins = (q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    dt = torch.float64 if any(x.dtype == torch.float64 for x in ins) else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    decay = g.exp()
    outs = []
    for t in range(T):
        kt = k[:, t]                                                   # [B, H, K]
        S = S * decay[:, t].unsqueeze(-1)                              # Diag(exp g_t) S
        e = v[:, t] - (kt.unsqueeze(-2) @ S).squeeze(-2)               # v_t - S^T k_t      [B, H, V]
        S = S + kt.unsqueeze(-1) * (beta[:, t].unsqueeze(-1) * e).unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))           # S^T q_t
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o, S



def kda_sequence(raw: Tensor, f: Tensor, b: Tensor, gate: Tensor, valid: Tensor | None, conv_weight: Tensor,
                 A_log: Tensor, rescale: Tensor, lb: float, chunk_size: int, norm_weight: Tensor, norm_eps: float,
                 conv_state: Tensor | None = None, state: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """A KDA layer between its input and output projections over T tokens: the short conv of the raw q|k|v (pads
    zeroed), the features (pads made identity steps: k = g = beta = 0), the recurrence from ``state`` (zeros if None),
    the gated head norm. Returns that output [B, T, HK], the last ks-1 raw inputs (None without ``conv_state``) and
    the final state. (``chunk_size`` is the fast form's; the recurrence here is token by token.)"""
    if valid is not None:
        raw = raw.masked_fill(~valid.unsqueeze(-1), 0.0)
    q, k, v, g, beta = kda_features(_fp32(short_conv(raw, conv_weight, conv_state)), f, b, _fp32(A_log), rescale, lb)
    if valid is not None:
        pad = ~valid
        k, g = k.masked_fill(pad[..., None, None], 0.0), g.masked_fill(pad[..., None, None], 0.0)
        beta = beta.masked_fill(pad[..., None], 0.0)
    o, S = kda_recurrent(q, k, v, g, beta, state)
    ks = conv_weight.shape[-1]
    next_conv = None if conv_state is None else torch.cat([conv_state.to(raw.dtype), raw], 1)[:, -(ks - 1):]
    return gated_head_norm(o, gate, norm_weight, norm_eps), next_conv, S

# --- MoE (DeepSeek-V3, arXiv 2412.19437) ----------------------------------------------------------------------------


def moe_route(s: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor]:
    """Choices and gates from the router's affinities s = sigmoid(x W_r^T) [..., E]: idx = TopK(s + bias) (the bias
    only selects), w = s[idx] / sum s[idx] (when top_k > 1), times the routed scaling."""
    idx = torch.topk(s.detach() + bias, top_k, dim=-1).indices
    w = s.gather(-1, idx)
    if top_k > 1:
        w = w / w.sum(dim=-1, keepdim=True)
    return idx, w * scale


def moe_balance_loss(s: Tensor, idx: Tensor, n_experts: int, weight: float) -> Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20) from s [B, T, E] and idx [B, T, K]:
    f_i = E / (K T) #{t : i in TopK_t} (no gradient), P_i = mean_t s_i / sum_j s_j,
    L = weight * mean_b sum_i f_i P_i."""
    B, T, K = idx.shape
    f = torch.stack([torch.bincount(idx[b].reshape(-1), minlength=n_experts) for b in range(B)]).to(s.dtype)
    f = f * n_experts / (K * T)
    p = (s / s.sum(-1, keepdim=True)).mean(1)
    return weight * (f * p).sum(-1).mean()


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """E(x) = W_down (SiLU(W_gate x) * W_up x), with w_gate_up = [W_gate; W_up] [2h, d], w_down [d, h]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """y_t = sum_k w_tk E_{idx_tk}(x_t), token by token: x [N, d], idx and w [N, K], w_gate_up [E, 2h, d],
    w_down [E, d, h] -> [N, d]."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(w[t, k].to(x.dtype) * swiglu(x[t], w_gate_up[e], w_down[e])
                        for k, e in enumerate(idx[t].tolist())))
    return torch.stack(rows) if rows else x.new_zeros(x.shape)


# --- DSA (DeepSeek-V3.2, arXiv 2512.02556) --------------------------------------------------------------------------


def index_scores(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """The lightning indexer I[b, t, s] = sum_j w[b, t, j] ReLU(q[b, j, t] . k[b, s]): q [B, H_I, T, D_I],
    w [B, T, H_I], k [B, S, D_I] -> [B, T, S]."""
    return torch.einsum("bjts,btj->bts", torch.einsum("bjtd,bsd->bjts", q, k).relu(), w)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D) over the allowed keys) v: q [B, H, T, D], k and v [B, H_kv, S, D] (GQA groups of
    H / H_kv consecutive query heads), bool mask [B, T, S] with at least one key per row -> [B, H, T, D]."""
    H, D = q.shape[1], q.shape[-1]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    logits = q @ k.transpose(-1, -2) / D ** 0.5
    return logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v
