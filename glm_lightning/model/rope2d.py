"""2D rotary position embedding for image patches (Qwen2-VL / GLM-5.3 vision tower), half-split layout.

For a head of dimension ``D`` the rotated channel pairs are ``(i, i + D/2)``, ``i < D/2``. The first ``D/4`` pairs are
turned by ``row * theta_j`` and the last ``D/4`` pairs by ``col * theta_j``, with the ``D/4`` frequencies
``theta_j = base^(-4j/D)`` (= :func:`rope_inv_freq` over ``D/2`` channels). The dot product of a rotated query at
``(r1, c1)`` and a rotated key at ``(r2, c2)`` therefore depends on the positions only through ``(r1-r2, c1-c2)``.

Patch order: :func:`window_order` lists the patches of a ``gh x gw`` grid so that every ``merge x merge`` window is
``merge**2`` consecutive tokens (window-major, row-major inside a window). The row/column ids handed to
:class:`Rope2D` must follow the same permutation (:func:`grid_positions` does that), otherwise the merge reshape and
the positions disagree silently.
"""

from __future__ import annotations

import torch
from torch import nn

from glm_lightning.model.rope import apply_rotary, cos_sin_from_angles, rope_inv_freq


def window_order(grid_h: int, grid_w: int, merge: int = 1) -> torch.Tensor:
    """Permutation ``perm [grid_h * grid_w]`` of row-major patch indices: ``tokens[:, perm]`` puts each
    ``merge x merge`` window into ``merge**2`` consecutive slots (windows in row-major order)."""
    if merge < 1 or grid_h % merge or grid_w % merge:
        raise ValueError(f"patch grid {grid_h}x{grid_w} is not divisible by the merge size {merge}")
    ids = torch.arange(grid_h * grid_w).view(grid_h // merge, merge, grid_w // merge, merge)
    return ids.permute(0, 2, 1, 3).reshape(-1)


def grid_positions(grid_h: int, grid_w: int, merge: int = 1) -> torch.Tensor:
    """``[N, 2]`` (row, col) of every patch, listed in :func:`window_order`."""
    perm = window_order(grid_h, grid_w, merge)
    return torch.stack((perm // grid_w, perm % grid_w), dim=-1)


class Rope2D(nn.Module):
    """2D RoPE over full heads of dimension ``head_dim`` (a multiple of 4): half of the pairs encode the row, half the
    column. Stateless apart from the ``D/4`` fp32 inverse frequencies.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % 4:
            raise ValueError(f"2D RoPE needs a head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", rope_inv_freq(head_dim // 2, base), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[..., head_dim]`` for integer ``positions [..., 2]`` holding (row, col)."""
        if positions.shape[-1] != 2:
            raise ValueError(f"2D RoPE positions must be [..., 2] (row, col), got {tuple(positions.shape)}")
        pos = positions.to(torch.float64)
        freq = self.inv_freq.to(device=positions.device, dtype=torch.float64)
        angles = torch.cat((pos[..., :1] * freq, pos[..., 1:] * freq), dim=-1)  # [..., D/2]: row pairs, col pairs
        return cos_sin_from_angles(angles)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., N, head_dim]`` with ``positions [N, 2]`` (broadcast over the leading dims)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"expected head_dim {self.head_dim}, got {x.shape[-1]}")
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
