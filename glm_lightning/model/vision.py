"""Vision tower: images -> a few tokens in the language model's width, spliced in at `<image>` placeholders.

ViT encoder (``encoder="vit"``, Qwen2-VL / GLM-5.3 style)::

    image [B,C,S,S] ──Conv2d(k=s=p)──> patches [B, (S/p)^2, D]  window-major (each 2x2 window consecutive)
        depth x ViTBlock: x += Attn(RMSNorm(x))   bidirectional, per image, q/k RMSNorm, 2D RoPE (row/col pairs)
                          x += SwiGLU(RMSNorm(x))
        merge: RMSNorm -> reshape [B, N/4, 4D] -> Linear(4D,4D) -> GELU -> Linear(4D, d_text)   => 16 tokens

Direct-patch baseline (``encoder="direct"``): patchify with p = 8 and one Linear(C*p*p, d_text) => 16 tokens, no ViT.

Fusion (:func:`splice_image_features`): the embeddings at `<image>` placeholder ids are replaced, in order, by the
image features; the numbers must match exactly. The language model then runs on ``input_embeds``.
Each image is its own batch row inside the encoder, so attention never crosses images.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glm_lightning.model import ops
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import linear
from glm_lightning.model.rope import apply_rotary
from glm_lightning.model.rope2d import Rope2D, grid_positions, window_order
from glm_lightning.tokenizer import ByteTokenizer

ENCODERS = ("vit", "direct")


@dataclass
class VisionConfig:
    """Configuration of :class:`VisionEncoder`."""

    image_size: int = 32
    """Input images are square ``image_size x image_size`` (the DataModule resizes/pads to it)."""
    patch_size: int = 4
    """Pixels per patch side (Conv2d kernel = stride). 4 -> 8x8 patches for the ViT; the direct baseline uses 8."""
    channels: int = 3
    """Input channels (RGB)."""
    depth: int = 2
    """ViT blocks (ignored by the direct encoder)."""
    dim: int = 128
    """ViT width D (ignored by the direct encoder)."""
    heads: int = 4
    """ViT attention heads; the head dim D/heads must be divisible by 4 (2D RoPE: row pairs + column pairs)."""
    mlp_ratio: float = 2.0
    """SwiGLU hidden width = mlp_ratio * dim."""
    merge: int = 2
    """Patch merge window side: merge x merge patches become one token (ViT only)."""
    encoder: str = "vit"
    """``vit`` (patch embed + ViT blocks + 2x2 merge) or ``direct`` (patchify + one linear projection)."""
    rope_base: float = 10000.0
    """2D RoPE frequency base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> VisionConfig:
        values = dict(values or {})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown VisionConfig field(s) {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        """Tokens per image handed to the language model (16 for both defaults)."""
        if self.encoder == "direct":
            return self.grid**2
        return (self.grid // self.merge) ** 2

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"VisionConfig: {msg}")

        need(self.encoder in ENCODERS, f"encoder must be one of {ENCODERS}, got {self.encoder!r}")
        for name in ("image_size", "patch_size", "channels", "depth", "dim", "heads", "merge"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.mlp_ratio > 0, "mlp_ratio must be > 0")
        need(self.image_size % self.patch_size == 0,
             f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.encoder == "vit":
            need(self.grid % self.merge == 0,
                 f"image_size {self.image_size} must be a multiple of patch_size * merge = "
                 f"{self.patch_size * self.merge}")
            need(self.dim % self.heads == 0, f"dim {self.dim} is not divisible by heads {self.heads}")
            need((self.dim // self.heads) % 4 == 0,
                 f"head dim {self.dim // self.heads} must be divisible by 4 (2D RoPE uses row and column pairs)")


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p]`` row-major patches, each flattened in (C, p, p) order (the layout
    of a Conv2d weight, so ``patchify(x) @ conv.weight.flatten(1).T + bias`` equals the strided conv)."""
    B, C, H, W = images.shape
    if H % patch or W % patch:
        raise ValueError(f"image {H}x{W} is not a multiple of the patch size {patch}")
    x = images.reshape(B, C, H // patch, patch, W // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // patch) * (W // patch), C * patch * patch)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up.weight).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down.weight)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patches of each image, q/k RMSNorm, 2D RoPE."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=True)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = linear(x, self.qkv.weight, self.qkv.bias).view(B, N, 3, self.heads, self.head_dim).unbind(2)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)  # [B, H, N, hd]; cos/sin [N, hd] broadcast
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        out = ops.attention(q, k, v.transpose(1, 2))
        return linear(out.transpose(1, 2).reshape(B, N, D), self.proj.weight, self.proj.bias)


class ViTBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, max(1, int(cfg.mlp_ratio * cfg.dim)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PatchMerger(nn.Module):
    """``merge x merge`` consecutive tokens -> one token of the language width (Qwen2-VL PatchMerger, RMSNorm)."""

    def __init__(self, dim: int, out_dim: int, merge: int, eps: float) -> None:
        super().__init__()
        self.group = merge * merge
        self.norm = RMSNorm(dim, eps)
        self.fc1 = nn.Linear(self.group * dim, self.group * dim)
        self.fc2 = nn.Linear(self.group * dim, out_dim)

    def group_windows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, D] -> [B, N/g, g*D]``: window k = tokens ``g*k .. g*k+g-1`` (window-major order required)."""
        B, N, D = x.shape
        return x.reshape(B, N // self.group, self.group * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(linear(self.group_windows(self.norm(x)), self.fc1.weight, self.fc1.bias))
        return linear(h, self.fc2.weight, self.fc2.bias)


class VisionEncoder(nn.Module):
    """``images [B, C, S, S] -> features [B, cfg.num_tokens, out_dim]`` (ViT + merge, or the direct baseline)."""

    perm: torch.Tensor
    positions: torch.Tensor

    def __init__(self, cfg: VisionConfig, out_dim: int) -> None:
        super().__init__()
        cfg.validate()
        self.cfg, self.out_dim = cfg, out_dim
        if cfg.encoder == "direct":
            self.proj = nn.Linear(cfg.channels * cfg.patch_size**2, out_dim)
            return
        g = cfg.grid
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.rope = Rope2D(cfg.dim // cfg.heads, cfg.rope_base)
        self.register_buffer("perm", window_order(g, g, cfg.merge), persistent=False)
        self.register_buffer("positions", grid_positions(g, g, cfg.merge), persistent=False)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.dim, out_dim, cfg.merge, cfg.norm_eps)

    def check_images(self, images: torch.Tensor) -> None:
        """Raise ValueError unless ``images`` is a float ``[B, channels, image_size, image_size]`` tensor."""
        c = self.cfg
        want = f"[B, {c.channels}, {c.image_size}, {c.image_size}]"
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be a 4D tensor {want}, got {got}")
        if images.shape[1] != c.channels:
            raise ValueError(f"images must have {c.channels} channels {want}, got {tuple(images.shape)}")
        if tuple(images.shape[2:]) != (c.image_size, c.image_size):
            raise ValueError(f"images must be {c.image_size}x{c.image_size} {want}, got {tuple(images.shape)} "
                             f"(resize or pad them in the DataModule)")
        if not images.is_floating_point():
            raise ValueError(f"images must be floating point (normalised), got {images.dtype}")

    def patch_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """ViT patch embedding ``[B, N, D]`` in window-major order (the order of ``self.positions``)."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, N, D] row-major
        return x[:, self.perm]

    def encode_patches(self, images: torch.Tensor) -> torch.Tensor:
        """Patch features after the ViT blocks, before the merge: ``[B, N, D]`` (window-major)."""
        x = self.patch_tokens(images)
        cos, sin = self.rope.cos_sin(self.positions)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.check_images(images)
        if self.cfg.encoder == "direct":
            return linear(patchify(images, self.cfg.patch_size), self.proj.weight, self.proj.bias)
        return self.merger(self.encode_patches(images))


def splice_image_features(embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                          image_id: int = ByteTokenizer.image_id) -> torch.Tensor:
    """Replace the embeddings at ``input_ids == image_id`` by ``features`` in order (row by row).

    ``embeds [B, T, C]``; ``features [B_img, N, C]`` or ``[M, C]``. The number of placeholders must equal the number
    of feature vectors (and, for one image per row, every row must hold exactly N placeholders); otherwise ValueError.
    """
    if embeds.dim() != 3 or input_ids.shape != embeds.shape[:2]:
        raise ValueError(f"embeds [B, T, C] and input_ids [B, T] disagree: {tuple(embeds.shape)} vs "
                         f"{tuple(input_ids.shape)}")
    C = embeds.shape[-1]
    if features.shape[-1] != C:
        raise ValueError(f"image features have width {features.shape[-1]}, the language model {C}")
    mask = input_ids == image_id
    flat = features.reshape(-1, C)
    n_slots = int(mask.sum())
    if n_slots != flat.shape[0]:
        raise ValueError(f"{n_slots} <image> placeholder tokens in the batch but {flat.shape[0]} image feature "
                         f"vectors ({tuple(features.shape)}); the counts must match")
    if features.dim() == 3 and features.shape[0] == input_ids.shape[0]:
        per_row = mask.sum(1)
        if bool((per_row != features.shape[1]).any()):
            raise ValueError(f"every row needs exactly {features.shape[1]} <image> placeholders, got "
                             f"{per_row.tolist()}")
    return embeds.masked_scatter(mask.unsqueeze(-1), flat.to(embeds.dtype))
