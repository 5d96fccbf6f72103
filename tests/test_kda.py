"""Kimi Delta Attention: chunked == recurrent (values, states, gradients), causality, pads, caches, gates, grads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import cext, ops
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.kda import KDACache, KDAttention
from glm_lightning.model.ops import kda_chunked, kda_core
from glm_lightning.model.ops.kda_chunkwise import scan, scan_backward
from glm_lightning.model.ops.kda_recurrent import SEGMENT, recurrent_cpp
from glm_lightning.model.ops.kda_recurrent import _KDARecurrentCpp as KDARecurrentCpp
from glm_lightning.model.ops.kda_decode import conv_step_, delta_step_
from glm_lightning.model.ops.kda_inputs import _ShortConvCpp as ShortConvSiLU
from glm_lightning.model.ops.reference import kda_recurrent

LB = -5.0
# the chunk hand-off: PyTorch loop (False), the C++ op (True; skipped when GLM_LIGHTNING_EXT=0 or it cannot be built)
HANDOFF = pytest.mark.parametrize("fused", [
    False, pytest.param(True, marks=pytest.mark.skipif(not cext.available(), reason="C++ ops not available"))],
    ids=["eager", "cpp"])


def _inputs(B, T, H, K, V, dtype=torch.float32, seed=0, lb=LB):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = lb * torch.rand(B, T, H, K, generator=gen, dtype=dtype)  # the safe gate's range [lb, 0]
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, s0


def _run_with_grads(fn, inputs, seed=1):
    xs = [x.clone().requires_grad_() for x in inputs]
    o, s = fn(*xs)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ws = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    grads = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), xs)
    return o.detach(), s.detach(), grads


def _cfg(**kw):
    base = dict(d_model=32, n_heads=2, head_dim=8, n_kv_heads=2, kda_chunk_size=8, max_seq_len=64, init_std=0.2)
    base.update(kw)
    return GLMConfig(**base)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = KDAttention(_cfg(**kw))
    with torch.no_grad():  # spread the decay over the whole safe-gate range so the state hand-off matters
        layer.dt_bias.normal_(0.0, 2.0)
        layer.A_log.normal_(0.0, 0.5)
    return layer


def pytorch_form(fn, *args):
    """fn with the C++ ops switched off."""
    with ops.cpp_ops(False):
        return fn(*args)


class StateScan(torch.autograd.Function):
    """The chunk hand-off S_{n+1} = P_n S_n + R_n (P [N, M, K, K], R [N, M, K, V], S_0 [M, K, V] -> all states) with
    the backward the chunked core uses (dS_n = dS_n(direct) + P_n^T dS_{n+1}, dR_n = dS_{n+1}, dP_n = dS_{n+1} S_n^T),
    on its own so that it can be gradchecked; ``cpp`` picks the C++ loops."""

    @staticmethod
    def forward(ctx, P, R, S0, cpp=False):
        ctx.cpp = cpp
        S_all = scan(P, R, S0, cpp)
        ctx.save_for_backward(P, S_all)
        return S_all

    @staticmethod
    def backward(ctx, grad):
        P, S_all = ctx.saved_tensors
        g = scan_backward(grad, P, ctx.cpp)
        g_next = g[1:]
        return torch.matmul(g_next, S_all[:-1].transpose(-1, -2)), g_next, g[0], None


# ------------------------------------------------------------------------------------------------------------------
# pure functions
# ------------------------------------------------------------------------------------------------------------------
@HANDOFF
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("T", [1, 5, 31, 33, 70])
def test_chunked_matches_recurrent_fp32(chunk, T, fused):
    inputs = _inputs(2, T, 2, 8, 6, seed=T)
    o_r, s_r, g_r = _run_with_grads(lambda q, k, v, g, b, s0: kda_recurrent(q, k, v, g, b, s0), inputs)
    o_c, s_c, g_c = _run_with_grads(lambda q, k, v, g, b, s0: kda_chunked(q, k, v, g, b, chunk, s0, cpp=fused),
                                    inputs)
    assert o_c.dtype == s_c.dtype == torch.float32
    assert o_c.shape == o_r.shape == (2, T, 2, 6) and s_c.shape == (2, 2, 8, 6)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=2e-6)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=2e-6)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g_c, g_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-5, msg=lambda m, name=name: f"grad {name}: {m}")


@HANDOFF
def test_chunked_matches_recurrent_fp64_and_gradcheck(fused):
    inputs = _inputs(2, 37, 3, 8, 5, dtype=torch.float64, seed=3)
    o_r, s_r, g_r = _run_with_grads(lambda q, k, v, g, b, s0: kda_recurrent(q, k, v, g, b, s0), inputs)
    o_c, s_c, g_c = _run_with_grads(lambda q, k, v, g, b, s0: kda_chunked(q, k, v, g, b, 16, s0, cpp=fused), inputs)
    assert o_c.dtype == torch.float64
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=1e-12)
    for a, b in zip(g_c, g_r):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    small = [x.clone().requires_grad_() for x in _inputs(1, 6, 1, 3, 2, dtype=torch.float64, seed=4)]
    assert torch.autograd.gradcheck(lambda *xs: kda_chunked(*xs[:5], 4, xs[5], cpp=fused), small, fast_mode=True)


@pytest.mark.parametrize("lb,chunk", [(-5.0, 32), (-10.0, 16)])
def test_chunked_no_overflow_at_the_gate_bound(lb, chunk):
    """Strongest allowed decay everywhere (and half the channels at the bound): finite and equal to the recurrence."""
    q, k, v, g, beta, s0 = _inputs(1, 2 * chunk + 3, 2, 8, 4, seed=5, lb=lb)
    for g_test in (torch.full_like(g, lb), torch.where(torch.rand_like(g) < 0.5, lb, -1e-3)):
        inputs = (q, k, v, g_test, beta, s0)
        o_r, s_r, g_r = _run_with_grads(lambda *xs: kda_recurrent(*xs[:5], xs[5]), inputs)
        for bound in (-lb, None):  # the bound given, or read from the data
            o_c, s_c, g_c = _run_with_grads(lambda *xs: kda_chunked(*xs[:5], chunk, xs[5], gate_bound=bound), inputs)
            assert all(torch.isfinite(t).all() for t in (o_c, s_c, *g_c))
            torch.testing.assert_close(o_c, o_r, rtol=0, atol=5e-6)
            torch.testing.assert_close(s_c, s_r, rtol=0, atol=5e-6)
            for a, b in zip(g_c, g_r):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5)


def test_identity_steps_in_pure_functions():
    """Steps with g = 0, beta = 0, k = 0 leave the state alone: inserting them changes nothing at the real steps."""
    q, k, v, g, beta, s0 = _inputs(1, 20, 2, 8, 4, seed=6)
    real = torch.tensor([i % 3 != 1 for i in range(20)])
    k_pad, g_pad, b_pad = k.clone(), g.clone(), beta.clone()
    k_pad[:, ~real], g_pad[:, ~real], b_pad[:, ~real] = 0.0, 0.0, 0.0
    o_ref, s_ref = kda_recurrent(q[:, real], k[:, real], v[:, real], g[:, real], beta[:, real], s0)
    for fn in (kda_recurrent, lambda *xs: kda_chunked(*xs[:5], 8, xs[5])):
        o, s = fn(q, k_pad, v, g_pad, b_pad, s0)
        torch.testing.assert_close(o[:, real], o_ref, rtol=0, atol=2e-6)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=2e-6)
    _, s_all_pad = kda_chunked(q, torch.zeros_like(k), v, torch.zeros_like(g), torch.zeros_like(beta), 8, s0)
    assert torch.equal(s_all_pad, s0)


# ------------------------------------------------------------------------------------------------------------------
# module
# ------------------------------------------------------------------------------------------------------------------
def test_module_shapes_param_names_and_count():
    cfg = GLMConfig()
    layer = KDAttention(cfg)
    x = torch.randn(2, 13, cfg.d_model)
    assert layer(x)[0].shape == x.shape
    names = dict(layer.named_parameters())
    assert names["A_log"].shape == (cfg.n_heads,) and names["dt_bias"].shape == (cfg.n_heads * cfg.head_dim,)
    assert torch.all(names["A_log"] == 0)
    # dt_bias = inverse softplus of dt in [1e-3, 1e-1]
    dt = F.softplus(names["dt_bias"])
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    d, H, D, ks = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kda_conv_size
    HD = H * D
    formula = 3 * d * HD + 3 * HD * ks + (d * D + D * HD) + d * H + H + HD + (d * D + D * HD + HD) + D + HD * d
    assert sum(p.numel() for p in layer.parameters()) == formula == 175910


@pytest.mark.parametrize("t0", [1, 5, 8, 13, 22])
def test_module_causality_bit_identical(t0):
    layer = _layer()
    x = torch.randn(2, 27, 32)
    x2 = x.clone()
    x2[:, t0:] += 3.0 * torch.randn_like(x2[:, t0:])
    with torch.no_grad():
        y, y2 = layer(x)[0], layer(x2)[0]
    assert torch.equal(y[:, :t0], y2[:, :t0])
    assert not torch.allclose(y[:, t0:], y2[:, t0:])


def test_left_padding_equals_unpadded_rows():
    layer = _layer(seed=1)
    T = 21
    lengths = [21, 14, 3, 9]
    xs = [torch.randn(1, n, 32) for n in lengths]
    x = torch.randn(len(lengths), T, 32) * 7.0  # garbage at the pads
    valid = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, (n, xi) in enumerate(zip(lengths, xs)):
        x[i, T - n:] = xi[0]
        valid[i, T - n:] = True
    with torch.no_grad():
        y = layer(x, valid=valid)[0]
        assert torch.isfinite(y).all()
        for i, (n, xi) in enumerate(zip(lengths, xs)):
            torch.testing.assert_close(y[i, T - n:], layer(xi)[0][0], rtol=0, atol=1e-5)
        # and with a cache: the final state of a padded row equals that of the unpadded row
        cache = KDACache.empty(len(lengths), _cfg())
        layer(x, valid=valid, cache=cache)
        for i, (n, xi) in enumerate(zip(lengths, xs)):
            c1 = KDACache.empty(1, _cfg())
            layer(xi, cache=c1)
            torch.testing.assert_close(cache.state[i], c1.state[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(cache.conv_state[i], c1.conv_state[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("T", [1, 6])
def test_pad_steps_leave_the_state_unchanged(T):
    layer = _layer(seed=2)
    cache = KDACache.empty(3, _cfg())
    cache.state.normal_()
    cache.conv_state.normal_()
    before = cache.state.clone()
    valid = torch.tensor([[False] * T, [True] * T, [False] * T])
    with torch.no_grad():
        y = layer(torch.randn(3, T, 32), valid=valid, cache=cache)[0]
    assert torch.isfinite(y).all()
    assert torch.equal(cache.state[0], before[0]) and torch.equal(cache.state[2], before[2])
    assert not torch.allclose(cache.state[1], before[1])


@pytest.mark.parametrize("t", [1, 7, 8, 15, 19])
@pytest.mark.parametrize("fused_step", [False, True])
def test_prefill_then_decode_equals_full_forward(t, fused_step, monkeypatch):
    """Decoding token by token after a prefill equals the full forward, with the C++ decode ops (when loaded) and
    with the eager step."""
    if not fused_step:
        monkeypatch.setattr(ops.backend, "_switched_on", False)
    elif not cext.available():
        pytest.skip("C++ ops not available")
    layer = _layer(seed=3)
    T = 24
    x = torch.randn(2, T, 32)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded row
    with torch.no_grad():
        full = layer(x, valid=valid)[0]
        cache = KDACache.empty(2, _cfg())
        outs = [layer(x[:, :t], valid=valid[:, :t], cache=cache)[0]]
        for i in range(t, T):
            outs.append(layer(x[:, i:i + 1], valid=valid[:, i:i + 1], cache=cache)[0])
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got[valid], full[valid], rtol=0, atol=1e-5)
    assert torch.isfinite(got).all()


def test_decode_core_op_equals_the_step_ops_bit_for_bit(monkeypatch):
    """A decode step without padding runs conv, features, delta rule and gated norm as one C++ op (kda_decode_core):
    the same outputs and the same cache (conv buffer, state) bit for bit as the step's separate ops (the path a
    padding mask takes, here all True), over several steps, and within 1e-5 of the full forward."""
    if not cext.available():
        pytest.skip("C++ ops not available")
    layer = _layer(seed=9, head_dim=16)
    B, T, t0 = 3, 12, 5
    x = torch.randn(B, T, 32)
    calls = []
    orig = torch.ops.glm_lightning.kda_decode_core
    monkeypatch.setattr(torch.ops.glm_lightning, "kda_decode_core", lambda *a: calls.append(1) or orig(*a))
    with torch.no_grad():
        full = layer(x)[0]
        c_core, c_ops = KDACache.empty(B, _cfg(head_dim=16)), KDACache.empty(B, _cfg(head_dim=16))
        outs_core = [layer(x[:, :t0], cache=c_core)[0]]
        outs_ops = [layer(x[:, :t0], cache=c_ops)[0]]
        ones = torch.ones(B, 1, dtype=torch.bool)
        for i in range(t0, T):
            outs_core.append(layer(x[:, i:i + 1], cache=c_core)[0])
            outs_ops.append(layer(x[:, i:i + 1], valid=ones, cache=c_ops)[0])
            assert torch.equal(c_core.state, c_ops.state) and torch.equal(c_core.conv_state, c_ops.conv_state)
    assert len(calls) == T - t0
    assert torch.equal(torch.cat(outs_core, 1), torch.cat(outs_ops, 1))
    torch.testing.assert_close(torch.cat(outs_core, 1), full, rtol=0, atol=1e-5)


def test_two_part_prefill_equals_one_prefill():
    layer = _layer(seed=4)
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        c1 = KDACache.empty(2, _cfg())
        y1 = layer(x, cache=c1)[0]
        for split in (2, 11):
            c2 = KDACache.empty(2, _cfg())
            y2 = torch.cat([layer(x[:, :split], cache=c2)[0], layer(x[:, split:], cache=c2)[0]], dim=1)
            torch.testing.assert_close(y2, y1, rtol=0, atol=1e-5)
            torch.testing.assert_close(c2.state, c1.state, rtol=0, atol=1e-5)
            torch.testing.assert_close(c2.conv_state, c1.conv_state, rtol=0, atol=1e-6)
    # the conv buffer holds the last ks-1 raw projections
    ks = _cfg().kda_conv_size
    raw = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)[:, -(ks - 1):]
    torch.testing.assert_close(c1.conv_state, raw.detach(), rtol=1e-6, atol=1e-6)


def test_repeat_interleave_and_index_select_cache():
    layer = _layer(seed=5)
    G = 3
    prompts = torch.randn(2, 10, 32)
    cont = torch.randn(2 * G, 4, 32)
    with torch.no_grad():
        cache = KDACache.empty(2, _cfg())
        layer(prompts, cache=cache)
        rep = cache.repeat_interleave(G)
        assert rep.state.shape[0] == rep.conv_state.shape[0] == 2 * G
        ys = torch.cat([layer(cont[:, i:i + 1], cache=rep)[0] for i in range(cont.shape[1])], dim=1)
        for r in range(2 * G):
            c = KDACache.empty(1, _cfg())
            layer(prompts[r // G: r // G + 1], cache=c)
            y_r = torch.cat([layer(cont[r:r + 1, i:i + 1], cache=c)[0] for i in range(cont.shape[1])], dim=1)
            torch.testing.assert_close(ys[r:r + 1], y_r, rtol=0, atol=1e-5)
            torch.testing.assert_close(rep.state[r:r + 1], c.state, rtol=0, atol=1e-5)
        rows = torch.tensor([4, 1])
        sel = rep.index_select(rows)
        assert torch.equal(sel.state, rep.state[rows]) and torch.equal(sel.conv_state, rep.conv_state[rows])
        sel.state.zero_()
        assert rep.state[4].abs().sum() > 0  # a copy, not a view


def test_gate_bounds_and_unit_norms():
    cfg = _cfg(kda_gate_lower_bound=-5.0)
    layer = _layer(seed=6)
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        raw, f, b, _ = layer._projections(x, None)
        q, k, v, g, beta = ops.kda_features(ops.short_conv(raw, layer.conv.weight)[0], f, b, layer.A_log,
                                            layer._qk_rescale, layer.lower_bound)
        assert ((g >= cfg.kda_gate_lower_bound) & (g <= 0)).all() and (g < -1e-6).any() and (g > -4.99).any()
        assert ((beta > 0) & (beta < 1)).all()
        torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]))
        torch.testing.assert_close(q.norm(dim=-1), torch.full_like(q[..., 0], cfg.head_dim ** -0.5))
        g_big, beta_big = layer.gates(1e4 * x)  # saturating inputs stay inside the closed bounds
        assert torch.isfinite(g_big).all() and ((g_big >= cfg.kda_gate_lower_bound) & (g_big <= 0)).all()
        assert ((beta_big >= 0) & (beta_big <= 1)).all()
        assert g.dtype == beta.dtype == torch.float32


def test_every_parameter_gets_a_gradient():
    layer = _layer(seed=7)
    x = torch.randn(2, 20, 32)
    loss = (layer(x)[0] * torch.randn(2, 20, 32)).sum()
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"zero gradient for {name}"


def test_cached_forward_keeps_autograd_graph_and_mixed_modes():
    """With grad enabled, cached prefill/decode still backpropagate (the cache is rebound, not written in place); a
    cache built under inference_mode can be continued under no_grad."""
    layer = _layer(seed=8)
    x = torch.randn(1, 9, 32, requires_grad=True)
    with torch.no_grad():
        ref = layer(x)[0]
    cache = KDACache.empty(1, _cfg())
    y = torch.cat([layer(x[:, :5], cache=cache)[0], layer(x[:, 5:6], cache=cache)[0], layer(x[:, 6:], cache=cache)[0]], 1)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
    (y.sum() + cache.state.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    with torch.inference_mode():
        cache = KDACache.empty(1, _cfg())
        outs = [layer(x[:, :4], cache=cache)[0]]
    with torch.no_grad():
        outs += [layer(x[:, i:i + 1], cache=cache)[0] for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=0, atol=1e-5)


def test_module_matches_formula_reference():
    """The fused layer equals a plain transcription of the formulas (nn.Conv1d, separate projections, recurrence)."""
    layer = _layer(seed=9)
    cfg = _cfg()
    H, K, ks = cfg.n_heads, cfg.head_dim, cfg.kda_conv_size
    x = torch.randn(2, 19, 32)
    B, T, _ = x.shape
    with torch.no_grad():
        raw = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1).transpose(1, 2)
        y = F.silu(F.conv1d(F.pad(raw, (ks - 1, 0)), layer.conv.weight, groups=3 * H * K)).transpose(1, 2)
        q, k, v = (t.reshape(B, T, H, K) for t in y.split(H * K, dim=-1))
        q = F.normalize(q, dim=-1, eps=1e-6) * K ** -0.5
        k = F.normalize(k, dim=-1, eps=1e-6)
        beta = torch.sigmoid(layer.b_proj(x))
        f = layer.f_b_proj(layer.f_a_proj(x)).reshape(B, T, H, K) + layer.dt_bias.reshape(H, K)
        g = cfg.kda_gate_lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * f)
        o, _ = kda_recurrent(q, k, v, g, beta)
        gate = torch.sigmoid(layer.g_b_proj(layer.g_a_proj(x))).reshape(B, T, H, K)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + cfg.norm_eps) * layer.o_norm.weight
        ref = layer.o_proj((o * gate).reshape(B, T, H * K))
        torch.testing.assert_close(layer(x)[0], ref, rtol=0, atol=2e-6)


def test_inference_weight_cache_follows_parameter_updates():
    """The fused input weights cached for decoding are rebuilt after an optimizer step or a state-dict load."""
    layer = _layer(seed=10)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        layer(x)  # fills the cache
    layer(x)[0].square().sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    with torch.no_grad():
        after_step = layer(x)[0]
    # no_grad runs the few-row linears through small_matmul, autograd through mm: equal up to float rounding
    torch.testing.assert_close(after_step, layer(x)[0].detach(), rtol=1e-4, atol=1e-5)
    other = _layer(seed=11)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], other(x)[0], rtol=0, atol=1e-6)


@HANDOFF
def test_state_scan_backward_gradcheck_and_equals_the_loop(fused):
    """The hand-written hand-off S_{n+1} = P_n S_n + R_n: gradcheck (float64) and forward/grads of the plain loop."""
    torch.manual_seed(0)
    P, R, S0 = torch.randn(3, 2, 4, 4) * 0.5, torch.randn(3, 2, 4, 5), torch.randn(2, 4, 5)
    args = tuple(t.double().requires_grad_() for t in (P, R, S0))
    assert torch.autograd.gradcheck(lambda *xs: StateScan.apply(*xs, fused), args)
    a = tuple(t.clone().requires_grad_() for t in (P, R, S0))
    b = tuple(t.clone().requires_grad_() for t in (P, R, S0))
    out = StateScan.apply(*a, fused)
    states = [b[2]]
    for n in range(3):
        states.append(torch.baddbmm(b[1][n], b[0][n], states[-1]))
    ref = torch.stack(states)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad((out * w).sum(), a), torch.autograd.grad((ref * w).sum(), b)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_chunked_backward_takes_broadcast_gradients():
    """The hand-written backward accepts the stride-0 gradients that .sum() sends back (and the padded tail)."""
    q, k, v, g, beta, s0 = (x.requires_grad_() for x in _inputs(1, 13, 2, 4, 3, seed=9))
    o, s = kda_chunked(q, k, v, g, beta, 8, s0)
    (o.sum() + s.sum()).backward()
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o_r, s_r = kda_recurrent(*ref)
    (o_r.sum() + s_r.sum()).backward()
    for a, b in zip((q, k, v, g, beta, s0), ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=3e-5)


CPP = pytest.mark.skipif(not cext.available(), reason="C++ ops not available")


@CPP
@pytest.mark.parametrize("K,V,T", [(16, 16, 128), (32, 32, 70), (16, 16, 31), (64, 64, 33), (8, 24, 21), (16, 32, 1)])
def test_cpp_recurrent_core_equals_the_eager_recurrence(K, V, T):
    """The C++ recurrence (csrc/kda_recurrent.cpp) against kda_recurrent on the model's head sizes, padded and unequal
    ones, a tail segment (T not a multiple of SEGMENT) and one token; strided q/k/v views as the layer passes them:
    values, final state and every gradient (fp32)."""

    B, H = 2, 3
    q, k, v, g, beta, s0 = _inputs(B, T, H, K, V, seed=K + V + T)
    qk = torch.cat([q, k], dim=2)  # [B, T, 2H, K]: q and k as strided views of one tensor
    inputs = (qk[:, :, :H], qk[:, :, H:], v, g, beta, s0 * 0.1)
    o_e, s_e, g_e = _run_with_grads(lambda *xs: kda_recurrent(*xs[:5], initial_state=xs[5]), inputs)
    calls = []
    orig = KDARecurrentCpp.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KDARecurrentCpp, "apply", lambda *a: calls.append(1) or orig(*a))
        o_c, s_c, g_c = _run_with_grads(lambda *xs: kda_core(*xs[:5], 16, xs[5], cpp=True), inputs)
    assert calls, "the C++ recurrence did not run"
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=2e-6)
    torch.testing.assert_close(s_c, s_e, rtol=0, atol=2e-6)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-5, msg=lambda m, name=name: f"grad {name}: {m}")


@CPP
@pytest.mark.parametrize("K,V", [(16, 16), (8, 16)])
def test_cpp_recurrent_core_gradcheck_fp64(K, V):
    """gradcheck of the C++ recurrence (fp64 instantiation) over two segments and a tail: a square head as the op takes
    it, and an unequal one zero-padded to a square (recurrent_cpp)."""

    xs = [x.requires_grad_() for x in _inputs(1, SEGMENT + 5, 2, K, V, dtype=torch.float64, seed=13)]
    assert torch.autograd.gradcheck(recurrent_cpp, xs, fast_mode=True)


@CPP
def test_fp64_heads_the_cpp_recurrence_is_not_built_for_take_the_chunked_form():
    """fp64 is compiled for 16-wide heads only (gradcheck; the wider fp64 instantiations cost minutes of g++): a 32-wide
    fp64 head goes to the chunked form and still equals the reference; 16-wide and smaller take the C++ op."""
    xs = _inputs(1, 20, 2, 32, 32, dtype=torch.float64, seed=14)
    calls = []
    orig = KDARecurrentCpp.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KDARecurrentCpp, "apply", lambda *a: calls.append(1) or orig(*a))
        o, s = kda_core(*xs[:5], 16, xs[5])
        assert not calls
        kda_core(*_inputs(1, 20, 2, 8, 16, dtype=torch.float64, seed=15)[:5], 16)
        assert calls == [1]
    ref, s_ref = kda_recurrent(*xs[:5], initial_state=xs[5])
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(s, s_ref)


@CPP
@pytest.mark.parametrize("lb", [LB, -0.01])  # the safe gate's range, and almost no decay (errors are not damped)
def test_cpp_recurrent_core_fp32_error_over_a_long_sequence(lb):
    """2,048 tokens in fp32 against the fp64 recurrence: the sequential C++ recurrence accumulates no more error than
    the chunked form (measured: 3e-8 vs 3.5e-7 in the safe-gate range, 1.4e-7 vs 1.7e-7 with almost no decay)."""
    q, k, v, g, beta, _ = _inputs(2, 2048, 2, 32, 32, dtype=torch.float64, seed=5, lb=lb)
    ref, s_ref = kda_recurrent(q, k, v, g, beta)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    o_c, s_c = kda_core(*f32, 32, gate_bound=5.0, cpp=True)
    o_e, _ = kda_chunked(*f32, 32, gate_bound=5.0, cpp=False)
    err_c, err_e = (o_c.double() - ref).abs().max().item(), (o_e.double() - ref).abs().max().item()
    assert err_c < 1e-6 and err_c <= 2 * err_e, (err_c, err_e)
    torch.testing.assert_close(s_c.double(), s_ref, rtol=0, atol=1e-5)


@CPP
def test_cpp_recurrent_core_is_the_layers_default_and_matches_the_chunked_form():
    """With the ops built the layer runs the C++ recurrence; its output and gradients equal the eager chunked form's
    (the path without the C++ ops), and a cached prefill takes it too."""

    layer = _layer(seed=3)
    x = torch.randn(2, 37, 32, requires_grad=True)
    calls = []
    orig = KDARecurrentCpp.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KDARecurrentCpp, "apply", lambda *a: calls.append(1) or orig(*a))
        y = layer(x)[0]
        gx, = torch.autograd.grad(y.square().sum(), x)
        with torch.no_grad():
            layer(x[:, :9], cache=KDACache.empty(2, _cfg()))
    assert len(calls) == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops.backend, "takes", lambda *a, **kw: False)  # as without the C++ ops
        y_e = layer(x)[0]
        gx_e, = torch.autograd.grad(y_e.square().sum(), x)
    torch.testing.assert_close(y, y_e, rtol=0, atol=2e-6)
    torch.testing.assert_close(gx, gx_e, rtol=1e-5, atol=1e-5)


@CPP
def test_cpp_recurrent_core_takes_broadcast_gradients_and_rejects_bad_sizes():
    q, k, v, g, beta, s0 = (x.requires_grad_() for x in _inputs(1, 13, 2, 16, 16, seed=9))
    o, s = kda_core(q, k, v, g, beta, 16, s0, cpp=True)
    (o.sum() + s.sum()).backward()  # stride-0 gradients
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o_r, s_r = kda_recurrent(*ref)
    (o_r.sum() + s_r.sum()).backward()
    for a, b in zip((q, k, v, g, beta, s0), ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=3e-5)
    x = [t.detach() for t in (q, k, v, g, beta, s0)]
    with pytest.raises(RuntimeError, match="K == V in"):
        torch.ops.glm_lightning.kda_recurrent_fwd(x[0][..., :8], x[1][..., :8], *x[2:3], x[3][..., :8], x[4],
                                                  x[5][:, :, :8], 32)
    with pytest.raises(RuntimeError, match="K == V in"):  # 16 x 32: compiled sizes, but not square
        torch.ops.glm_lightning.kda_recurrent_fwd(*x[:2], torch.cat([x[2], x[2]], -1), *x[3:5],
                                                  torch.cat([x[5], x[5]], -1), 32)
    with pytest.raises(RuntimeError, match="seg must be positive"):
        torch.ops.glm_lightning.kda_recurrent_fwd(*x, 0)


@CPP
@pytest.mark.parametrize("B,T,Ch,ks", [(2, 7, 5, 4), (2, 37, 144, 4), (1, 70, 576, 4), (2, 9, 20, 2)])
def test_cpp_short_conv_equals_the_conv2d_path(B, T, Ch, ks, monkeypatch):
    """ShortConvSiLU (csrc/short_conv.cpp) against the PyTorch channels-last conv2d + SiLU of ops.short_conv: values and
    the gradients of the input and the weight; fp64 gradcheck."""

    layer = KDAttention(_cfg(kda_conv_size=ks))
    gen = torch.Generator().manual_seed(T)
    w = torch.randn(Ch, 1, ks, generator=gen, requires_grad=True)
    layer.conv.weight = torch.nn.Parameter(w.detach().clone())
    x = torch.randn(B, T, Ch, generator=gen)
    dy = torch.randn(B, T, Ch, generator=gen)

    def run(use_cpp: bool):
        monkeypatch.setattr(cext, "available", lambda: use_cpp)
        xs = x.clone().requires_grad_()
        y, _ = ops.short_conv(xs, layer.conv.weight)
        return y.detach(), torch.autograd.grad((y * dy).sum(), [xs, layer.conv.weight])

    (y_c, g_c), (y_e, g_e) = run(True), run(False)
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    xd = torch.randn(1, 6, 3, dtype=torch.float64, requires_grad=True)
    wd = torch.randn(3, 1, ks, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ShortConvSiLU.apply, (xd, wd))


@CPP
@pytest.mark.parametrize("T", [1, 3, 37])
def test_cpp_short_conv_walk_equals_the_general_loops_bit_for_bit(T):
    """The 4-tap fp32 walk of csrc/short_conv.cpp (channels a multiple of the vector width) against the op's general
    loops (which take a channel count that is not): the channels are independent, so the first 64 of a 65-channel input
    give the same values, dx and dw bit for bit, also for rows shorter than the taps."""
    gen = torch.Generator().manual_seed(T)
    x, dy, w = torch.randn(2, T, 65, generator=gen), torch.randn(2, T, 65, generator=gen), torch.randn(65, 4, generator=gen)
    conv = torch.ops.glm_lightning
    y_walk = conv.short_conv_silu(x[..., :64].contiguous(), w[:64].contiguous())
    dx_walk, dw_walk = conv.short_conv_silu_backward(dy[..., :64].contiguous(), x[..., :64].contiguous(),
                                                     w[:64].contiguous())
    y_gen = conv.short_conv_silu(x, w)
    dx_gen, dw_gen = conv.short_conv_silu_backward(dy, x, w)
    assert torch.equal(y_walk, y_gen[..., :64])
    assert torch.equal(dx_walk, dx_gen[..., :64])
    assert torch.equal(dw_walk, dw_gen[:64])


def test_decode_step_in_place_equals_recurrent_step():
    """The decode step's PyTorch form (delta_step_, heads flattened into bmm batches) on strided slices of a fused q|k|v
    projection, as decoding passes them, equals one step of the reference recurrence, and writes S in place."""
    gen = torch.Generator().manual_seed(3)
    B, H, K = 3, 2, 4
    qkv = torch.randn(B, 1, 3, H, K, generator=gen)
    q, k, v = (F.normalize(qkv[:, :, i], dim=-1) if i < 2 else qkv[:, :, i] for i in range(3))
    g = -torch.rand(B, 1, H, K, generator=gen)
    beta = torch.rand(B, 1, H, generator=gen)
    s0 = torch.randn(B, H, K, K, generator=gen)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, s0.clone())
    S = s0.clone()
    o = pytorch_form(delta_step_, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, s_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not cext.available(), reason="C++ ops not available")
@pytest.mark.parametrize("K", [32, 4])  # compile-time head size, and the generic loop
def test_cpp_delta_step_equals_eager(K):
    """glm_lightning::delta_step_ (one pass per head, csrc/kda_decode.cpp) equals the eager bmm step: output and the
    state written in place, on strided q/k/v slices of one projection as decoding passes them."""
    gen = torch.Generator().manual_seed(7)
    B, H = 5, 3
    qkv = torch.randn(B, 3, H, K, generator=gen)
    q, k = F.normalize(qkv[:, 0], dim=-1), F.normalize(qkv[:, 1], dim=-1)
    v = qkv[:, 2]
    assert not v.is_contiguous()
    g = -5 * torch.rand(B, H, K, generator=gen)
    beta = torch.rand(B, H, generator=gen)
    s0 = torch.randn(B, H, K, K, generator=gen)
    S_e, S_f = s0.clone(), s0.clone()
    for _ in range(3):  # a few steps, so errors would compound
        o_e = pytorch_form(delta_step_, q, k, v, g, beta, S_e)
        o_f = delta_step_(q, k, v, g, beta, S_f)
        torch.testing.assert_close(o_f, o_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S_f, S_e, rtol=1e-5, atol=1e-5)
    assert not torch.equal(S_f, s0)


@pytest.mark.skipif(not cext.available(), reason="C++ ops not available")
def test_cpp_conv_step_equals_eager_and_the_conv():
    """glm_lightning::conv_step_ equals the eager step (cat, product, sum, SiLU, shift) and the layer's causal conv
    over the whole sequence, and shifts the new input into the buffer."""
    layer = _layer(seed=8)
    gen = torch.Generator().manual_seed(8)
    B, T, Ch, ks = 3, 6, layer.conv.weight.shape[0], layer.conv_size
    raw = torch.randn(B, T, Ch, generator=gen)
    with torch.no_grad():
        full, _ = ops.short_conv(raw, layer.conv.weight)
        st_e, st_f = torch.zeros(B, ks - 1, Ch), torch.zeros(B, ks - 1, Ch)
        for t in range(T):
            y_e = pytorch_form(conv_step_, st_e, raw[:, t:t + 1], layer.conv.weight)
            y_f = conv_step_(st_f, raw[:, t:t + 1], layer.conv.weight)
            torch.testing.assert_close(y_f, y_e, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(y_f[:, 0], full[:, t], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st_f, st_e, rtol=0, atol=0)
    torch.testing.assert_close(st_f, raw[:, T - (ks - 1):], rtol=0, atol=0)
