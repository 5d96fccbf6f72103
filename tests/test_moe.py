"""MoE: grouped dispatch vs a per-token reference, bias semantics, balancing simulation, gradients, buffers, size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import cext
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.moe import MoE
from glm_lightning.model.ops import moe as moe_mod
from glm_lightning.model.ops import reference, thresholds

from conftest import few_row_matmul_case


def small_cfg(**kw) -> GLMConfig:
    base = dict(d_model=16, n_heads=2, n_kv_heads=2, n_experts=4, moe_top_k=2, expert_hidden=12, shared_expert_hidden=8,
                routed_scaling=1.5, balance_bias_rate=1e-2, balance_loss_weight=1e-2, init_std=0.3)
    base.update(kw)
    return GLMConfig(**base)


def make(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    return MoE(small_cfg(**kw))


def naive_forward(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer from the package's reference forms: route, experts token by token, shared expert."""
    B, T, d = x.shape
    xf = x.reshape(B * T, d)
    idx, w = reference.moe_route(torch.sigmoid(xf @ m.router_weight.T), m.expert_bias, m.top_k, m.routed_scaling)
    y = reference.moe_experts(xf, idx, w, m.w_gate_up, m.w_down)
    if m.shared_gate_up is not None:
        y = y + reference.swiglu(xf, m.shared_gate_up, m.shared_down)
    return y.view(B, T, d)


