"""DSA (DeepSeek sparse attention + lightning indexer): references written here, causality, indexer loss, padding,
decoding cache. Small sizes; the larger init std makes attention sharp so that sparse and dense clearly differ."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import cext
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.dsa import DSACache, SparseAttention, indexer_kl_loss
from glm_lightning.model.ops import reference, thresholds
from glm_lightning.model.ops.dsa import decode_key_mask, single_query_attention, topk_mask, topk_select
from glm_lightning.model.ops.dsa import fill_empty_rows as _fill_empty_rows
from glm_lightning.model.ops.dsa import index_scores as lightning_index_scores

ATOL = 1e-5


def make(seed: int = 0, **kw) -> SparseAttention:
    base = dict(d_model=32, n_heads=4, head_dim=8, n_kv_heads=2, index_n_heads=2, index_head_dim=8,
                index_rope_dim=4, index_top_k=6, max_seq_len=40, init_std=0.3)
    base.update(kw)
    torch.manual_seed(seed)
    m = SparseAttention(GLMConfig(**base))
    with torch.no_grad():  # non-trivial norm parameters, so that the references must use them
        for mod in (m.q_norm, m.k_norm, m.indexer.k_norm):
            mod.weight.uniform_(0.5, 1.5)
        m.indexer.k_norm.bias.normal_(0, 0.1)
    return m


# ---------------------------------------------------------------------------------------------------------------
# references written from the formulas
# ---------------------------------------------------------------------------------------------------------------
def naive_qkv(m: SparseAttention, x: torch.Tensor):
    B, T, _ = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps) * w

    q = rms((x @ m.q_proj.weight.T).view(B, T, H, D), m.q_norm.weight).transpose(1, 2)
    k = rms((x @ m.k_proj.weight.T).view(B, T, Hkv, D), m.k_norm.weight).transpose(1, 2)
    v = (x @ m.v_proj.weight.T).view(B, T, Hkv, D).transpose(1, 2)
    if m.rope is not None:
        q, k = m.rope.apply_rope(q, torch.arange(T)), m.rope.apply_rope(k, torch.arange(T))
    rep = H // Hkv
    return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


def naive_probs(m: SparseAttention, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-head attention probabilities [B, H, T, T] restricted to keep [B, T, T]."""
    q, k, _ = naive_qkv(m, x)
    logits = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    return logits.masked_fill(~keep[:, None], float("-inf")).softmax(-1)


def naive_attention(m: SparseAttention, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    q, k, v = naive_qkv(m, x)
    o = reference.masked_attention(q, k, v, keep)
    return o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1) @ m.o_proj.weight.T


def naive_index_scores(m: SparseAttention, x: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]), one LayerNorm'd key, RoPE on the first rope dims."""
    ix = m.indexer
    B, T, _ = x.shape
    HI, DI, R = ix.n_heads, ix.head_dim, ix.rope_dim
    qi = (x @ ix.q_proj.weight.T).view(B, T, HI, DI).transpose(1, 2)  # [B, HI, T, DI]
    ki = F.layer_norm(x @ ix.k_proj.weight.T, (DI,), ix.k_norm.weight, ix.k_norm.bias, m.cfg.norm_eps)
    pos = torch.arange(T)
    qi = torch.cat([ix.rope.apply_rope(qi[..., :R], pos), qi[..., R:]], -1)
    ki = torch.cat([ix.rope.apply_rope(ki[..., :R], pos), ki[..., R:]], -1)
    w = (x @ ix.w_proj.weight.T) / math.sqrt(HI) / math.sqrt(DI)  # [B, T, HI]
    return reference.index_scores(qi, w, ki)


def causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------------------------
# forward against references
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("attn_rope", [False, True])
def test_dense_regime_equals_naive_causal_attention(n_kv_heads: int, attn_rope: bool) -> None:
    m = make(n_kv_heads=n_kv_heads, attn_rope=attn_rope, index_top_k=16).eval()
    x = torch.randn(3, 16, 32)
    def boom(*a, **k):
        raise AssertionError("the dense bypass must not run the indexer query in eval")

    m.indexer.query = boom
    y, loss = m(x)
    ref = naive_attention(m, x, causal(16).expand(3, 16, 16))
    assert torch.allclose(y, ref, atol=ATOL), (y - ref).abs().max()
    assert loss.item() == 0.0 and loss.dim() == 0


