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
  decode step (one new token) runs :func:`single_query_attention` over the masked cache, or over a gather of the k
  selected keys/values once the cache is long.
* **Dense bypass.** With ``T_k <= index_top_k`` keys DSA equals dense causal attention exactly, so that path is taken
  (the indexer loss is still computed, over all causal keys, so the indexer keeps training).
* **Indexer training (stage 2, "sparse training").** ``L_I = mean_t KL(p_t || softmax(I[t, S_t]))`` where ``p_t`` is the
  main attention distribution summed over heads and L1-normalised, computed under ``no_grad`` from the same forward.
  The indexer reads ``x.detach()``, so it learns only from ``L_I`` and the LM only from the LM loss.

Not followed: MLA (the main attention is plain MHA/GQA with per-head QK RMSNorm, as is usual at this size), the fp8
indexer, IndexShare and key pooling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glm_lightning.model import cext
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.linear import linear
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.rope import RotaryEmbedding, apply_rotary

__all__ = [
    "DSACache",
    "LightningIndexer",
    "SparseAttention",
    "head_summed_attention_probs",
    "indexer_kl_loss",
    "lightning_index_scores",
    "single_query_attention",
    "topk_mask",
    "topk_select",
]


# ------------------------------------------------------------------------------------------------------------------
# decoding cache
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class DSACache:
    """Preallocated per-layer DSA decoding state (no ``torch.cat`` growth).

    ``k``, ``v``: ``[B, H_kv, max_seq_len, D]``; ``index_k``: the separate indexer keys ``[B, max_seq_len, D_I]``;
    ``key_valid``: ``[B, max_seq_len]`` (False = padding); ``length``: positions ``[0, length)`` are filled.
    Create it under the same grad mode it is used in (e.g. inside ``torch.inference_mode()`` for rollouts).
    """

    k: torch.Tensor
    v: torch.Tensor
    index_k: torch.Tensor
    key_valid: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, cfg: GLMConfig, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> DSACache:
        """Zeroed buffers for ``batch`` rows and ``cfg.max_seq_len`` positions, length 0."""
        n = cfg.max_seq_len
        return cls(
            k=torch.zeros(batch, cfg.n_kv_heads, n, cfg.head_dim, device=device, dtype=dtype),
            v=torch.zeros(batch, cfg.n_kv_heads, n, cfg.head_dim, device=device, dtype=dtype),
            index_k=torch.zeros(batch, n, cfg.index_head_dim, device=device, dtype=dtype),
            key_valid=torch.zeros(batch, n, device=device, dtype=torch.bool),
            length=0,
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def repeat_interleave(self, n: int) -> DSACache:
        """A new cache with every row repeated ``n`` times consecutively (row b -> rows b*n .. b*n+n-1)."""
        return DSACache(self.k.repeat_interleave(n, 0), self.v.repeat_interleave(n, 0),
                        self.index_k.repeat_interleave(n, 0), self.key_valid.repeat_interleave(n, 0), self.length)

    def index_select(self, rows: torch.Tensor | list[int]) -> DSACache:
        """A new cache holding only ``rows`` (in that order), e.g. to drop finished samples."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        return DSACache(self.k.index_select(0, rows), self.v.index_select(0, rows),
                        self.index_k.index_select(0, rows), self.key_valid.index_select(0, rows), self.length)

    def check_append(self, batch: int, n_new: int) -> None:
        """Raise ``ValueError`` if ``n_new`` tokens for ``batch`` rows do not fit."""
        if batch != self.batch_size:
            raise ValueError(f"DSACache holds {self.batch_size} rows but the input has {batch}")
        if self.length + n_new > self.max_seq_len:
            raise ValueError(f"DSACache overflow: {self.length} cached + {n_new} new tokens > max_seq_len "
                             f"{self.max_seq_len}")

    def append(self, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor, valid: torch.Tensor | None) -> int:
        """Write ``T`` new positions at ``[length, length + T)`` and advance ``length``; returns the new length."""
        n_new = k.shape[2]
        self.check_append(k.shape[0], n_new)
        start, end = self.length, self.length + n_new
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.index_k[:, start:end] = index_k
        self.key_valid[:, start:end] = True if valid is None else valid
        self.length = end
        return end


# ------------------------------------------------------------------------------------------------------------------
# functional pieces (public so that tests and later layers, e.g. IndexShare, can reuse them)
# ------------------------------------------------------------------------------------------------------------------
def _decode_op(*tensors: torch.Tensor) -> bool:
    """Whether a decode step's indexer scores / attention run as the C++ ops of csrc/decode_attention.cpp: fp32 on the
    CPU, ops built, and nothing to differentiate (the ops have no backward)."""
    return (not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and cext.takes(*tensors, fp64=False))


def lightning_index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``I[b, t, s] = sum_j w[b, t, j] * ReLU(q[b, j, t] . k[b, s])``.

    q: ``[B, H_I, T, D_I]``; w: ``[B, T, H_I]`` (already scaled); k: ``[B, S, D_I]``; returns ``[B, T, S]``.
    """
    B, HI, T, DI = q.shape
    if T == 1 and _decode_op(q, w, k):  # a decode step: one C++ pass (csrc/decode_attention.cpp)
        return torch.ops.glm_lightning.index_scores_one(q.reshape(B, HI, DI), w.reshape(B, HI), k).view(B, 1, -1)
    # heads folded into the rows of one bmm (no per-head copy of the S keys)
    dots = torch.bmm(q.reshape(B, HI * T, DI), k.transpose(1, 2)).view(B, HI, T, -1).relu_()  # [B, H_I, T, S]
    return (dots * w.transpose(1, 2).unsqueeze(-1)).sum(1)


def topk_select(scores: torch.Tensor, allowed: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k keys per query among the ``allowed`` ones, as indices (used for decode gathers and inspection).

    scores: ``[B, T, S]`` index scores; allowed: bool, broadcastable to ``[B, T, S]`` (causal & key validity).
    Returns ``indices [B, T, k]`` (long, best first) and ``selected [B, T, k]`` (bool, True = a real allowed key),
    with ``k = min(top_k, S)``. Disallowed keys are set to ``-inf`` before the top-k; validity is taken from the
    gathered values being finite and re-checked against ``allowed`` afterwards. Ties go to the earlier key (stable
    sort), so this selects exactly the set of :func:`topk_mask`.
    """
    k = min(top_k, scores.shape[-1])
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    values, indices = torch.sort(masked, dim=-1, descending=True, stable=True)
    values, indices = values[..., :k], indices[..., :k]
    selected = torch.isfinite(values) & allowed.expand_as(masked).gather(-1, indices)
    return indices, selected


def topk_mask(scores: torch.Tensor, allowed: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top-k selection as a boolean key mask ``[B, T, S]`` (the masked-SDPA form used for training/prefill).

    Same set as :func:`topk_select` without a sort or scatter: the k-th largest masked score ``kth`` comes from an
    unsorted ``topk``; keys strictly above it are kept, and among keys equal to it the earliest ones fill the
    remaining slots (deterministic tie-break, invariant to left padding). Keys must be allowed and finite.
    """
    k = min(top_k, scores.shape[-1])
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    kth = torch.topk(masked, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = masked > kth
    tie = masked == kth
    n_free = k - above.sum(-1, keepdim=True)
    keep = above | (tie & (tie.cumsum(-1) <= n_free))
    return keep & allowed & torch.isfinite(masked)


def decode_key_mask(scores: torch.Tensor, allowed: torch.Tensor, top_k: int) -> torch.Tensor:
    """A decode step's attention mask ``[B, 1, S]``: :func:`topk_mask` of ``scores [B, 1, S]`` among the ``allowed
    [B, 1, S]`` keys, then :func:`_fill_empty_rows` for the query at position S - 1. Without autograd on fp32 CPU
    tensors it is one C++ pass (``glm_lightning::topk_mask_one``, the same mask: ~135 us of ~22 tiny ops a DSA layer's
    step at 2 threads before)."""
    B, _, S = scores.shape
    if _decode_op(scores):
        return torch.ops.glm_lightning.topk_mask_one(scores.view(B, S), allowed.view(B, S), top_k).view(B, 1, S)
    return _fill_empty_rows(topk_mask(scores, allowed, top_k), S - 1)


def head_summed_attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Main-attention probabilities summed over heads and L1-normalised: the indexer's KL target ``p``.

    q: ``[B, H, T, D]``; k: ``[B, H_kv, S, D]`` (GQA groups of ``H / H_kv`` consecutive query heads); mask: bool,
    broadcastable to ``[B, T, S]``, every row with at least one True. Returns ``[B, T, S]`` (rows sum to 1).
    Uses the same ``1/sqrt(D)`` scale as SDPA.
    """
    B, H, T, D = q.shape
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = torch.matmul(q.contiguous() * D ** -0.5, k.transpose(-1, -2))  # [B, H, T, S]
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


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA for one query per row (a decode step): q ``[B, H, 1, D]``, k/v ``[B, H_kv, S, D]`` (GQA groups of
    ``H / H_kv`` consecutive query heads; strided slices of the cache buffers are fine), bool mask ``[B, 1, S]`` with
    at least one True per row -> ``[B, H, 1, D]``.

    Why: for a single query SDPA runs its flash kernel's blocking, 0.29 ms for flash-25m's 16 rows x ~80 keys (1
    thread), most of a DSA layer's decode step. Without autograd it is one C++ pass (csrc/decode_attention.cpp), else
    two ``bmm`` and a masked softmax, the query heads of one key/value head the rows of one matrix product."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if _decode_op(q, k, v):
        return torch.ops.glm_lightning.single_query_attention(q.reshape(B, H, D), k, v, mask.reshape(B, S),
                                                              D ** -0.5).view(B, H, 1, D)
    G = H // Hkv
    logits = torch.bmm(q.reshape(B * Hkv, G, D), k.reshape(B * Hkv, S, D).transpose(1, 2)).view(B, Hkv, G, S)
    logits = logits.mul_(D ** -0.5).masked_fill_(mask.logical_not().view(B, 1, 1, S), float("-inf"))
    out = torch.bmm(logits.softmax(-1).view(B * Hkv, G, S), v.reshape(B * Hkv, S, D))
    return out.view(B, H, 1, D)


def _allowed_keys(T: int, S: int, start: int, key_valid: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool ``[B or 1, T, S]``: key s is causal for query ``start + t`` and not padding."""
    if T == 1 and start == S - 1 and key_valid is not None:  # a decode step: every key is causal
        return key_valid[:, None, :]
    causal = torch.arange(S, device=device)[None, :] <= torch.arange(start, start + T, device=device)[:, None]
    return causal[None] if key_valid is None else causal[None] & key_valid[:, None, :]


def _fill_empty_rows(mask: torch.Tensor, start: int) -> torch.Tensor:
    """Let query rows with no key attend to their own slot (padding queries), so no row is all -inf (no NaN)."""
    T, S = mask.shape[-2], mask.shape[-1]
    diag = torch.arange(S, device=mask.device)[None, :] == torch.arange(start, start + T, device=mask.device)[:, None]
    return mask | (~mask.any(-1, keepdim=True) & diag)


# ------------------------------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------------------------------
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
        self.top_k = cfg.index_top_k
        self.loss_weight = cfg.indexer_loss_weight
        self.decode_gather_min_keys = 4 * cfg.index_top_k
        """Single-token decode gathers the k selected keys once the cache holds this many keys; below it the
        masked attention over all keys is cheaper (CPU, B=16, top_k=64: mask 1.7 vs gather 3.2 ms at 101 keys,
        gather 4.5 vs mask 5.7 ms at 501 keys, both measured with SDPA, before :func:`single_query_attention`; not
        re-measured since). Both paths give the same result."""
        d, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
        self.q_norm = RMSNorm(D, cfg.norm_eps)
        self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.rope = RotaryEmbedding(D, cfg.max_seq_len, cfg.rope_base) if cfg.attn_rope else None
        self.indexer = LightningIndexer(cfg)
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
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=gqa)

    @torch.no_grad()
    def select(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's selection for a full sequence (no cache), as used by ``forward`` in the sparse regime.

        Returns ``indices [B, T, k]`` and ``selected [B, T, k]`` (True = a real causal, non-padding key), with
        ``k = min(index_top_k, T)``.
        """
        B, T, _ = x.shape
        positions = range(T)  # contiguous: RoPE slices its table
        iq, iw = self.indexer.query(x, positions)
        scores = lightning_index_scores(iq, iw, self.indexer.key(x, positions))
        return topk_select(scores, _allowed_keys(T, T, 0, valid, x.device), self.top_k)

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
        want_loss = self.training and torch.is_grad_enabled()
        sparse = T > self.top_k
        q, k, v = self._qkv(x, positions)
        scores = None
        if sparse or want_loss:
            scores = self._index_scores(x, positions)
        if not sparse and valid is None:
            attn_mask, loss_keys = None, None
        else:
            allowed = _allowed_keys(T, T, 0, valid, x.device)
            loss_keys = topk_mask(scores, allowed, self.top_k) if sparse else allowed
            # without padding every query keeps >= 1 key (key 0); with padding, pad queries may keep none
            attn_mask = loss_keys if valid is None else _fill_empty_rows(loss_keys, 0)
        y = self._out(self._sdpa(q, k, v, attn_mask))
        if not want_loss:
            return y, x.new_zeros(())
        if loss_keys is None:
            loss_keys = _allowed_keys(T, T, 0, None, x.device)
        return y, self._indexer_loss(q, k, scores, loss_keys, attn_mask, valid)

    def _forward_cached(self, x: torch.Tensor, valid: torch.Tensor | None,
                        cache: DSACache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T tokens to the cache and attend over everything cached: the dense bypass while the cache holds
        <= top_k keys, then attention masked to the top-k keys (SDPA; :func:`single_query_attention` for one token),
        or for one-token decode over a long cache a gather of the k selected keys."""
        B, T, _ = x.shape
        cache.check_append(B, T)
        start = cache.length
        S = start + T
        positions = range(start, S)
        want_loss = self.training and torch.is_grad_enabled()
        sparse = S > self.top_k
        q, k, v = self._qkv(x, positions)
        xi = x.detach()  # the indexer learns only from its KL loss
        cache.append(k, v, self.indexer.key(xi, positions), valid)
        k, v, ik = cache.k[:, :, :S], cache.v[:, :, :S], cache.index_k[:, :S]
        allowed = _allowed_keys(T, S, start, cache.key_valid[:, :S], x.device)
        scores = None
        if sparse or want_loss:
            iq, iw = self.indexer.query(xi, positions)
            scores = lightning_index_scores(iq, iw, ik)
        if not sparse:
            loss_keys = allowed
        elif T == 1 and not want_loss and S >= self.decode_gather_min_keys:
            # long-context decode: gather the k selected keys/values instead of masking all S
            indices, selected = topk_select(scores, allowed, self.top_k)
            return self._out(self._gathered_attention(q, cache.k, cache.v, indices[:, 0], selected[:, 0])), \
                x.new_zeros(())
        elif T == 1 and not want_loss:
            attn_mask = decode_key_mask(scores, allowed, self.top_k)
            return self._out(single_query_attention(q, k, v, attn_mask)), x.new_zeros(())
        else:
            loss_keys = topk_mask(scores, allowed, self.top_k)
        attn_mask = _fill_empty_rows(loss_keys, start)
        if T == 1:
            y = self._out(single_query_attention(q, k, v, attn_mask))
        else:
            y = self._out(self._sdpa(q, k, v, attn_mask))
        if not want_loss:
            return y, x.new_zeros(())
        return y, self._indexer_loss(q, k, scores, loss_keys, attn_mask, valid)

    def _index_scores(self, x: torch.Tensor, positions: torch.Tensor | range) -> torch.Tensor:
        """Lightning-indexer scores [B, T, T] of a full sequence, from x.detach() (stage-2 training)."""
        xi = x.detach()
        iq, iw = self.indexer.query(xi, positions)
        return lightning_index_scores(iq, iw, self.indexer.key(xi, positions))

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = out.shape
        return linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), self.o_proj.weight)

    def _indexer_loss(self, q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor, loss_keys: torch.Tensor,
                      attn_mask: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
        """Weighted KL of the indexer to the detached head-summed main attention over the key set."""
        with torch.no_grad():
            p = head_summed_attention_probs(q, k, loss_keys if attn_mask is None else attn_mask)
        return indexer_kl_loss(p, scores, loss_keys, valid) * self.loss_weight

    def _gathered_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indices: torch.Tensor,
                            selected: torch.Tensor) -> torch.Tensor:
        """One query per row over its k selected cache slots.

        q ``[B, H, 1, D]``; k_buf/v_buf: the cache buffers ``[B, H_kv, max_seq_len, D]``; indices/selected ``[B, k]``.
        The gather is one ``index_select`` of D-float rows of the flattened buffer.
        """
        B, Hkv, M, D = k_buf.shape
        n = indices.shape[-1]
        rows = (torch.arange(B * Hkv, device=indices.device).view(B, Hkv, 1) * M + indices.view(B, 1, n)).view(-1)
        ks = k_buf.reshape(B * Hkv * M, D).index_select(0, rows).view(B, Hkv, n, D)
        vs = v_buf.reshape(B * Hkv * M, D).index_select(0, rows).view(B, Hkv, n, D)
        mask = selected | ~selected.any(-1, keepdim=True)  # padding query with no key: arbitrary but finite
        return single_query_attention(q, ks, vs, mask.view(B, 1, n))

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, top_k={self.top_k}, "
                f"rope={'on' if self.rope is not None else 'NoPE'}")