def naive_balance_loss(m: MoE, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    s = torch.sigmoid(x @ m.router_weight.T)
    idx, _ = reference.moe_route(s, m.expert_bias, m.top_k, m.routed_scaling)
    return reference.moe_balance_loss(s, idx, m.n_experts, m.balance_loss_weight)


def grads(m: MoE, x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [x] + list(m.parameters())
    return list(torch.autograd.grad(loss, params, allow_unused=True))


@pytest.mark.parametrize("shared", [8, 0])
def test_dispatch_matches_per_token_reference(shared):
    m = make(shared_expert_hidden=shared)
    torch.manual_seed(1)
    m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, -5.0]))  # expert 3 never chosen: an empty expert
    x = torch.randn(3, 7, 16, requires_grad=True)
    proj = torch.randn(3, 7, 16)

    y, aux = m(x)
    y_ref = naive_forward(m, x)
    aux_ref = naive_balance_loss(m, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-5, atol=1e-8)

    g = grads(m, x, (y * proj).sum() + aux)
    g_ref = grads(m, x, (y_ref * proj).sum() + aux_ref)
    for a, b in zip(g, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the empty expert gets an exactly zero gradient and no NaN
    names = [n for n, _ in m.named_parameters()]
    g_w_down = g[1 + names.index("w_down")]
    assert torch.count_nonzero(g_w_down[3]) == 0 and torch.count_nonzero(g_w_down[:3]) > 0


def test_bias_changes_selection_but_not_weights():
    m = make()
    torch.manual_seed(2)
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        s, idx0, w0 = m.route(x)
        y0, _ = m(x)

        # a bias that flips the choice of token 0 to an expert it had not chosen
        e_new = next(e for e in range(m.n_experts) if e not in idx0[0, 0].tolist())
        m.expert_bias[e_new] = 10.0
        s1, idx1, w1 = m.route(x)
        assert torch.equal(s1, s)
        assert e_new in idx1[0, 0].tolist() and not torch.equal(idx1.sort(-1).values, idx0.sort(-1).values)
        expected = s.gather(-1, idx1)
        expected = expected / expected.sum(-1, keepdim=True) * m.routed_scaling
        torch.testing.assert_close(w1, expected, rtol=0, atol=0)
        torch.testing.assert_close(m(x)[0], naive_forward(m, x), rtol=1e-5, atol=1e-6)

        # a bias that leaves every selection unchanged leaves the output bit-identical
        m.expert_bias.copy_(1e-4 * torch.tensor([1.0, -2.0, 0.5, 3.0]))
        _, idx2, w2 = m.route(x)
        assert torch.equal(idx2.sort(-1).values, idx0.sort(-1).values)
        y2, _ = m(x)
        assert torch.equal(y2, y0)


def test_bias_update_simulation_balances_skewed_router():
    E = 8
    m = make(seed=3, n_experts=E, moe_top_k=2, balance_bias_rate=1e-2, balance_loss_weight=0.0)
    m.train()
    torch.manual_seed(4)
    u = F.normalize(torch.randn(16), dim=0)
    with torch.no_grad():  # tokens share a direction u that the router strongly prefers for the low-index experts
        m.router_weight.copy_(0.3 * torch.randn(E, 16) + torch.linspace(2.0, -2.0, E)[:, None] * u)

    def step() -> torch.Tensor:
        x = torch.randn(4, 32, 16) * 0.5 + 2.0 * u  # a fresh batch per optimizer step
        with torch.enable_grad():
            m(x)
        assert m.load_counts.sum() == x.shape[0] * x.shape[1] * m.top_k
        m.update_balance_bias()
        assert m.load_counts.sum() == 0
        load = m.expert_load()
        torch.testing.assert_close(load.sum(), torch.tensor(1.0))
        return load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny steps: extra threads only add overhead on a shared CPU
    try:
        first = step()
        assert first.max() / first.mean() > 3.0  # strongly skewed to begin with
        assert m.expert_bias[0] < 0 and m.expert_bias[-1] > 0  # overloaded down, underloaded up
        loads = [step() for _ in range(300)]
    finally:
        torch.set_num_threads(threads)
    final = torch.stack(loads[-50:]).mean(0)  # average out the per-batch sampling noise
    assert final.max() / final.mean() < 1.15
    assert m.expert_bias.abs().max() <= 301 * m.balance_bias_rate + 1e-6


def test_router_gradients_from_output_and_balance_loss():
    m = make()
    m.train()
    torch.manual_seed(5)
    x = torch.randn(2, 16, 16)
    y, aux = m(x)
    assert m.load_counts.min() > 0  # every expert used, so every parameter is reachable

    (g_out,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), [m.router_weight], retain_graph=True)
    assert g_out.abs().sum() > 0
    g_aux = torch.autograd.grad(aux, list(m.parameters()), retain_graph=True, allow_unused=True)
    names = [n for n, _ in m.named_parameters()]
    assert g_aux[names.index("router_weight")].abs().sum() > 0
    assert all(g is None or g.abs().sum() == 0 for n, g in zip(names, g_aux) if n != "router_weight")

    (y.sum() + aux).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_balance_loss_is_per_sequence_formula():
    m = make(seed=7, n_experts=6)
    torch.manual_seed(8)
    x = torch.randn(4, 9, 16)
    x[0] += 3.0 * m.router_weight[0].detach()  # sequences with different routing statistics
    _, aux = m(x)
    aux_ref = naive_balance_loss(m, x)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-5, atol=1e-8)
    (g,) = torch.autograd.grad(aux, [m.router_weight])
    (g_ref,) = torch.autograd.grad(aux_ref, [m.router_weight])
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-9)


def test_balance_loss_zero_weight():
    m = make(balance_loss_weight=0.0)
    _, aux = m(torch.randn(2, 5, 16))
    assert aux.ndim == 0 and aux.item() == 0.0


def test_top1_no_renormalisation_router_gets_gradient():
    m = make(moe_top_k=1, routed_scaling=1.0, balance_loss_weight=0.0)
    torch.manual_seed(6)
    x = torch.randn(2, 6, 16)
    s, idx, w = m.route(x)
    torch.testing.assert_close(w, s.gather(-1, idx))
    assert (w < 0.999).all()  # not renormalised to 1
    y, _ = m(x)
    torch.testing.assert_close(y, naive_forward(m, x), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert m.router_weight.grad.abs().sum() > 0


def test_bias_buffer_and_load_counting():
    m = make()
    names = {n for n, _ in m.named_parameters()}
    assert "expert_bias" not in names and all(p is not m.expert_bias for p in m.parameters())
    sd = m.state_dict()
    assert "expert_bias" in sd and sd["expert_bias"].dtype == torch.float32
    assert "load_counts" not in sd and "last_load" not in sd

    m.expert_bias.fill_(0.5)
    m2 = make(seed=9)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.expert_bias, m.expert_bias)

    x = torch.randn(2, 5, 16)
    m.eval()
    m(x)
    m.train()
    with torch.no_grad():
        m(x)
    assert m.load_counts.sum() == 0
    bias = m.expert_bias.clone()
    m.update_balance_bias()  # nothing counted: no-op
    assert torch.equal(m.expert_bias, bias) and m.expert_load().sum() == 0
    m(x)
    assert m.load_counts.sum() == 2 * 5 * m.top_k


