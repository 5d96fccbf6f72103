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


def _single_query_inputs() -> tuple:
    """A decode step's attention: q [3, 4, 1, 8] over 11 keys of 2 key/value heads (GQA), a random key mask with
    the last key always kept; k and v strided slices of a longer cache buffer."""
    B, H, Hkv, S, D = 3, 4, 2, 11, 8
    mask = torch.rand(B, 1, S, generator=_GEN) > 0.4
    mask[..., -1] = True
    return _randn(B, H, 1, D), _randn(B, Hkv, S + 4, D)[:, :, :S], _randn(B, Hkv, S + 4, D)[:, :, :S], mask


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
    ("single_query_attention", ops.single_query_attention, reference.masked_attention, _single_query_inputs,
     (0, 1, 2), 1e-5),
]


def _outputs(fn: Callable, args: tuple, diff: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    args = tuple(a.clone().requires_grad_() if i in diff else a for i, a in enumerate(args))
    outs = fn(*args)
    outs = [o for o in outs if o is not None] if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, [args[i] for i in diff], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


# (C++ ops on, dtype): fp32 with the C++ ops off and on; fp64 and bf16 (the other dtypes the ops layer promises) with
# the PyTorch forms only, as GLM_LIGHTNING_EXT=0 runs them (the C++ ops take fp32, and fp64 for gradcheck).
_NO_CPP = pytest.mark.skipif(not cext.available(), reason="C++ ops not built")
MODES = [pytest.param(False, torch.float32, id="pytorch-fp32"),
         pytest.param(True, torch.float32, id="cpp-fp32", marks=_NO_CPP),
         pytest.param(False, torch.float64, id="pytorch-fp64"),
         pytest.param(False, torch.bfloat16, id="pytorch-bf16")]
FP64_TOL = 1e-10
BF16_TOL = 2e-2
"""bf16: the op on bf16 inputs against the reference on the same values in fp32, relative to the largest reference
value (bf16 keeps 8 bits: GEMM outputs rounded to 2^-9 relative, a few roundings per op)."""


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, tol: float, what: str) -> None:
    if dtype is torch.bfloat16:
        # the policy (mixed_precision.py): GEMM outputs bf16, every other op's outputs fp32; never wider
        assert a.dtype in (torch.bfloat16, torch.float32), f"{what}: {a.dtype}"
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
        assert err <= BF16_TOL * scale, f"{what}: max error {err:.3g} > {BF16_TOL} x {scale:.3g}"
        return
    assert a.dtype == dtype, f"{what}: {a.dtype} for {dtype} inputs"
    tol = FP64_TOL if dtype is torch.float64 else tol
    torch.testing.assert_close(a, b.to(a.dtype), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("cpp,dtype", MODES)
@pytest.mark.parametrize("name,fast,ref,make,diff,tol", CASES, ids=[c[0] for c in CASES])
def test_op_equals_its_reference_form(name, fast, ref, make, diff, tol, cpp, dtype):
    """Values and gradients of every op against its reference form, in each dtype. fp64: both in fp64 (outputs and
    gradients fp64, agreeing to 1e-10). bf16: the op on bf16 inputs against the reference on the same (bf16-rounded)
    values in fp32; the gradients come back in bf16, the inputs' dtype."""
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in make())
    with ops.cpp_ops(cpp):
        outs, grads = _outputs(fast, args, diff)
    ref_args = args if dtype is not torch.bfloat16 else tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    ref_outs, ref_grads = _outputs(ref, ref_args, diff)
    assert len(outs) == len(ref_outs)
    for j, (a, b) in enumerate(zip(outs, ref_outs)):
        if a.dtype == torch.bool or not a.is_floating_point():
            assert torch.equal(a, b)
        else:
            _close(a, b, dtype, tol, f"output {j}")
    for i, a, b in zip(diff, grads, ref_grads):
        assert (a is None) == (b is None), f"input {i}"
        if a is not None:
            assert a.dtype == args[i].dtype, f"grad of input {i}: {a.dtype} for a {args[i].dtype} input"
            _close(a.float() if dtype is torch.bfloat16 else a, b, dtype, tol, f"grad of input {i}")


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


@pytest.mark.parametrize("cpp,dtype", MODES)
def test_kda_decode_steps_equal_the_reference_sequence(cpp, dtype):
    """Token-by-token ``kda_decode_step`` from a cached prefix (conv buffer and state, updated in place) equals the
    reference layer over the whole sequence: outputs, final state and conv buffer, in each dtype (row 1 left-padded)."""
    (raw, f, b, gate, valid, conv_w, A_log, rescale, lb, _chunk, norm_w, eps, conv0,
     state0) = _kda_sequence_inputs(True)
    raw, f, b, gate, conv_w, A_log, norm_w, conv0, state0, rescale = (
        t.to(dtype) for t in (raw, f, b, gate, conv_w, A_log, norm_w, conv0, state0, rescale))
    # the buffers: fp64 for fp64, else fp32 as KDACache holds them (bf16 activations meet fp32 buffers)
    state_dtype = torch.float64 if dtype is torch.float64 else torch.float32
    ref_args = (raw, f, b, gate, valid, conv_w, A_log, rescale, lb, 4, norm_w, eps, conv0, state0)
    if dtype is torch.bfloat16:
        ref_args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in ref_args)
    ref_out, ref_conv, ref_state = reference.kda_sequence(*ref_args)
    conv, state = conv0.to(state_dtype).clone(), state0.to(state_dtype).clone()
    outs = []
    with torch.no_grad(), ops.cpp_ops(cpp):
        for t in range(raw.shape[1]):
            s = slice(t, t + 1)
            outs.append(ops.kda_decode_step(raw[:, s], f[:, s], b[:, s], gate[:, s], valid[:, s], conv, state, conv_w,
                                            A_log, rescale, lb, norm_w, eps))
    _close(torch.cat(outs, 1), ref_out, dtype, 3e-5, "outputs")
    _close(state, ref_state, state_dtype if dtype is not torch.bfloat16 else dtype, 3e-5, "state")
    assert state.dtype == state_dtype and conv.dtype == state_dtype
    torch.testing.assert_close(conv, ref_conv.to(state_dtype), rtol=0, atol=0)  # the raw inputs, shifted
