"""1D RoPE: relative-position property, norm preservation, partial rotation, explicit positions, layout."""

from __future__ import annotations

import math

import pytest
import torch

from glm_lightning.model.rope import RotaryEmbedding, apply_rotary, rope_inv_freq


def _rot(rope: RotaryEmbedding, v: torch.Tensor, pos: int) -> torch.Tensor:
    return rope.apply_rope(v[None, :], torch.tensor([pos]))[0]


@pytest.mark.parametrize("dim", [8, 16])
def test_scores_depend_only_on_relative_position(dim: int) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(dim, max_seq_len=128)
    q, k = torch.randn(dim), torch.randn(dim)
    for m, n, s in [(3, 1, 7), (0, 9, 40), (20, 20, 50), (5, 60, 3)]:
        a = _rot(rope, q, m) @ _rot(rope, k, n)
        b = _rot(rope, q, m + s) @ _rot(rope, k, n + s)
        assert torch.allclose(a, b, atol=1e-5), (m, n, s, a, b)
    # ... and it does depend on the relative position (the rotation is not the identity)
    assert not torch.allclose(_rot(rope, q, 5) @ _rot(rope, k, 0), _rot(rope, q, 0) @ _rot(rope, k, 0), atol=1e-3)


def test_norm_preserved_and_position_zero_is_identity() -> None:
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, max_seq_len=64)
    x = torch.randn(2, 3, 64, 16)
    y = rope.apply_rope(x, torch.arange(64))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(y[..., 0, :], x[..., 0, :])


def test_half_split_layout_matches_complex_rotation() -> None:
    """Pair (i, i + d/2) is rotated by pos * base^(-2i/d): the half-split (not interleaved) layout."""
    torch.manual_seed(2)
    d, base, pos = 8, 10000.0, 13
    rope = RotaryEmbedding(d, max_seq_len=32, base=base)
    x = torch.randn(d)
    y = _rot(rope, x, pos)
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        z = complex(x[i], x[i + d // 2]) * complex(math.cos(pos * theta), math.sin(pos * theta))
        assert abs(y[i].item() - z.real) < 1e-5 and abs(y[i + d // 2].item() - z.imag) < 1e-5
    assert torch.allclose(rope_inv_freq(d, base), torch.tensor([base ** (-2 * i / d) for i in range(d // 2)]))


def test_partial_rotation_leaves_other_dims_unchanged() -> None:
    torch.manual_seed(3)
    rope = RotaryEmbedding(8, max_seq_len=32)
    x = torch.randn(2, 4, 20, 24)
    y = rope.apply_rope(x, torch.arange(20))
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., 1:, :8], x[..., 1:, :8], atol=1e-3)
    assert torch.allclose(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)
    # functional form with a [T, 1, d] table on a [B, T, H, D] layout gives the same result
    cos, sin = rope.cos_sin(torch.arange(20))
    y2 = apply_rotary(x.transpose(1, 2), cos[:, None], sin[:, None]).transpose(1, 2)
    assert torch.allclose(y, y2, atol=1e-6)


def test_positions_argument_offsets() -> None:
    torch.manual_seed(4)
    rope = RotaryEmbedding(16, max_seq_len=64)
    x = torch.randn(2, 3, 30, 16)
    full = rope.apply_rope(x, torch.arange(30))
    # a decode-style slice at absolute positions start + t
    assert torch.allclose(rope.apply_rope(x[..., 10:14, :], torch.arange(10, 14)), full[..., 10:14, :], atol=1e-6)
    assert torch.allclose(rope.apply_rope(x[..., 10:14, :], 10), full[..., 10:14, :], atol=1e-6)
    # per-row positions [B, T] broadcast over the head dim
    pos = torch.stack([torch.arange(0, 4), torch.arange(20, 24)])
    y = rope.apply_rope(x[..., :4, :], pos)
    assert torch.allclose(y[0], rope.apply_rope(x[0, :, :4], torch.arange(4)), atol=1e-6)
    assert torch.allclose(y[1], rope.apply_rope(x[1, :, :4], torch.arange(20, 24)), atol=1e-6)
    assert not torch.allclose(y[1], rope.apply_rope(x[1, :, :4], torch.arange(4)), atol=1e-3)


def test_out_of_range_positions_raise_and_buffers_not_persistent() -> None:
    rope = RotaryEmbedding(8, max_seq_len=16)
    with pytest.raises(ValueError):
        rope.apply_rope(torch.randn(3, 8), torch.arange(14, 17))
    with pytest.raises(ValueError):
        RotaryEmbedding(7, max_seq_len=16)
    assert rope.state_dict() == {}
    assert rope.cos.dtype == torch.float32 and rope.cos.shape == (16, 8)


def test_cos_sin_of_a_range_is_the_tensor_lookup():
    """A step-1 range of positions (DSA's contiguous positions) slices the table: the same rows as an index tensor."""
    rope = RotaryEmbedding(8, max_seq_len=16)
    for start, stop in ((0, 16), (5, 6), (3, 11)):
        for a, b in zip(rope.cos_sin(range(start, stop)), rope.cos_sin(torch.arange(start, stop))):
            assert torch.equal(a, b)
    for bad in (range(10, 17), range(-1, 3), range(0, 8, 2)):
        with pytest.raises(ValueError):
            rope.cos_sin(bad)


@pytest.mark.parametrize("shape,d_rot", [((16, 1, 4, 32), 16), ((16, 1, 32), 16), ((3, 1, 6, 8), 8), ((5, 10), 4)])
def test_decode_rotary_op_equals_the_eager_rotation_bit_for_bit(shape, d_rot) -> None:
    """A decode step's rotation at one position (C++ rotary_one: partial and full, any leading dims) gives exactly
    the eager form's values: its two products are rounded before their sum, as the eager ops round them."""
    from glm_lightning.model import cext
    from glm_lightning.model.ops import decode

    if not cext.available():
        pytest.skip("C++ ops disabled (GLM_LIGHTNING_EXT=0) or not buildable")
    torch.manual_seed(d_rot + len(shape))
    rope = RotaryEmbedding(d_rot, 40)
    x = torch.randn(*shape) * 3.0
    for pos in (0, 7, 39):
        cos, sin = rope.cos_sin(range(pos, pos + 1))
        cos, sin = cos.view(*[1] * (len(shape) - 1), d_rot), sin.view(*[1] * (len(shape) - 1), d_rot)
        eager = apply_rotary(x, cos, sin)
        with decode.fp32_step(True):
            assert decode.cpp("rotary")
            fused = apply_rotary(x, cos, sin)
        assert torch.equal(fused, eager)
        assert torch.equal(torch.ops.glm_lightning.rotary_one(x, cos, sin), eager)