@pytest.mark.parametrize("shared", [8, 0])
def test_parameter_count(shared):
    cfg = small_cfg(shared_expert_hidden=shared)
    m = MoE(cfg)
    E, d, h, hs = cfg.n_experts, cfg.d_model, cfg.expert_hidden, cfg.shared_expert_hidden
    assert sum(p.numel() for p in m.parameters()) == E * d + E * 3 * d * h + 3 * d * hs
    full = GLMConfig()
    assert sum(p.numel() for p in MoE(full).parameters()) == (
        full.n_experts * full.d_model + full.n_experts * 3 * full.d_model * full.expert_hidden
        + 3 * full.d_model * full.shared_expert_hidden)


def out_and_grads(m: MoE, x: torch.Tensor, proj: torch.Tensor, monkeypatch, use_cpp: bool):
    """The layer's output and every gradient with the C++ ops on or off (cext.available patched)."""
    monkeypatch.setattr(cext, "available", lambda: use_cpp)
    y, aux = m(x)
    return y.detach(), grads(m, x, (y * proj).sum() + aux)


needs_cext = pytest.mark.skipif(not cext.available(), reason="C++ ops not available")


@needs_cext
@pytest.mark.parametrize("shape", [(4, 5, 192, 768), (3, 16, 20, 7), (2, 9, 33, 12), (10, 9, 40, 21)])
def test_small_matmul_equals_bmm_on_the_real_rows(shape):
    """glm_lightning::small_matmul (csrc/small_matmul.cpp) equals x @ W^T (+ bias) per matrix on the first counts[e]
    rows and writes zeros on the padding rows, for sizes on and off its 16-float lanes and 4-row blocks (the last
    shape has every count 0..9, so every leading block size); counts None takes every row."""
    E, M, n_in, n_out = shape
    x, W, bias, counts = few_row_matmul_case(shape)
    ref = torch.bmm(x, W.transpose(1, 2))
    for b in (None, bias):
        y = torch.ops.glm_lightning.small_matmul(x, W, counts, b)
        for e, c in enumerate(counts.tolist()):
            torch.testing.assert_close(y[e, :c], ref[e, :c] + (0 if b is None else b[e]), rtol=1e-5, atol=1e-5)
            assert torch.count_nonzero(y[e, c:]) == 0
    torch.testing.assert_close(torch.ops.glm_lightning.small_matmul(x, W), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="counts"):
        torch.ops.glm_lightning.small_matmul(x, W, torch.full((E,), M + 1))
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.glm_lightning.small_matmul(x, W, counts, bias[0])


