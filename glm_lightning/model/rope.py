"""Rotary position embedding (RoFormer, Su et al. 2021), 1D, half-split layout, full or partial.

Channel pair i of the rotated part is turned by the angle ``pos * theta_i`` with ``theta_i = base^(-2i / d_rot)``.
Layout: the *half-split* (HF Llama / GLM indexer) convention, pairs ``(i, i + d_rot/2)``, applied as
``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` holding the angles duplicated over the two halves. It is not
interchangeable with the interleaved ``(2i, 2i+1)`` layout of the DeepSeek reference code.

Partial RoPE rotates the *first* ``d_rot`` channels and leaves the rest untouched (the V3.2 lightning indexer is laid
out ``[pe, nope]``). Positions are explicit integer tensors, so a decode step passes the absolute positions
``start + t``. cos/sin are kept in fp32 and the rotation is computed in fp32, then cast back to the input dtype.

The building blocks are free functions so that a 2D (vision) RoPE can reuse them:
``rope_inv_freq(head_dim // 2, base)`` gives the ``theta_i = base^(-4i/head_dim)`` of Qwen2-VL's 2D RoPE, the row
and column angles are concatenated, and :func:`cos_sin_from_angles` + :func:`apply_rotary` do the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from glm_lightning.model.ops import decode


def rope_inv_freq(dim: int, base: float = 10000.0) -> torch.Tensor:
    """The ``dim // 2`` inverse frequencies ``theta_i = base^(-2i/dim)`` in fp32 (computed in fp64)."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"RoPE dim must be a positive even number, got {dim}")
    exponent = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return (base ** -exponent).float()


def cos_sin_from_angles(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split cos/sin tables from per-pair angles ``[..., d_rot/2]`` -> two fp32 tensors ``[..., d_rot]``."""
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (half-split layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` (cos/sin broadcast against ``x[..., :d_rot]``).

    Channels beyond ``d_rot`` pass through unchanged (partial RoPE). Compute is fp32, the result has x's dtype.
    """
    d_rot = cos.shape[-1]
    if d_rot > x.shape[-1]:
        raise ValueError(f"rotary dim {d_rot} exceeds the feature dim {x.shape[-1]}")
    if decode.cpp("rotary") and cos.numel() == d_rot and x.dtype is torch.float32 and x.is_contiguous():
        return torch.ops.glm_lightning.rotary_one(x, cos, sin)  # a decode step: one position, one op
    xf = x if x.dtype == torch.float32 else x.float()
    if d_rot == x.shape[-1]:
        out = xf * cos + rotate_half(xf) * sin
    else:
        xr, xp = xf[..., :d_rot], xf[..., d_rot:]
        out = torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """1D RoPE over the first ``dim`` channels with a precomputed fp32 cos/sin table for positions ``[0, max_seq_len)``.

    Args:
        dim: rotated channels d_rot (even); channels after them are left unchanged.
        max_seq_len: number of positions in the table; larger positions raise ``ValueError``.
        base: frequency base.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.base = dim, max_seq_len, base
        inv_freq = rope_inv_freq(dim, base).double()
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = cos_sin_from_angles(angles)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin of shape ``[*positions.shape, dim]`` for integer ``positions``. A ``range`` (step 1) of
        positions gives the table rows as a slice: the bounds are checked in Python, not by min/max host syncs
        (2 dispatched ops per table instead of 9; DSA passes its contiguous positions so)."""
        if isinstance(positions, range):
            if positions.step != 1 or positions.start < 0 or positions.stop > self.max_seq_len:
                raise ValueError(f"RoPE positions must be a step-1 range in [0, {self.max_seq_len}), got {positions}")
            return self.cos[positions.start:positions.stop], self.sin[positions.start:positions.stop]
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_seq_len):
            raise ValueError(
                f"RoPE positions must lie in [0, {self.max_seq_len}), got "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        return self.cos[positions], self.sin[positions]

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor | int = 0) -> torch.Tensor:
        """Rotate ``x [..., T, D]`` (D >= dim) at ``positions``.

        ``positions`` is an integer tensor ``[T]`` (shared by all leading dims) or ``[B, T]`` (one row per leading
        batch dim; any dims between B and T, e.g. heads, broadcast), or a python int ``start`` meaning
        ``start, ..., start + T - 1``.
        """
        T = x.shape[-2]
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + T, device=x.device)
        if positions.shape[-1] != T:
            raise ValueError(f"positions has {positions.shape[-1]} entries for a sequence of length {T}")
        cos, sin = self.cos_sin(positions)
        lead = positions.dim() - 1
        while cos.dim() < x.dim():  # insert broadcast dims (heads) between the batch dims and T
            cos, sin = cos.unsqueeze(lead), sin.unsqueeze(lead)
        return apply_rotary(x, cos, sin)

    forward = apply_rope

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_seq_len={self.max_seq_len}, base={self.base}"
