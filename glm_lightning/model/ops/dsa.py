"""DSA's ops (references: ``reference.index_scores``, ``reference.masked_attention``): the lightning indexer's
scores, the top-k key selection and, for a decode step, the attention over the selected keys.

A decode step (one query per row) is what these ops make fast. On fp32 CPU tensors without autograd with the C++ ops
(csrc/decode_attention.cpp): the indexer scores, the key mask (top-k, ties to the earliest keys, and a row without
keys keeping its own slot; ~22 tiny ATen ops before, ~135 us of a DSA layer's step at 2 threads) and the single-query
attention are one pass each (SDPA ran its flash kernel's blocking for one query: 0.29 ms for flash-25m's 16 rows x ~80
keys at 1 thread, most of a DSA layer's step). Otherwise they are their PyTorch forms below. Once the cache is long
(thresholds.DECODE_GATHER_MIN_KEYS_PER_TOP_K) the step gathers the k selected keys and values instead of masking all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_lightning.model.ops import backend, mixed_precision as mp, thresholds


def _decode_cpp(op: str, *tensors: Tensor) -> bool:
    """Whether a decode step's C++ op ``op`` (no backward) takes these tensors: nothing to differentiate, fp32 CPU."""
    return not backend.needs_grad(*tensors) and backend.takes(*tensors, fp64=False, op=op)