@needs_cext
def test_small_matmul_output_does_not_depend_on_its_column():
    """One weight row's outputs are the same bit for bit whichever output (and packed panel lane) it falls in: every
    output sums its products in the same order (the decode step's linears rely on it: a row's output must not depend
    on where it falls)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=gen)
    W = torch.randn(5, 64, generator=gen)  # columns 0-3 in one block, column 4 alone
    y = torch.ops.glm_lightning.small_matmul(x, W)
    y4 = torch.ops.glm_lightning.small_matmul(x, W[[4, 4, 4, 4]])  # column 4's dot product inside a block
    for j in range(4):
        assert torch.equal(y4[:, j], y[:, 4])


@needs_cext
@pytest.mark.parametrize("tokens", [1, 5, 9, 64, 65])
def test_decode_experts_equal_the_grouped_gemm(tokens, monkeypatch):
    """Without autograd, calls of <= SMALL_TOKENS tokens take the small_matmul path; it equals the grouped-GEMM path
    (forced by SMALL_TOKENS = 0) and the per-token reference; larger calls keep the grouped GEMM."""
    m = make(seed=3, d_model=32, expert_hidden=24)
    m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -5.0]))  # an expert with no tokens
    x = torch.randn(1, tokens, 32)
    monkeypatch.setattr(thresholds, "SMALL_TOKENS", 64)  # the AVX-512 table's value (0 on AVX2: BLAS always)
    calls = []
    real = moe_mod._experts_small
    monkeypatch.setattr(moe_mod, "_experts_small", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        y_small = m(x, want_aux=False)[0]
        assert bool(calls) == (tokens <= thresholds.SMALL_TOKENS)
        monkeypatch.setattr(thresholds, "SMALL_TOKENS", 0)
        y_grouped = m(x, want_aux=False)[0]
    torch.testing.assert_close(y_small, y_grouped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_small, naive_forward(m, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [8, 0])
def test_segment_experts_equal_the_padded_batch_with_gradients(shared, monkeypatch):
    """Large calls with unequal loads run each expert on its own segment (no padding, _SegmentExperts): values and
    every gradient equal the padded grouped GEMM (forced by SEGMENT_TOKENS above the call) and the per-token
    reference; an expert without tokens gets an exactly zero gradient."""
    m = make(seed=4, shared_expert_hidden=shared)
    m.expert_bias.copy_(torch.tensor([0.4, 0.0, -0.1, -5.0]))  # unequal loads and an empty expert
    x = torch.randn(2, 9, 16, requires_grad=True)
    proj = torch.randn(2, 9, 16)
    calls = []
    real = moe_mod._SegmentExperts.apply
    monkeypatch.setattr(moe_mod._SegmentExperts, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 18)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING", 1.0)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING_WORK", 0)
    y, aux = m(x)
    g = grads(m, x, (y * proj).sum() + aux)
    assert calls
    monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 19)
    y_pad, aux_pad = m(x)
    g_pad = grads(m, x, (y_pad * proj).sum() + aux_pad)
    assert len(calls) == 1
    torch.testing.assert_close(y, y_pad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, naive_forward(m, x), rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_pad):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    names = [n for n, _ in m.named_parameters()]
    assert torch.count_nonzero(g[1 + names.index("w_down")][3]) == 0
    assert torch.count_nonzero(g[1 + names.index("w_gate_up")][3]) == 0


def test_segment_experts_gradcheck():
    _SegmentExperts = moe_mod._SegmentExperts
    gen = torch.Generator().manual_seed(5)
    N, K, E, d, h = 5, 2, 3, 4, 3
    x = torch.randn(N, d, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(N, K, dtype=torch.float64, generator=gen, requires_grad=True)
    wgu = torch.randn(E, 2 * h, d, dtype=torch.float64, generator=gen, requires_grad=True)
    wd = torch.randn(E, d, h, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]])  # expert 1 has no tokens
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(N * K))
    assert torch.autograd.gradcheck(lambda *a: _SegmentExperts.apply(*a, order // K, pos, counts),
                                    (x, w, wgu, wd), fast_mode=True)


def _segment_probe(monkeypatch) -> tuple:
    """(model, x, calls): make(seed=6) loaded about evenly by 400 tokens x (some padding in the batch), with every
    _SegmentExperts call appended to calls."""
    m = make(seed=6)
    calls = []
    real = moe_mod._SegmentExperts.apply
    monkeypatch.setattr(moe_mod._SegmentExperts, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 400, 16)
    m.expert_bias.copy_(torch.tensor([0.0, -0.02, 0.01, 0.02]))
    return m, x, calls


def test_segment_experts_for_balanced_loads_from_segment_tokens(monkeypatch):
    """With SEGMENT_PADDING 1.0 (shipped), calls from SEGMENT_TOKENS on run the segments even with balanced loads once
    the padding rows' work reaches SEGMENT_PADDING_WORK per expert; smaller calls and less padding work keep the
    padded batch."""
    assert thresholds.DEFAULTS["SEGMENT_PADDING"] == 1.0
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING", 1.0)
    m, x, calls = _segment_probe(monkeypatch)
    with torch.no_grad():
        loads = torch.bincount(m.route(x.view(400, 16))[1].flatten(), minlength=4)
        assert 800 < 4 * int(loads.max()) < 1.25 * 800  # balanced, some padding
        work = (4 * int(loads.max()) - 800) * m.d_model * m.expert_hidden / 4  # the padding's rows x d x h per expert
        monkeypatch.setattr(thresholds, "SEGMENT_PADDING_WORK", work)
        monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 401)
        m(x)
        assert not calls
        monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 400)
        m(x)
        assert calls == [1]
        monkeypatch.setattr(thresholds, "SEGMENT_PADDING_WORK", work + 1)
        m(x)
    assert calls == [1]


def test_segment_choice_at_the_model_sizes():
    """The shipped thresholds: flash-25m's 4,096 tokens (d 192, h 384, 8 experts) run the segments from ~14 padding
    rows per expert; the dispatch-bound study model's 1,024 tokens (d 48, h 96, 4 experts) keep the padded batch at
    its usual loads (largest ~1.1x the mean) and switch where the padding is large."""
    d = thresholds.DEFAULTS
    segments = moe_mod._segments
    assert d["SEGMENT_TOKENS"] <= 4096 and d["SEGMENT_PADDING"] <= 1.01
    old = (thresholds.SEGMENT_TOKENS, thresholds.SEGMENT_PADDING, thresholds.SEGMENT_PADDING_WORK)
    try:
        thresholds.SEGMENT_TOKENS, thresholds.SEGMENT_PADDING = 1024, d["SEGMENT_PADDING"]
        thresholds.SEGMENT_PADDING_WORK = d["SEGMENT_PADDING_WORK"]
        assert segments(4096, 8192, 1040, 8, 192 * 384)          # 1.016x the mean
        assert not segments(4096, 8192, 1032, 8, 192 * 384)      # 1.008x
        assert not segments(1024, 2048, 563, 4, 48 * 96)         # 1.1x
        assert segments(1024, 2048, 800, 4, 48 * 96)             # 1.56x
        # bf16 GEMMs (bf16-mixed training) keep the padded batch up to SEGMENT_PADDING_BF16 (1.25)
        assert not segments(4096, 8192, 1040, 8, 192 * 384, bf16=True)
        assert not segments(4096, 8192, 1270, 8, 192 * 384, bf16=True)   # 1.24x
        assert segments(4096, 8192, 1290, 8, 192 * 384, bf16=True)       # 1.26x
    finally:
        thresholds.SEGMENT_TOKENS, thresholds.SEGMENT_PADDING, thresholds.SEGMENT_PADDING_WORK = old


def test_segment_experts_only_for_unequal_loads(monkeypatch):
    """With SEGMENT_PADDING above 1, balanced loads keep the padded batch (fewer dispatched ops); a skewed router
    switches to the segments."""
    monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 64)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING", 1.25)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING_WORK", 0)
    m, x, calls = _segment_probe(monkeypatch)
    with torch.no_grad():
        loads = torch.bincount(m.route(x.view(400, 16))[1].flatten(), minlength=4)
        assert 4 * int(loads.max()) < thresholds.SEGMENT_PADDING * 800
        m(x)
        assert not calls
        m.expert_bias.copy_(torch.tensor([3.0, 0.0, 0.0, -5.0]))  # expert 0 always chosen: load 400 of 800
        m(x)
    assert calls == [1]


@needs_cext
@pytest.mark.parametrize("shared", [0, 12])
def test_cpp_swiglu_equals_the_eager_activation(shared, monkeypatch):
    """csrc/swiglu.cpp (the experts' and the shared expert's SiLU(gate) * up, forward and backward in one pass each)
    against the eager activation: the layer's output and every gradient; the ops alone on odd shapes (incl. large
    |gate|) and fp64 gradcheck of the shared expert's Function."""
    m = make(seed=6, shared_expert_hidden=shared)
    x = torch.randn(2, 9, 16, requires_grad=True)
    proj = torch.randn(2, 9, 16)
    (y_c, g_c), (y_e, g_e) = (out_and_grads(m, x, proj, monkeypatch, use_cpp) for use_cpp in (True, False))
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_c, g_e):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(cext, "available", lambda: True)
    hgu = torch.cat([torch.randn(3, 5, 7) * 30, torch.randn(3, 5, 7)], dim=-1)  # SiLU saturated both ways
    gate, up = hgu.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.glm_lightning.swiglu(hgu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    da = torch.randn(3, 5, 7)
    ref = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * F.silu(gate)], dim=-1)
    torch.testing.assert_close(torch.ops.glm_lightning.swiglu_backward(da, hgu), ref, rtol=1e-5, atol=1e-6)
    hd = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    for use_cpp in (True, False):  # the shared expert's Function runs the eager forms without the C++ ops
        monkeypatch.setattr(cext, "available", lambda use_cpp=use_cpp: use_cpp)
        assert torch.autograd.gradcheck(moe_mod._SwiGLU.apply, (hd,))