def test_sparse_mask_form_equals_gather_reference() -> None:
    m = make().eval()
    B, T = 2, 20
    x = torch.randn(B, T, 32)
    idx, sel = m.select(x)
    q, k, v = naive_qkv(m, x)
    rows = []
    for b in range(B):  # per-query gather of the selected keys/values
        for t in range(T):
            s = idx[b, t][sel[b, t]]
            att = ((q[b, :, t, None] @ k[b][:, s].transpose(-1, -2)) / math.sqrt(m.head_dim)).softmax(-1)
            rows.append((att @ v[b][:, s]).reshape(-1))
    ref = torch.stack(rows).view(B, T, -1) @ m.o_proj.weight.T
    y, _ = m(x)
    assert torch.allclose(y, ref, atol=ATOL), (y - ref).abs().max()
    dense = naive_attention(m, x, causal(T).expand(B, T, T))
    assert (y - dense).abs().max() > 1e-2  # the sparse regime really drops keys


def test_indexer_scores_follow_the_formula() -> None:
    m = make()
    x = torch.randn(2, 12, 32)
    pos = torch.arange(12)
    q, w = m.indexer.query(x, pos)
    got = lightning_index_scores(q, w, m.indexer.key(x, pos))
    assert torch.allclose(got, naive_index_scores(m, x), atol=ATOL)


def test_selection_is_causal_and_counts() -> None:
    m = make().eval()
    T, K = 20, m.top_k
    x = torch.randn(2, T, 32)
    idx, sel = m.select(x)
    assert idx.shape == (2, T, K)
    t = torch.arange(T).view(1, T, 1)
    assert not (sel & (idx > t)).any()  # no selected valid index is in the future
    counts = sel.sum(-1)
    assert torch.equal(counts, torch.clamp(torch.arange(T) + 1, max=K).expand(2, T))
    for r in range(K):  # early rows keep exactly all their causal keys
        assert sorted(idx[0, r][sel[0, r]].tolist()) == list(range(r + 1))
    # the selected keys are the top scores among the causal ones
    scores = naive_index_scores(m, x).masked_fill(~causal(T), float("-inf"))
    best = scores.topk(K, -1).values[..., -1]
    chosen = scores.gather(-1, idx).masked_fill(~sel, float("inf")).amin(-1)
    assert torch.all(chosen[:, K:] >= best[:, K:])


def test_topk_pitfall_future_slots_never_selected() -> None:
    """Scores that favour future keys: rows t + 1 < k must still return only causal keys."""
    T, K = 10, 6
    scores = torch.arange(T, dtype=torch.float32).expand(1, T, T).clone()  # later keys score higher
    allowed = causal(T)[None]
    idx, sel = topk_select(scores, allowed, K)
    t = torch.arange(T).view(1, T, 1)
    assert not (sel & (idx > t)).any()
    assert torch.equal(sel.sum(-1)[0], torch.clamp(torch.arange(T) + 1, max=K))
    mask = topk_mask(scores, allowed, K)
    assert not (mask & ~allowed).any()
    assert torch.equal(mask[0, 9].nonzero().view(-1), torch.arange(4, 10))


def test_topk_mask_equals_index_selection_with_ties() -> None:
    torch.manual_seed(5)
    scores = torch.randint(0, 4, (3, 30, 30)).float()  # many exact ties
    allowed = causal(30)[None] & (torch.rand(3, 1, 30) > 0.2)
    for K in (1, 5, 12):
        idx, sel = topk_select(scores, allowed, K)
        ref = torch.zeros(3, 30, 30, dtype=torch.bool).scatter_(-1, idx, sel)
        assert torch.equal(topk_mask(scores, allowed, K), ref)
        # ties go to the earliest keys
        row = scores[0, 29].masked_fill(~allowed[0, 29], float("-inf"))
        kept = ref[0, 29].nonzero().view(-1)
        kth = row[kept].min()
        assert torch.equal(kept[row[kept] == kth], (row == kth).nonzero().view(-1)[: int((row[kept] == kth).sum())])