@mp.fp32_op
def index_scores(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """``I[b, t, s] = sum_j w[b, t, j] * ReLU(q[b, j, t] . k[b, s])``: q [B, H_I, T, D_I], w [B, T, H_I] (already
    scaled), k [B, S, D_I] -> [B, T, S]."""
    B, HI, T, DI = q.shape
    if T == 1 and _decode_cpp("index_scores", q, w, k):
        return torch.ops.glm_lightning.index_scores_one(q.reshape(B, HI, DI), w.reshape(B, HI), k).view(B, 1, -1)
    # heads folded into the rows of one bmm (no per-head copy of the S keys)
    dots = torch.bmm(q.reshape(B, HI * T, DI), k.transpose(1, 2)).view(B, HI, T, -1).relu_()  # [B, H_I, T, S]
    return (dots * w.transpose(1, 2).unsqueeze(-1)).sum(1)


def topk_select(scores: Tensor, allowed: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Top-k keys per query among the ``allowed`` ones, as indices: scores [B, T, S], allowed bool broadcastable to
    it -> indices [B, T, k] (best first) and selected [B, T, k] (True = a real allowed key), k = min(top_k, S).
    Disallowed keys are -inf before the top-k; validity is taken from the gathered values being finite and re-checked
    against ``allowed``. Ties go to the earlier key (stable sort): exactly the set of :func:`topk_mask`."""
    k = min(top_k, scores.shape[-1])
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    values, indices = torch.sort(masked, dim=-1, descending=True, stable=True)
    values, indices = values[..., :k], indices[..., :k]
    selected = torch.isfinite(values) & allowed.expand_as(masked).gather(-1, indices)
    return indices, selected


def topk_mask(scores: Tensor, allowed: Tensor, top_k: int) -> Tensor:
    """The top-k selection as a bool key mask [B, T, S] (the masked-attention form of training and prefill): the
    set of :func:`topk_select` without a sort: keys strictly above the k-th largest score, then the earliest of the
    keys equal to it (deterministic, invariant to left padding). Keys must be allowed and finite."""
    k = min(top_k, scores.shape[-1])
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    kth = torch.topk(masked, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = masked > kth
    tie = masked == kth
    n_free = k - above.sum(-1, keepdim=True)
    keep = above | (tie & (tie.cumsum(-1) <= n_free))
    return keep & allowed & torch.isfinite(masked)


def fill_empty_rows(mask: Tensor, start: int) -> Tensor:
    """Let query rows (at positions start, start + 1, ...) with no key attend to their own slot (padding queries), so
    that no row is all -inf (no NaN)."""
    T, S = mask.shape[-2], mask.shape[-1]
    diag = torch.arange(S, device=mask.device)[None, :] == torch.arange(start, start + T, device=mask.device)[:, None]
    return mask | (~mask.any(-1, keepdim=True) & diag)


def decode_key_mask(scores: Tensor, allowed: Tensor, top_k: int) -> Tensor:
    """A decode step's attention mask [B, 1, S]: :func:`topk_mask` of scores [B, 1, S] among the allowed [B, 1, S]
    keys, then :func:`fill_empty_rows` for the query at position S - 1."""
    B, _, S = scores.shape
    if _decode_cpp("topk_mask", scores):
        return torch.ops.glm_lightning.topk_mask_one(scores.view(B, S), allowed.view(B, S), top_k).view(B, 1, S)
    return fill_empty_rows(topk_mask(scores, allowed, top_k), S - 1)


def single_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention for one query per row: q [B, H, 1, D], k/v [B, H_kv, S, D] (GQA groups of H / H_kv consecutive query
    heads; strided slices of the cache buffers are fine), bool mask [B, 1, S] with at least one True per row ->
    [B, H, 1, D]. PyTorch form: two ``bmm`` and a masked softmax, a key/value head's query heads the rows of one
    product; the softmax in fp32 (fp64 for fp64 tensors), the products under the bf16 policy of mixed_precision."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if _decode_cpp("single_query_attention", q, k, v):
        return torch.ops.glm_lightning.single_query_attention(q.reshape(B, H, D), k, v, mask.reshape(B, S),
                                                              D ** -0.5).view(B, H, 1, D)
    G = H // Hkv
    logits = mp.bmm(q.reshape(B * Hkv, G, D), k.reshape(B * Hkv, S, D).transpose(1, 2)).view(B, Hkv, G, S)
    if logits.dtype not in (torch.float32, torch.float64):  # the softmax in fp32 (fp64 stays fp64)
        logits = logits.float()
    logits = logits.mul_(D ** -0.5).masked_fill_(mask.logical_not().view(B, 1, 1, S), float("-inf"))
    out = mp.bmm(logits.softmax(-1).view(B * Hkv, G, S), v.reshape(B * Hkv, S, D))
    return out.view(B, H, 1, D)


def _gathered_attention(q: Tensor, k_buf: Tensor, v_buf: Tensor, indices: Tensor, selected: Tensor) -> Tensor:
    """One query per row over its k selected cache slots: q [B, H, 1, D]; k_buf/v_buf the cache buffers
    [B, H_kv, max_seq_len, D]; indices/selected [B, k]. The gather is one ``index_select`` of D-float rows."""
    B, Hkv, M, D = k_buf.shape
    n = indices.shape[-1]
    rows = (torch.arange(B * Hkv, device=indices.device).view(B, Hkv, 1) * M + indices.view(B, 1, n)).view(-1)
    ks = k_buf.reshape(B * Hkv * M, D).index_select(0, rows).view(B, Hkv, n, D)
    vs = v_buf.reshape(B * Hkv * M, D).index_select(0, rows).view(B, Hkv, n, D)
    mask = selected | ~selected.any(-1, keepdim=True)  # padding query with no key: arbitrary but finite
    return single_query_attention(q, ks, vs, mask.view(B, 1, n))


def decode_attention(q: Tensor, k_buf: Tensor, v_buf: Tensor, length: int, scores: Tensor, allowed: Tensor,
                     top_k: int) -> Tensor:
    """A decode step's sparse attention: q [B, H, 1, D] over the top-k of the first ``length`` cached keys
    (k_buf/v_buf [B, H_kv, max_seq_len, D]) by the indexer scores [B, 1, length] among the allowed [B, 1, length]
    -> [B, H, 1, D]: a gather of the selected keys for a long cache, else the masked attention over all keys."""
    if length >= thresholds.DECODE_GATHER_MIN_KEYS_PER_TOP_K * top_k:
        indices, selected = topk_select(scores, allowed, top_k)
        return _gathered_attention(q, k_buf, v_buf, indices[:, 0], selected[:, 0])
    mask = decode_key_mask(scores, allowed, top_k)
    return single_query_attention(q, k_buf[:, :, :length], v_buf[:, :, :length], mask)