@needs_cext
@pytest.mark.parametrize("shared", [0, 12])
def test_cpp_row_moves_equal_the_eager_forms(shared, monkeypatch):
    """csrc/moe_rows.cpp (the grouped GEMM's scatter into the padded batch, gated combine, gate gradient and dx) against
    the eager forms of the same helpers: the layer's output and every gradient, with an empty expert; fp64 gradcheck of
    _GroupedExperts on both paths; a slot out of range is an error, not a write."""
    m = make(seed=8, shared_expert_hidden=shared)
    m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, -5.0]))  # expert 3 never chosen
    x = torch.randn(2, 9, 16, requires_grad=True)
    proj = torch.randn(2, 9, 16)
    (y_c, g_c), (y_e, g_e) = (out_and_grads(m, x, proj, monkeypatch, use_cpp) for use_cpp in (True, False))
    torch.testing.assert_close(y_c, y_e, rtol=1e-6, atol=1e-7)  # (the eager SwiGLU's exp differs in the last bits)
    torch.testing.assert_close(y_c, naive_forward(m, x).detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(g_c, g_e):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    gen = torch.Generator().manual_seed(9)
    N, K, E, d, h, cap = 5, 2, 3, 4, 3, 5
    xs = torch.randn(N, d, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(N, K, dtype=torch.float64, generator=gen, requires_grad=True)
    wgu = torch.randn(E, 2 * h, d, dtype=torch.float64, generator=gen, requires_grad=True)
    wd = torch.randn(E, d, h, dtype=torch.float64, generator=gen, requires_grad=True)
    # token n's choices: experts (0, 2) or (2, 0); expert e's j-th assignment at e * cap + j, expert 1 empty
    slot = torch.tensor([0, 10, 11, 1, 2, 12, 13, 3, 4, 14])
    for use_cpp in (True, False):
        monkeypatch.setattr(cext, "available", lambda use_cpp=use_cpp: use_cpp)
        assert torch.autograd.gradcheck(lambda *a: moe_mod._GroupedExperts.apply(*a, slot, cap), (xs, w, wgu, wd),
                                        fast_mode=True)
    monkeypatch.setattr(cext, "available", lambda: True)
    # top-2: the combine is round(w0 y0) + round(w1 y1), bit for bit the index_add_ of the products it replaced
    # (moe_rows.cpp is built without multiply-add contraction)
    rows, slot2 = torch.randn(50, 48, generator=gen), torch.randint(0, 50, (40,), generator=gen)
    w2 = torch.rand(40, generator=gen)
    combined = torch.ops.glm_lightning.rows_gather_sum(rows, slot2, 2, w2)
    products = rows.index_select(0, slot2) * w2[:, None]
    assert torch.equal(combined, torch.zeros(20, 48).index_add_(0, torch.arange(20).repeat_interleave(2), products))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.glm_lightning.rows_gather_sum(torch.randn(4, 3), torch.tensor([0, 4]), 2, None)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.glm_lightning.rows_scatter(torch.randn(1, 3), torch.tensor([0, -1]), 2, None, 4)


@needs_cext
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_cpp_routing_equals_the_eager_route_balance_loss_and_rows(top_k):
    """csrc/moe_route.cpp (_Routing) against the reference route and balance loss and assignment_rows from the same
    scores, 3 sequences: the same choices (as sets), gates (bit for bit at top-2), counts and rows, the balance loss,
    and the scores' gradient through gates and loss; fp64 gradcheck; ties go to the lower expert."""
    _Routing = moe_mod._Routing

    m = make(seed=11, moe_top_k=top_k)
    m.expert_bias.copy_(torch.tensor([0.2, -0.1, 0.0, 0.05]))
    B, T, E = 3, 7, 4
    s = torch.sigmoid(torch.randn(B * T, E, generator=torch.Generator().manual_seed(12))).requires_grad_()
    w, aux, idx, counts, pos, slot = _Routing.apply(s, m.expert_bias, top_k, m.routed_scaling, B,
                                                    m.balance_loss_weight)
    idx_e, w_e = reference.moe_route(s, m.expert_bias, top_k, m.routed_scaling)
    aux_e = reference.moe_balance_loss(s.view(B, T, E), idx_e.view(B, T, top_k), E, m.balance_loss_weight)
    order, order_e = idx.sort(-1), idx_e.sort(-1)
    assert torch.equal(order.values, order_e.values)
    w_sorted, w_e_sorted = w.gather(-1, order.indices), w_e.gather(-1, order_e.indices)
    if top_k == 2:
        assert torch.equal(w_sorted, w_e_sorted)
    torch.testing.assert_close(w_sorted, w_e_sorted, rtol=1e-6, atol=0)
    assert torch.equal(counts, torch.bincount(idx_e.reshape(-1), minlength=E))
    pos_e, slot_e = moe_mod.assignment_rows(idx, counts.tolist())  # the eager rows of the op's own choice order
    assert torch.equal(pos, pos_e) and torch.equal(slot, slot_e)
    torch.testing.assert_close(aux, aux_e, rtol=1e-5, atol=0)
    proj = torch.randn(B * T, top_k, generator=torch.Generator().manual_seed(13))
    (g,) = torch.autograd.grad((w * proj).sum() + 3.0 * aux, s)
    proj_e = torch.zeros(B * T, E).scatter_(1, idx, proj).gather(1, idx_e)  # the same weights on the eager order
    (g_e,) = torch.autograd.grad((w_e * proj_e).sum() + 3.0 * aux_e, s)
    torch.testing.assert_close(g, g_e, rtol=1e-5, atol=1e-7)
    s64 = s.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: _Routing.apply(t, m.expert_bias, top_k, m.routed_scaling, B, m.balance_loss_weight)[:2], (s64,))
    tied = torch.full((2, E), 0.5)
    _, _, idx_t, *_ = torch.ops.glm_lightning.moe_route(tied, torch.zeros(E), top_k, 1.0, 1, 0.0)
    assert idx_t.tolist() == [list(range(top_k))] * 2


@needs_cext
def test_cpp_moe_ops_on_bf16_compute_in_fp32_and_round_once():
    """bf16-mixed training runs the SwiGLU and the row moves between the experts' bf16 GEMMs on bf16 tensors: each op
    equals its fp32 computation on the bf16 values rounded to bf16 once (the scatter and the combine bit for bit, the
    SwiGLU and the gate gradient to the ulp a different exp or summation order can move), outputs bf16; and the
    layer under autocast takes these ops (no eager SiLU)."""
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    ops = torch.ops.glm_lightning
    hgu = torch.cat([torch.randn(7, 3, 70, generator=gen) * 30, torch.randn(7, 3, 70, generator=gen)], -1).to(bf)
    da = torch.randn(7, 3, 70, generator=gen).to(bf)
    g, u = hgu.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    ulp = dict(rtol=2 ** -8, atol=1e-6)
    a = ops.swiglu(hgu)
    assert a.dtype == bf
    torch.testing.assert_close(a.float(), (F.silu(g) * u).to(bf).float(), **ulp)
    dhgu = ops.swiglu_backward(da, hgu)
    ref = torch.cat([da.float() * u * s * (1 + g * (1 - s)), da.float() * g * s], -1).to(bf)
    assert dhgu.dtype == bf
    torch.testing.assert_close(dhgu.float(), ref.float(), **ulp)
    N, K, d, R = 30, 2, 40, 70
    x, rows = torch.randn(N, d, generator=gen).to(bf), torch.randn(R, d, generator=gen).to(bf)
    slot, w = torch.randperm(R, generator=gen)[:N * K], torch.rand(N * K, generator=gen).to(bf)
    rep = x.float().repeat_interleave(K, 0)
    for scale in (None, w):
        want = torch.zeros(R, d).index_copy_(0, slot, rep if scale is None else rep * w.float()[:, None]).to(bf)
        assert torch.equal(ops.rows_scatter(x, slot, K, scale, R), want)
    picked = rows.float().index_select(0, slot)
    want = (picked * w.float()[:, None]).view(N, K, d)
    assert torch.equal(ops.rows_gather_sum(rows, slot, K, w), (want[:, 0] + want[:, 1]).to(bf))
    dot = ops.rows_dot(x, rows, slot, K)
    assert dot.dtype == bf
    torch.testing.assert_close(dot.float(), (rep * picked).sum(-1).to(bf).float(), **ulp)
    m = make(seed=5, shared_expert_hidden=12)
    xin = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16), torch.profiler.profile() as prof:
        m(xin)[0].float().sum().backward()
    names = {e.name for e in prof.events()}
    assert "glm_lightning::swiglu" in names and "glm_lightning::swiglu_backward" in names
    assert "aten::silu" not in names and "glm_lightning::rows_gather_sum" in names


