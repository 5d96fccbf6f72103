"""DSA: DeepSeek Sparse Attention with the lightning indexer (DeepSeek-V3.2, arXiv 2512.02556).

What is followed from the paper (and the V3.2-Exp ``Indexer`` reference, re-implemented from the formulas):

* **Lightning indexer.** ``I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])`` with ``H_I`` query heads of dim
  ``D_I``, ONE key ``k_I = LayerNorm(W_k^I x)`` (LayerNorm with bias) shared by all indexer heads, and per-token head
  weights ``w = (W_w x) * H_I^-0.5 * D_I^-0.5``. RoPE (half-split layout) rotates the first ``index_rope_dim``
  channels of ``q_I`` and ``k_I`` (layout ``[pe, nope]``); the main attention is NoPE by default.
* **Top-k selection.** ``S_t = TopK_{s <= t} I[t, s]`` with ``k = min(index_top_k, #valid causal keys)``; one
  selection is shared by all heads. Future and padding keys are masked with ``-inf`` *before* top-k and the
  causal/validity mask is re-applied *after* it (validity comes from the gathered values being finite, never from the
  indices alone: rows ``t + 1 < k`` otherwise pick future slots). Ties are broken deterministically towards the
  earlier key (stable sort), so selections are invariant to left padding and identical between a full forward and
  cached decoding. The main attention is a softmax over ``S_t`` only: boolean-mask SDPA for training/prefill; a
  decode step (one new token) runs ``ops.decode_attention`` (the masked cache, or a gather of the k selected
  keys/values once the cache is long).
* **Dense bypass.** With ``T_k <= index_top_k`` keys DSA equals dense causal attention exactly, so that path is taken
  (the indexer loss is still computed, over all causal keys, so the indexer keeps training).
* **Indexer training (stage 2, "sparse training").** ``L_I = mean_t KL(p_t || softmax(I[t, S_t]))`` where ``p_t`` is the
  main attention distribution summed over heads and L1-normalised, computed under ``no_grad`` from the same forward.
  The indexer reads ``x.detach()``, so it learns only from ``L_I`` and the LM only from the LM loss.

Not followed: MLA (the main attention is plain MHA/GQA with per-head QK RMSNorm, as is usual at this size), the fp8
indexer, IndexShare and key pooling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_lightning.model import ops
from glm_lightning.model.cache import DSACache
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import linear
from glm_lightning.model.rope import RotaryEmbedding, apply_rotary

__all__ = ["DSACache", "LightningIndexer", "SparseAttention", "head_summed_attention_probs", "indexer_kl_loss"]


class SparseAttention(nn.Module):
    """DSA token mixer: QK-normed MHA/GQA attention over the lightning indexer's top-k keys.

    ``forward(x [B, T, C], valid [B, T] | None, cache | None) -> (y [B, T, C], indexer_loss scalar)``.
    The indexer loss is already multiplied by ``cfg.indexer_loss_weight`` and is a zero scalar unless
    ``self.training and torch.is_grad_enabled()``.
    """

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # without the indexer every causal key is kept: no sequence exceeds max_seq_len keys, so never "sparse"
        self.top_k = cfg.index_top_k if cfg.dsa_indexer else cfg.max_seq_len
        self.loss_weight = cfg.indexer_loss_weight
        d, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
        self.q_norm = RMSNorm(D, cfg.norm_eps)
        self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.rope = RotaryEmbedding(D, cfg.max_seq_len, cfg.rope_base) if cfg.attn_rope else None
        self.indexer = LightningIndexer(cfg) if cfg.dsa_indexer else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, init_std); norm scales 1, LayerNorm bias 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.cfg.init_std)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                if m.weight is not None:
                    nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    # --- pieces -----------------------------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_norm(linear(x, self.q_proj.weight).view(B, T, H, D))
        k = self.k_norm(linear(x, self.k_proj.weight).view(B, T, Hkv, D))
        v = linear(x, self.v_proj.weight).view(B, T, Hkv, D)
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(positions)
            q, k = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None])
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            return ops.attention(q, k, v, causal=True, gqa=gqa)
        return ops.attention(q, k, v, mask=mask.unsqueeze(1), gqa=gqa)

    @torch.no_grad()
    def select(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's selection for a full sequence (no cache), as used by ``forward`` in the sparse regime.

        Returns ``indices [B, T, k]`` and ``selected [B, T, k]`` (True = a real causal, non-padding key), with
        ``k = min(index_top_k, T)``.
        """
        if self.indexer is None:
            raise ValueError("this layer has no indexer (dsa_indexer False): it attends to every key")
        B, T, _ = x.shape
        positions = range(T)  # contiguous: RoPE slices its table
        iq, iw = self.indexer.query(x, positions)
        scores = ops.index_scores(iq, iw, self.indexer.key(x, positions))
        return ops.topk_select(scores, _allowed_keys(T, T, 0, valid, x.device), self.top_k)

    # --- forward ----------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None,
                cache: DSACache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C] -> (y [B, T, C], weighted indexer loss). Two regimes: a full sequence (training, scoring;
        no cache) or an incremental call that appends to `cache` (prefill, decode)."""
        if valid is not None:
            valid = valid.to(torch.bool)
        if cache is None:
            return self._forward_full(x, valid)
        return self._forward_cached(x, valid, cache)

    def _forward_full(self, x: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequences from position 0: causal SDPA when T <= top_k (the exact dense bypass), else SDPA masked
        to the indexer's top-k keys."""
        B, T, _ = x.shape
        positions = range(T)  # contiguous: RoPE slices its table
        want_loss = self.indexer is not None and self.training and torch.is_grad_enabled()
        sparse = T > self.top_k
        q, k, v = self._qkv(x, positions)
        scores = None
        if sparse or want_loss:
            scores = self._index_scores(x, positions)
        if not sparse and valid is None:
            attn_mask, loss_keys = None, None
        else:
            allowed = _allowed_keys(T, T, 0, valid, x.device)
            loss_keys = ops.topk_mask(scores, allowed, self.top_k) if sparse else allowed
            # without padding every query keeps >= 1 key (key 0); with padding, pad queries may keep none
            attn_mask = loss_keys if valid is None else ops.fill_empty_rows(loss_keys, 0)
        y = self._out(self._sdpa(q, k, v, attn_mask))
        if not want_loss:
            return y, x.new_zeros(())
        if loss_keys is None:
            loss_keys = _allowed_keys(T, T, 0, None, x.device)
        return y, self._indexer_loss(q, k, scores, loss_keys, attn_mask, valid)

    def _forward_cached(self, x: torch.Tensor, valid: torch.Tensor | None,
                        cache: DSACache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T tokens to the cache and attend over everything cached: the dense bypass while the cache holds
        <= top_k keys, then attention masked to the top-k keys (SDPA; a decode step: ``ops.decode_attention``)."""
        B, T, _ = x.shape
        cache.check_append(B, T)
        start = cache.length
        S = start + T
        positions = range(start, S)
        want_loss = self.indexer is not None and self.training and torch.is_grad_enabled()
        sparse = S > self.top_k
        q, k, v = self._qkv(x, positions)
        xi = x.detach()  # the indexer learns only from its KL loss
        cache.append(k, v, None if self.indexer is None else self.indexer.key(xi, positions), valid)
        allowed = _allowed_keys(T, S, start, cache.key_valid[:, :S], x.device)
        scores = None
        if sparse or want_loss:
            iq, iw = self.indexer.query(xi, positions)
            scores = ops.index_scores(iq, iw, cache.index_k[:, :S])
        if sparse and T == 1 and not want_loss:  # a decode step
            return self._out(ops.decode_attention(q, cache.k, cache.v, S, scores, allowed, self.top_k)), \
                x.new_zeros(())
        k, v = cache.k[:, :, :S], cache.v[:, :, :S]
        loss_keys = ops.topk_mask(scores, allowed, self.top_k) if sparse else allowed
        # a dense decode step without padding keeps at least its own key, just appended: no row to fill
        attn_mask = loss_keys if T == 1 and valid is None and not sparse else ops.fill_empty_rows(loss_keys, start)
        y = self._out(ops.single_query_attention(q, k, v, attn_mask) if T == 1 else self._sdpa(q, k, v, attn_mask))
        if not want_loss:
            return y, x.new_zeros(())
        return y, self._indexer_loss(q, k, scores, loss_keys, attn_mask, valid)

    def _index_scores(self, x: torch.Tensor, positions: torch.Tensor | range) -> torch.Tensor:
        """Lightning-indexer scores [B, T, T] of a full sequence, from x.detach() (stage-2 training)."""
        xi = x.detach()
        iq, iw = self.indexer.query(xi, positions)
        return ops.index_scores(iq, iw, self.indexer.key(xi, positions))

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = out.shape
        return linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), self.o_proj.weight)

    def _indexer_loss(self, q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor, loss_keys: torch.Tensor,
                      attn_mask: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
        """Weighted KL of the indexer to the detached head-summed main attention over the key set."""
        with torch.no_grad():
            p = head_summed_attention_probs(q, k, loss_keys if attn_mask is None else attn_mask)
        return indexer_kl_loss(p, scores, loss_keys, valid) * self.loss_weight

    def extra_repr(self) -> str:
        keys = f"top_k={self.top_k}" if self.indexer is not None else "every key (no indexer)"
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, {keys}, "
                f"rope={'on' if self.rope is not None else 'NoPE'}")


class LightningIndexer(nn.Module):
    """The V3.2 lightning indexer: ``H_I`` ReLU heads against one shared LayerNorm'd key, per-token head weights."""

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.index_rope_dim
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=cfg.norm_eps)
        self.w_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)
        self.w_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        self.rope = RotaryEmbedding(self.rope_dim, cfg.max_seq_len, cfg.rope_base) if self.rope_dim > 0 else None

    def query(self, x: torch.Tensor, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_I [B, H_I, T, D_I]`` (RoPE on the first rope_dim channels) and scaled weights ``w [B, T, H_I]``."""
        B, T, _ = x.shape
        q = linear(x, self.q_proj.weight).view(B, T, self.n_heads, self.head_dim)
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(positions)
            q = apply_rotary(q, cos[:, None], sin[:, None])
        return q.transpose(1, 2), linear(x, self.w_proj.weight) * self.w_scale

    def key(self, x: torch.Tensor, positions: torch.Tensor | range) -> torch.Tensor:
        """The shared indexer key ``k_I = RoPE(LayerNorm(W_k x))``: ``[B, T, D_I]``."""
        k = self.k_norm(linear(x, self.k_proj.weight))
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(positions)
            k = apply_rotary(k, cos, sin)
        return k


# --- helpers ---------------------------------------------------------------------------------------------------
def _allowed_keys(T: int, S: int, start: int, key_valid: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool ``[B or 1, T, S]``: key s is causal for query ``start + t`` and not padding."""
    if T == 1 and start == S - 1 and key_valid is not None:  # a decode step: every key is causal
        return key_valid[:, None, :]
    causal = torch.arange(S, device=device)[None, :] <= torch.arange(start, start + T, device=device)[:, None]
    return causal[None] if key_valid is None else causal[None] & key_valid[:, None, :]


def head_summed_attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Main-attention probabilities summed over heads and L1-normalised: the indexer's KL target ``p``.

    q: ``[B, H, T, D]``; k: ``[B, H_kv, S, D]`` (GQA groups of ``H / H_kv`` consecutive query heads); mask: bool,
    broadcastable to ``[B, T, S]``, every row with at least one True. Returns ``[B, T, S]`` (rows sum to 1).
    Uses the same ``1/sqrt(D)`` scale as SDPA.
    """
    B, H, T, D = q.shape
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = ops.product(q.contiguous() * D ** -0.5, k.transpose(-1, -2))  # [B, H, T, S]
    logits = logits if logits.dtype == torch.float32 else logits.float()  # the softmax in fp32
    p = logits.masked_fill_(~mask.unsqueeze(1), float("-inf")).softmax(-1).sum(1)
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def indexer_kl_loss(p: torch.Tensor, index_scores: torch.Tensor, key_mask: torch.Tensor,
                    query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_{valid t} KL(p_t || softmax(I[t, key set]))`` (unweighted).

    p: ``[B, T, S]`` target normalised over ``key_mask`` (treated as a constant; zeroed outside the key set);
    index_scores: ``[B, T, S]``; key_mask: bool, broadcastable to ``[B, T, S]`` (the key set, S_t or all causal
    keys); query_mask: bool ``[B, T]`` of the query tokens to average over (default all). Rows without keys or
    masked queries contribute nothing; no valid query gives 0.
    """
    key_mask = key_mask.expand_as(index_scores)
    p = p.detach().masked_fill(~key_mask, 0.0)
    # a finite fill (not -inf) keeps 0 * log_q = 0 outside the key set and empty rows finite
    log_q = index_scores.float().masked_fill(~key_mask, torch.finfo(torch.float32).min).log_softmax(-1)
    kl = F.kl_div(log_q, p, reduction="none").sum(-1)  # sum_s p (log p - log q), 0 where p = 0
    qm = key_mask.any(-1)
    if query_mask is not None:
        qm = qm & query_mask
    qm = qm.to(kl.dtype)
    return (kl * qm).sum() / qm.sum().clamp_min(1.0)