def test_causality_perturbing_future_leaves_past_bit_identical() -> None:
    m = make().eval()
    T, t0 = 24, 13
    x = torch.randn(2, T, 32)
    x2 = x.clone()
    x2[:, t0:] += 5.0 * torch.randn(2, T - t0, 32)
    with torch.no_grad():
        y1, y2 = m(x)[0], m(x2)[0]
    assert torch.equal(y1[:, :t0], y2[:, :t0])
    assert not torch.allclose(y1[:, t0:], y2[:, t0:])


# ---------------------------------------------------------------------------------------------------------------
# indexer loss
# ---------------------------------------------------------------------------------------------------------------
def test_kl_helper_zero_at_target_and_value() -> None:
    torch.manual_seed(6)
    keep = causal(7)[None].expand(2, 7, 7)
    p = torch.rand(2, 7, 7).masked_fill(~keep, 0)
    p = p / p.sum(-1, keepdim=True)
    scores = torch.where(keep, p.log(), torch.randn(2, 7, 7))  # equals p on the key set; junk outside it
    assert indexer_kl_loss(p, scores, keep).abs().item() < 1e-6
    assert indexer_kl_loss(p, torch.randn(2, 7, 7), keep).item() > 1e-3
    # KL([.5, .5] || softmax([0, log 3])) = .5 log 2 + .5 log(2/3)
    p1 = torch.tensor([[[0.5, 0.5]]])
    s1 = torch.tensor([[[0.0, math.log(3.0)]]])
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert abs(indexer_kl_loss(p1, s1, torch.ones(1, 1, 2, dtype=torch.bool)).item() - want) < 1e-6


@pytest.mark.parametrize("T", [5, 20])  # dense bypass (T <= top_k = 6) and sparse regime
def test_indexer_loss_equals_reference(T: int) -> None:
    m = make(indexer_loss_weight=0.7).train()
    x = torch.randn(2, T, 32)
    _, loss = m(x)
    if T <= m.top_k:
        keep = causal(T).expand(2, T, T)
    else:
        idx, sel = m.select(x)
        keep = torch.zeros(2, T, T, dtype=torch.bool).scatter_(-1, idx, sel)
    p = naive_probs(m, x, keep).sum(1)
    p = p / p.sum(-1, keepdim=True)
    log_q = naive_index_scores(m, x).masked_fill(~keep, float("-inf")).log_softmax(-1)
    kl = torch.where(keep, p * (p.clamp_min(1e-30).log() - log_q), torch.zeros(())).sum(-1)
    assert torch.allclose(loss, 0.7 * kl.mean(), atol=1e-6), (loss, kl.mean())
    assert loss.item() > 0


@pytest.mark.parametrize("T", [5, 20])
def test_indexer_loss_gradients_are_isolated(T: int) -> None:
    m = make().train()
    x = torch.randn(2, T, 32, requires_grad=True)
    y, loss = m(x)
    names = [n for n, _ in m.named_parameters()]
    g_loss = torch.autograd.grad(loss, list(m.parameters()) + [x], allow_unused=True)
    for n, g in zip(names, g_loss[:-1]):
        if n.startswith("indexer."):
            assert g is not None and g.abs().sum() > 0, n
        else:
            assert g is None or not g.any(), n
    assert g_loss[-1] is None or not g_loss[-1].any()  # the indexer reads x.detach()
    g_out = torch.autograd.grad(y.sum(), list(m.parameters()), allow_unused=True)
    for n, g in zip(names, g_out):
        if n.startswith("indexer."):
            assert g is None or not g.any(), n


def test_every_parameter_gets_gradient() -> None:
    m = make().train()
    y, loss = m(torch.randn(2, 20, 32))
    (y.sum() + loss).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_loss_is_zero_in_eval_or_no_grad_and_param_count() -> None:
    m = make().train()
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        assert m(x)[1].item() == 0.0
    m.eval()
    assert m(x)[1].item() == 0.0
    c = make(n_kv_heads=4).cfg
    d, HD, D, HI, DI = c.d_model, c.n_heads * c.head_dim, c.head_dim, c.index_n_heads, c.index_head_dim
    want = 4 * d * HD + 2 * D + d * HI * DI + d * DI + 2 * DI + d * HI
    assert sum(p.numel() for p in make(n_kv_heads=4).parameters()) == want