@needs_cext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d", [40, 19])
def test_rows_scatter_dot_equals_rows_scatter_and_rows_dot(dtype, d):
    """The experts' backward first pass as one op: bit for bit (rows_scatter(dy, slot, K, gates, R), rows_dot(dy, y,
    slot, K)), padding rows (no slot) zero; a d not a multiple of 8 takes the dot's tail."""
    gen = torch.Generator().manual_seed(7)
    ops = torch.ops.glm_lightning
    N, K, R = 30, 2, 70
    dy, y = torch.randn(N, d, generator=gen).to(dtype), torch.randn(R, d, generator=gen).to(dtype)
    slot, w = torch.randperm(R, generator=gen)[:N * K], torch.rand(N * K, generator=gen).to(dtype)
    y[slot[0]] = float("nan")  # a named row's old content must not leak into the scatter
    out, dots = ops.rows_scatter_dot(dy, y, slot, K, w)
    assert torch.equal(out, ops.rows_scatter(dy, slot, K, w, R))
    assert torch.equal(dots[1:], ops.rows_dot(dy, y, slot, K)[1:]) and torch.isnan(dots[0])
    unnamed = torch.ones(R, dtype=torch.bool).index_fill_(0, slot, False)
    assert torch.count_nonzero(out[unnamed]) == 0
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rows_scatter_dot(dy, y, torch.cat([slot[:-1], torch.tensor([R])]), K, w)


