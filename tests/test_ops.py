"""Every op of the ops layer against the reference form the package ships (glm_lightning/model/ops/reference.py):
values and the gradients of every differentiable input, with the C++ ops on (where the library loaded) and off, on
random inputs of the model's shapes. The files beside it test each fast form's corners (strides, padding, ties, fp64
gradcheck); this table makes sure that no op is left without its reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from glm_lightning.model import cext, ops
from glm_lightning.model.ops import reference

BACKENDS = [False, pytest.param(True, marks=pytest.mark.skipif(not cext.available(), reason="C++ ops not built"))]


_GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN) * scale


def _kda_inputs() -> tuple[torch.Tensor, ...]:
    B, T, H, K = 2, 19, 2, 16
    q = F.normalize(_randn(B, T, H, K), dim=-1) * K ** -0.5
    k = F.normalize(_randn(B, T, H, K), dim=-1)
    g = -5.0 * torch.sigmoid(_randn(B, T, H, K))
    return q, k, _randn(B, T, H, K), g, torch.sigmoid(_randn(B, T, H)), _randn(B, H, K, K)


def _kda_sequence_inputs(cached: bool) -> tuple:
    """The layer-level inputs of ``kda_sequence`` (H 2, K 8, ks 4), row 1 left-padded by 3; with the cached states
    of an earlier prefix when ``cached``."""
    B, T, H, K, ks = 2, 13, 2, 8, 4
    HK = H * K
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False
    rescale = torch.tensor([K ** 0.5] * H + [1.0] * H).view(2 * H, 1)
    cache = (_randn(B, ks - 1, 3 * HK), _randn(B, H, K, K, scale=0.3)) if cached else (None, None)
    return (_randn(B, T, 3 * HK), _randn(B, T, HK), _randn(B, T, H), _randn(B, T, HK), valid,
            _randn(3 * HK, 1, ks, scale=0.5), _randn(H, scale=0.5), rescale, -5.0, 4, 1.0 + _randn(K, scale=0.1),
            1e-5, *cache)


def _site_inputs(n: int = 4, C: int = 8) -> tuple:
    idx = torch.tensor([0] * n + [1] * n + [2] * n * n)
    return (_randn(3, 5, n, C), _randn((2 + n) * n, n * C, scale=0.3), _randn(3, scale=0.5), _randn((2 + n) * n),
            idx, torch.tensor([1.0] * n + [2.0] * n), torch.tensor([1e-6] * n + [0.0] * n), 1e-5, 7, 1e-6)


def _moe_inputs() -> tuple:
    N, K, E, d, h = 9, 2, 4, 16, 12
    s = torch.sigmoid(_randn(N, E))
    idx, w = reference.moe_route(s, torch.zeros(E), K, 1.5)
    return _randn(N, d), idx, w, _randn(E, 2 * h, d, scale=0.3), _randn(E, d, h, scale=0.3)


def _site_read_reference(x, *params):
    pre, post, res = reference.site_mappings(x, *params)
    return reference.stream_read(pre, x), post, res


def _moe_experts_op(x, idx, w, w_gate_up, w_down):
    return ops.moe_experts(x, idx, w, w_gate_up, w_down, torch.bincount(idx.reshape(-1), minlength=w_gate_up.shape[0]))


def _short_conv_op(raw, weight):
    return ops.short_conv(raw, weight)[0]


def _kda_core_op(q, k, v, g, beta, s0):
    return ops.kda_core(q, k, v, g, beta, 8, s0, gate_bound=5.0)


def _kda_chunked_op(q, k, v, g, beta, s0):
    return ops.kda_chunked(q, k, v, g, beta, 8, s0, gate_bound=5.0)


# (name, fast form, reference form, inputs, indices of the differentiable inputs, tolerance)
CASES: list[tuple[str, Callable, Callable, Callable[[], tuple], tuple[int, ...], float]] = [
    ("rms_norm", ops.rms_norm, reference.rms_norm, lambda: (_randn(3, 7, 24), _randn(24), 1e-5), (0, 1), 1e-5),
    ("rms_norm_unweighted", ops.rms_norm, reference.rms_norm, lambda: (_randn(3, 7, 24), None, 1e-5), (0,), 1e-5),
    ("gated_head_norm", ops.gated_head_norm, reference.gated_head_norm,
     lambda: (_randn(2, 5, 3, 16), _randn(2, 5, 48), _randn(16), 1e-5), (0, 1, 2), 1e-5),
    ("linear", ops.linear, reference.linear, lambda: (_randn(2, 5, 24), _randn(7, 24), _randn(7)), (0, 1, 2), 1e-5),
    ("sinkhorn", ops.sinkhorn, reference.sinkhorn_knopp, lambda: (_randn(6, 4, 4, scale=2.0), 20, 1e-6), (0,), 1e-5),
    ("stream_read", ops.stream_read, reference.stream_read, lambda: (_randn(3, 5, 4), _randn(3, 5, 4, 8)), (0, 1),
     1e-5),
    ("stream_write", ops.stream_write, reference.stream_write,
     lambda: (torch.rand(3, 5, 4, 4, generator=_GEN), _randn(3, 5, 4, 8), _randn(3, 5, 4), _randn(3, 5, 8)),
     (0, 1, 2, 3), 1e-5),
    ("stream_write_2", ops.stream_write, reference.stream_write,
     lambda: (torch.rand(3, 5, 2, 2, generator=_GEN), _randn(3, 5, 2, 8), _randn(3, 5, 2), _randn(3, 5, 8)),
     (0, 1, 2, 3), 1e-5),
    ("site_read", ops.site_read, _site_read_reference, _site_inputs, (0, 1, 2, 3), 1e-5),
    ("short_conv", _short_conv_op, reference.short_conv, lambda: (_randn(2, 11, 12), _randn(12, 1, 4)), (0, 1), 1e-5),
    ("kda_features", ops.kda_features, reference.kda_features,
     lambda: (_randn(2, 5, 3 * 2 * 8), _randn(2, 5, 16), _randn(2, 5, 2), _randn(2),
              torch.tensor([8 ** 0.5] * 2 + [1.0] * 2).view(4, 1), -5.0), (0, 1, 2, 3), 1e-5),
    ("kda_core", _kda_core_op, reference.kda_recurrent, _kda_inputs, (0, 1, 2, 3, 4, 5), 3e-5),
    ("kda_chunked", _kda_chunked_op, reference.kda_recurrent, _kda_inputs, (0, 1, 2, 3, 4, 5), 3e-5),
    ("kda_sequence", ops.kda_sequence, reference.kda_sequence, lambda: _kda_sequence_inputs(False),
     (0, 1, 2, 3, 5, 6, 10), 3e-5),
    ("kda_sequence_cached", ops.kda_sequence, reference.kda_sequence, lambda: _kda_sequence_inputs(True),
     (0, 1, 2, 3, 5, 6, 10, 12, 13), 3e-5),
    ("moe_experts", _moe_experts_op, reference.moe_experts, _moe_inputs, (0, 2, 3, 4), 1e-5),
    ("swiglu_mlp", ops.swiglu_mlp, reference.swiglu, lambda: (_randn(9, 16), _randn(24, 16), _randn(16, 12)),
     (0, 1, 2), 1e-5),
    ("index_scores", ops.index_scores, reference.index_scores,
     lambda: (_randn(2, 4, 6, 8), _randn(2, 6, 4), _randn(2, 9, 8)), (0, 1, 2), 1e-5),
]


def _outputs(fn: Callable, args: tuple, diff: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    args = tuple(a.clone().requires_grad_() if i in diff else a for i, a in enumerate(args))
    outs = fn(*args)
    outs = [o for o in outs if o is not None] if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, [args[i] for i in diff], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("cpp", BACKENDS, ids=["pytorch", "cpp"])
@pytest.mark.parametrize("name,fast,ref,make,diff,tol", CASES, ids=[c[0] for c in CASES])
def test_op_equals_its_reference_form(name, fast, ref, make, diff, tol, cpp):
    args = make()
    with ops.cpp_ops(cpp):
        outs, grads = _outputs(fast, args, diff)
    ref_outs, ref_grads = _outputs(ref, args, diff)
    assert len(outs) == len(ref_outs)
    for a, b in zip(outs, ref_outs):
        if a.dtype == torch.bool or not a.is_floating_point():
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b.to(a.dtype), rtol=tol, atol=tol)
    for i, a, b in zip(diff, grads, ref_grads):
        assert (a is None) == (b is None), f"input {i}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, i=i: f"grad of input {i}: {m}")


@pytest.mark.parametrize("cpp", BACKENDS, ids=["pytorch", "cpp"])
@pytest.mark.parametrize("S,top_k,gather", [(9, 4, False), (40, 4, True), (40, 4, False)])
def test_decode_attention_equals_the_masked_reference(S, top_k, gather, cpp, monkeypatch):
    """A decode step's sparse attention (mask or gather) equals the reference masked attention over the top-k keys."""
    from glm_lightning.model.ops import thresholds

    monkeypatch.setattr(thresholds, "DECODE_GATHER_MIN_KEYS_PER_TOP_K", 0 if gather else 10**9)
    B, H, Hkv, D = 3, 4, 2, 8
    q = _randn(B, H, 1, D)
    k_buf, v_buf = _randn(B, Hkv, S + 5, D), _randn(B, Hkv, S + 5, D)
    scores = _randn(B, 1, S)
    allowed = torch.rand(B, 1, S, generator=_GEN) > 0.2
    allowed[:, :, -1] = True
    keep = ops.topk_mask(scores, allowed, top_k)
    ref = reference.masked_attention(q, k_buf[:, :, :S], v_buf[:, :, :S], keep)
    with torch.no_grad(), ops.cpp_ops(cpp):
        got = ops.decode_attention(q, k_buf, v_buf, S, scores, allowed, top_k)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