# ---------------------------------------------------------------------------------------------------------------
# padding
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,n_pad", [(24, 6), (24, 19), (8, 3)])
def test_left_padded_rows_equal_unpadded(T: int, n_pad: int) -> None:
    m = make().eval()
    torch.manual_seed(7)
    x = torch.randn(2, T, 32)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :n_pad] = False
    with torch.no_grad():
        y, _ = m(x, valid)
        alone, _ = m(x[1:, n_pad:])
        y0, _ = m(x[:1])
    assert torch.isfinite(y).all()
    assert torch.allclose(y[1, n_pad:], alone[0], atol=ATOL), (y[1, n_pad:] - alone[0]).abs().max()
    assert torch.allclose(y[0], y0[0], atol=ATOL)


def test_no_nan_with_padding_in_training() -> None:
    m = make().train()
    x = torch.randn(3, 20, 32, requires_grad=True)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, :7] = False
    valid[2, :19] = False  # a row with a single real token
    y, loss = m(x, valid)
    assert torch.isfinite(y).all() and torch.isfinite(loss)
    (y.sum() + loss).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    # pad keys are never selected
    idx, sel = m.select(x.detach(), valid)
    assert not (sel & ~valid.gather(1, idx.flatten(1)).view_as(idx)).any()


@pytest.mark.parametrize("T,n_pad", [(24, 6), (6, 2)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_indexer_loss_ignores_padding(T: int, n_pad: int, side: str) -> None:
    """The loss averages over real query tokens only: a padded row gives the unpadded row's loss."""
    m = make().train()
    x = torch.randn(1, T, 32)
    valid = torch.ones(1, T, dtype=torch.bool)
    real = slice(n_pad, None) if side == "left" else slice(None, T - n_pad)
    valid[0] = False
    valid[0, real] = True
    padded, alone = m(x, valid)[1], m(x[:, real])[1]
    assert torch.allclose(padded, alone, atol=1e-6), (padded, alone)


# ---------------------------------------------------------------------------------------------------------------
# decoding cache
# ---------------------------------------------------------------------------------------------------------------
def run_cached(m: SparseAttention, x: torch.Tensor, valid: torch.Tensor | None, splits: list[int]) -> torch.Tensor:
    """Prefill x[:, :splits[0]], then chunks up to each later split, then one token at a time."""
    B, T, _ = x.shape
    cache = DSACache.empty(B, m.cfg)
    outs, pos = [], 0
    for end in splits + list(range(splits[-1] + 1, T + 1)):
        outs.append(m(x[:, pos:end], None if valid is None else valid[:, pos:end], cache)[0])
        pos = end
        assert cache.length == pos
    return torch.cat(outs, 1)


# dense bypass throughout (T <= top_k 6); sparse regime decoded by boolean-mask SDPA or by gathering the k keys
@pytest.mark.parametrize("T,gather", [(6, False), (22, False), (22, True)])
@pytest.mark.parametrize("splits", [[1], [3], [4, 9], [13]])
def test_prefill_plus_decode_equals_full_forward(T: int, gather: bool, splits: list[int], monkeypatch) -> None:
    splits = [s for s in splits if s <= T] or [T - 1]
    m = make().eval()
    monkeypatch.setattr(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", 0 if gather else 10**9)
    torch.manual_seed(8)
    x = torch.randn(2, T, 32)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :2] = False
    with torch.inference_mode():
        for v in (None, valid):
            full, _ = m(x, v)
            got = run_cached(m, x, v, splits)
            ok = slice(None) if v is None else v
            assert torch.allclose(got[ok], full[ok], atol=ATOL), (got[ok] - full[ok]).abs().max()


def _decode_paths() -> list[str]:
    """The decode-step ops' paths: eager (autograd on), and the C++ ops of csrc/decode_attention.cpp when built."""
    return ["eager", "cpp"] if cext.available() else ["eager"]


@pytest.mark.parametrize("path", _decode_paths())
@pytest.mark.parametrize("D,S", [(8, 11), (32, 37), (64, 21)])  # scalar dots, 16-key blocks, value sums in registers
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_single_query_attention_equals_sdpa(n_kv_heads: int, D: int, S: int, path: str) -> None:
    """The decode step's attention equals SDPA with the boolean mask, for GQA groups, keys and values that are
    strided slices of a longer cache buffer, and a row that keeps a single key: as the C++ op (no autograd) and as two
    bmm and a masked softmax (autograd on, which also reaches q, k and v)."""
    gen = torch.Generator().manual_seed(3)
    B, H = 3, 4
    q = torch.randn(B, 1, H, D, generator=gen).transpose(1, 2)  # [B, H, 1, D] as the layer makes it
    k = torch.randn(B, n_kv_heads, S + 9, D, generator=gen)[:, :, :S]
    v = torch.randn(B, n_kv_heads, S + 9, D, generator=gen)[:, :, :S]
    mask = torch.rand(B, 1, S, generator=gen) > 0.4
    mask[0] = False
    mask[0, 0, 5] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=n_kv_heads != H)
    if path == "cpp":
        got = torch.ops.glm_lightning.single_query_attention(q.reshape(B, H, D), k, v, mask.view(B, S), D ** -0.5)
        torch.testing.assert_close(got.view(B, H, 1, D), ref, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # and the layer's function takes it
            torch.testing.assert_close(single_query_attention(q, k, v, mask), got.view(B, H, 1, D), rtol=0, atol=0)
    else:
        qg = q.detach().requires_grad_()
        got = single_query_attention(qg, k, v, mask)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        got.sum().backward()
        assert qg.grad is not None and torch.isfinite(qg.grad).all()


@pytest.mark.parametrize("path", _decode_paths())
def test_decode_step_index_scores_follow_the_formula(path: str) -> None:
    """One query per row (a decode step) against strided cached indexer keys: the C++ op (no autograd) and the bmm
    form (autograd on) equal the formula sum_j w_j ReLU(q_j . k_s), for 16-key blocks and a partial one."""
    gen = torch.Generator().manual_seed(4)
    B, HI, DI, S = 3, 4, 32, 37
    q = torch.randn(B, HI, 1, DI, generator=gen)
    w = torch.randn(B, 1, HI, generator=gen)
    k = torch.randn(B, S + 5, DI, generator=gen)[:, :S]
    ref = (torch.einsum("bjd,bsd->bjs", q[:, :, 0], k).relu() * w[:, 0, :, None]).sum(1, keepdim=True)
    if path == "cpp":
        with torch.no_grad():
            got = lightning_index_scores(q, w, k)
    else:
        got = lightning_index_scores(q.requires_grad_(), w, k)
        got.sum().backward()
        assert q.grad is not None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("cpp" not in _decode_paths(), reason="C++ ops not available")
@pytest.mark.parametrize("S,top_k", [(11, 4), (37, 6), (5, 8), (70, 64)])
def test_decode_key_mask_op_equals_topk_mask_and_fill(S: int, top_k: int) -> None:
    """The decode step's key mask as one C++ pass (topk_mask_one) equals topk_mask + _fill_empty_rows exactly: scores
    with many ties (small integers), -inf and NaN among the allowed keys, padding (strided rows of allowed keys), a row
    with no valid key, fewer keys than top_k."""
    gen = torch.Generator().manual_seed(S + top_k)
    B = 12
    scores = torch.randint(0, 4, (B, 1, S), generator=gen).float()
    scores[1, 0, ::3] = float("-inf")
    scores[2, 0, S // 2] = float("nan")
    scores[3, 0, :] = float("-inf")
    buf = torch.rand(B, S + 7, generator=gen) > 0.3
    buf[4] = False  # no valid key
    buf[5, :S] = True
    allowed = buf[:, None, :S]  # strided rows, as the cache's slice
    ref = _fill_empty_rows(topk_mask(scores, allowed, top_k), S - 1)
    with torch.no_grad():
        got = decode_key_mask(scores, allowed, top_k)
    assert got.dtype == torch.bool and got.shape == (B, 1, S)
    assert torch.equal(got, ref)
    assert got.any(-1).all()  # every row keeps a key
    with torch.enable_grad():  # with autograd recording (a grad-requiring input) the eager form runs
        assert torch.equal(decode_key_mask(scores.requires_grad_(), allowed, top_k), ref)


@pytest.mark.parametrize("gather", [False, True])
def test_cache_with_attn_rope_and_gqa(gather: bool, monkeypatch) -> None:
    m = make(attn_rope=True, n_kv_heads=1).eval()
    monkeypatch.setattr(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", 0 if gather else 10**9)
    x = torch.randn(2, 18, 32)
    with torch.inference_mode():
        assert torch.allclose(run_cached(m, x, None, [5]), m(x)[0], atol=ATOL)


def test_repeat_interleave_and_index_select_equal_independent_runs(monkeypatch) -> None:
    m = make().eval()
    monkeypatch.setattr(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", 0)
    torch.manual_seed(9)
    prompts = torch.randn(2, 5, 32)
    conts = torch.randn(6, 12, 32)
    with torch.inference_mode():
        cache = DSACache.empty(2, m.cfg)
        m(prompts, None, cache)
        rep = cache.repeat_interleave(3)
        assert rep.length == 5 and rep.batch_size == 6
        outs = [m(conts[:, t : t + 1], None, rep)[0] for t in range(12)]
        got = torch.cat(outs, 1)
        for r in range(6):
            seq = torch.cat([prompts[r // 3], conts[r]])[None]
            assert torch.allclose(got[r], m(seq)[0][0, 5:], atol=ATOL), r
        sub = cache.index_select([1, 0])
        y = m(conts[:2, :1], None, sub)[0]
        for i, r in enumerate([1, 0]):
            seq = torch.cat([prompts[r], conts[i, :1]])[None]
            assert torch.allclose(y[i], m(seq)[0][0, 5:], atol=ATOL)
        assert cache.length == 5  # the source cache is untouched


def test_cache_overflow_and_batch_mismatch_raise() -> None:
    m = make(max_seq_len=12).eval()
    cache = DSACache.empty(2, m.cfg)
    assert cache.k.shape == (2, 2, 12, 8) and cache.index_k.shape == (2, 12, 8) and cache.key_valid.shape == (2, 12)
    with torch.inference_mode():
        m(torch.randn(2, 10, 32), None, cache)
        with pytest.raises(ValueError, match="overflow"):
            m(torch.randn(2, 3, 32), None, cache)
        assert cache.length == 10
        with pytest.raises(ValueError):
            m(torch.randn(3, 1, 32), None, cache)
        m(torch.randn(2, 2, 32), None, cache)
        assert cache.length == 12


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cached_decode_in_other_dtypes_equals_full_forward(dtype: torch.dtype, gather: bool, monkeypatch) -> None:
    """A prefill + decode with the cache in the module's dtype equals the uncached forward, with the C++ ops off (the
    PyTorch forms every dtype runs; the C++ decode ops take fp32 only). fp64 to 1e-10 (a softmax cast to fp32 once met
    the fp64 values here: "expected scalar type Float but found Double"); bf16 within bf16's rounding."""
    from glm_lightning.model import ops

    m = make().eval().to(dtype)
    monkeypatch.setattr(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", 0 if gather else 10**9)
    torch.manual_seed(8)
    x = torch.randn(2, 22, 32, dtype=torch.float64).to(dtype)
    valid = torch.ones(2, 22, dtype=torch.bool)
    valid[1, :2] = False
    with torch.inference_mode(), ops.cpp_ops(False):
        for v in (None, valid):
            full, _ = m(x, v)
            cache = DSACache.empty(2, m.cfg, dtype=dtype)
            outs = [m(x[:, :9], None if v is None else v[:, :9], cache)[0]]
            for t in range(9, 22):
                outs.append(m(x[:, t:t + 1], None if v is None else v[:, t:t + 1], cache)[0])
            got = torch.cat(outs, 1)
            ok = slice(None) if v is None else v
            assert got.dtype == dtype
            if dtype is torch.float64:
                torch.testing.assert_close(got[ok], full[ok], rtol=1e-10, atol=1e-10)
            else:  # the decode's two bmm and the prefill's SDPA round differently; outputs ~1
                assert (got[ok].float() - full[ok].float()).abs().max() < 5e-2