@needs_cext
@pytest.mark.parametrize("segments", [False, True])
def test_experts_backward_takes_the_fused_scatter_dot(segments, monkeypatch):
    """Both expert forms' backward run rows_scatter_dot (not rows_scatter + rows_dot), with the gradients of the
    separate ops (patched in for the fused one) bit for bit."""
    m = make(seed=8)
    monkeypatch.setattr(thresholds, "SEGMENT_TOKENS", 18 if segments else 10 ** 9)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING", 1.0)
    monkeypatch.setattr(thresholds, "SEGMENT_PADDING_WORK", 0)
    x = torch.randn(2, 9, 16, requires_grad=True)
    with torch.profiler.profile() as prof:
        y, _ = m(x)
        g = grads(m, x, (y * torch.linspace(-1, 1, 16)).sum())
    names = [e.name for e in prof.events()]
    assert "glm_lightning::rows_scatter_dot" in names and "glm_lightning::rows_dot" not in names
    monkeypatch.setattr(moe_mod, "_rows_scatter_dot", lambda dy, yy, slot, K, gates: (
        moe_mod._rows_scatter(dy, slot, K, gates, yy.shape[0]), moe_mod._rows_dot(dy, yy, slot, K)))
    y2, _ = m(x)
    g2 = grads(m, x, (y2 * torch.linspace(-1, 1, 16)).sum())
    assert torch.equal(y, y2)
    for a, b in zip(g, g2):
        assert (a is None and b is None) or torch.equal(a, b)
