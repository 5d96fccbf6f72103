"""The ablations' knobs (issue 32) against naive references: DSA without its indexer is dense causal softmax
attention, cached and uncached alike; the dense FFN is one SwiGLU of the MoE's active size; one mHC stream is a plain
residual (tested in test_mhc.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import GLMConfig, GLMModel
from glm_lightning.model.dsa import SparseAttention
from glm_lightning.model.mlp import DenseSwiGLU, dense_hidden
from glm_lightning.model.moe import MoE

DSA = dict(d_model=32, n_heads=4, head_dim=8, n_kv_heads=2, index_n_heads=2, index_head_dim=8, index_rope_dim=4,
           index_top_k=6, max_seq_len=40, init_std=0.3)


def _naive_dense_attention(m: SparseAttention, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v with QK-RMSNorm and GQA, written from the formula."""
    B, T, _ = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps) * w

    q = rms((x @ m.q_proj.weight.T).view(B, T, H, D), m.q_norm.weight).transpose(1, 2)
    k = rms((x @ m.k_proj.weight.T).view(B, T, Hkv, D), m.k_norm.weight).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = (x @ m.v_proj.weight.T).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                                   float("-inf"))
    o = logits.softmax(-1) @ v
    return o.transpose(1, 2).reshape(B, T, H * D) @ m.o_proj.weight.T


def test_dsa_without_indexer_is_dense_causal_attention():
    torch.manual_seed(0)
    m = SparseAttention(GLMConfig(**DSA, dsa_indexer=False)).train()
    assert m.indexer is None and not any("indexer" in n for n, _ in m.named_parameters())
    x = torch.randn(3, 20, 32, requires_grad=True)  # 20 keys > index_top_k 6: with an indexer it would be sparse
    y, aux = m(x)
    torch.testing.assert_close(y, _naive_dense_attention(m, x), rtol=1e-5, atol=1e-5)
    assert float(aux) == 0.0
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    with torch.no_grad():  # the sparse layer with the same weights differs at T > top_k (its keys are selected)
        sparse = SparseAttention(GLMConfig(**DSA))
        sparse.load_state_dict(m.state_dict(), strict=False)
        assert not torch.allclose(sparse(x)[0], y, atol=1e-3)


@pytest.mark.parametrize("split", [1, 7])
def test_model_without_indexer_decodes_as_its_full_forward(split):
    torch.manual_seed(0)
    model = GLMModel(GLMConfig.preset("tiny", layer_pattern="LS", dsa_indexer=False)).eval()
    ids = torch.randint(0, 256, (2, 30))  # past index_top_k 8
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        parts = [model(ids[:, :split], cache=cache).logits]
        for t in range(split, 30):
            parts.append(model(ids[:, t:t + 1], cache=cache).logits)
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-4


def test_dense_ffn_is_one_swiglu_of_the_moe_active_size():
    cfg = GLMConfig.preset("tiny", ffn="dense")
    torch.manual_seed(1)
    ffn = DenseSwiGLU(cfg)
    assert ffn.hidden == cfg.shared_expert_hidden + cfg.moe_top_k * cfg.expert_hidden == dense_hidden(cfg)
    x = torch.randn(2, 5, cfg.d_model, requires_grad=True)
    y, aux = ffn(x)
    gate, up = (x @ ffn.w_gate_up.T).split(ffn.hidden, dim=-1)
    torch.testing.assert_close(y, (F.silu(gate) * up) @ ffn.w_down.T, rtol=1e-5, atol=1e-6)
    assert float(aux) == 0.0
    y.sum().backward()
    assert ffn.w_gate_up.grad is not None and x.grad is not None
    # per token: the MoE's shared + top_k routed experts, each 3 d h, equal the dense SwiGLU's 3 d h
    moe_active = 3 * cfg.d_model * (cfg.shared_expert_hidden + cfg.moe_top_k * cfg.expert_hidden)
    assert sum(p.numel() for p in ffn.parameters()) == moe_active


def test_dense_model_counts_every_parameter_active_and_has_no_moe_layers():
    dense, moe = (GLMModel(GLMConfig.preset("tiny", ffn=f)) for f in ("dense", "moe"))
    assert all(isinstance(b.moe, DenseSwiGLU) for b in dense.blocks) and dense.moe_layers() == []
    assert all(isinstance(b.moe, MoE) for b in moe.blocks)
    nd, nm = dense.num_parameters(), moe.num_parameters()
    assert nd["total"] == nd["active"]
    cfg = moe.cfg
    router = cfg.n_layers * cfg.n_experts * cfg.d_model
    assert nm["active"] - nd["active"] == router  # equal active size but for the MoE's router
    dense.update_balance_bias()  # nothing to balance: a no-op, not an error


def test_bad_ffn_kind_is_refused():
    with pytest.raises(ValueError, match="ffn must be one of"):
        GLMConfig.preset("tiny", ffn="sparse")
