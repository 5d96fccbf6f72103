"""Image-token adapters: low-rank adapters that change the language model only at image-token positions.

The idea is Partial LoRA (InternLM-XComposer2, Dong et al. 2024, arXiv 2401.16420) and CogVLM's visual expert
(Wang et al. 2023, arXiv 2311.03079): the image tokens get extra trainable weights, the text tokens keep the
pre-trained ones. Here each adapter sits *in parallel to a whole sublayer* (a block's token mixer or its MoE; a
parallel adapter in the sense of He et al. 2022, arXiv 2110.04366) instead of inside one linear, because the model
fuses its q/k/v weights and calls them as raw tensors::

    y = sublayer(x)                                   x = the sublayer's (normed) input [B, T, C_in]
    y = y + mask * scale * (x @ down^T) @ up^T        mask [B, T, 1]: 1 at <image> positions, 0 elsewhere

with down [r, C_in] (nn.Linear's init), up [C_out, r] = 0, scale = alpha / r. up = 0 makes the adapted model exactly
the original at the start, and a text-only input (mask all zero, or no mask set) gives exactly the frozen model's
outputs forever: fine-tuning on images cannot cost any text skill. Text positions of an image prompt still change,
because they attend to image positions whose states the adapters shape; that is how the answer learns to depend on
the picture (so the last block's adapters never learn: no later position reads what they write). Unlike LoRA these
adapters cannot be merged into the weights (they depend on the position), so they stay separate parameters in the
checkpoint. The mask covers one forward over whole sequences (the vision stage's use), not cached decoding.

    adapters = ImageTokenAdapters(model, ["blocks.*.mixer", "blocks.*.moe"], width=192, rank=16)
    with adapters.active(input_ids == image_id):
        out = model(input_embeds=embeds)
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from glm_lightning.lora import check_low_rank_args


class ImageTokenAdapter(nn.Module):
    """One low-rank parallel adapter: ``delta = mask * scale * (x @ down^T) @ up^T``, up = 0 at the start."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.down = nn.Parameter(torch.empty(rank, in_features))
        self.up = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))
        self.mask: torch.Tensor | None = None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        assert mask is not None
        return (x @ self.down.t()) @ (self.up.t() * self.scale) * mask

    def hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook on the sublayer: add the adapter's output at the masked positions (no mask: unchanged)."""
        if self.mask is None:
            return output
        x = args[0]
        if isinstance(output, tuple):
            return (output[0] + self.delta(x).to(output[0].dtype), *output[1:])
        return output + self.delta(x).to(output.dtype)


class ImageTokenAdapters(nn.Module):
    """Adapters on every submodule of `model` whose name matches a glob pattern; switched on by :meth:`active`.

    The sublayers must take the hidden states ``[B, T, width]`` as their first positional argument and return
    states of the same width (or a tuple starting with them), like the model's token mixers and MoEs."""

    def __init__(self, model: nn.Module, patterns: Sequence[str], width: int, rank: int = 16,
                 alpha: float = 16.0) -> None:
        super().__init__()
        check_low_rank_args(patterns, rank, alpha, "image adapter")
        if rank > width:
            raise ValueError(f"image adapter rank {rank} exceeds the width {width}")
        modules = dict(model.named_modules())
        targets: list[str] = []
        for pattern in patterns:
            hits = [n for n in modules if n and fnmatchcase(n, pattern)]
            if not hits:
                close = difflib.get_close_matches(pattern, list(modules), n=5, cutoff=0.3)
                raise ValueError(f"image adapter pattern {pattern!r} matches no submodule; closest names: "
                                 f"{close or list(modules)[1:6]}")
            targets += [n for n in hits if n not in targets]
        self.targets = targets
        self.adapters = nn.ModuleDict()
        self._handles = []
        for name in targets:
            w = next(modules[name].parameters(), None)
            adapter = ImageTokenAdapter(width, width, rank, alpha)
            if w is not None:
                adapter.to(device=w.device, dtype=w.dtype)
            self.adapters[name.replace(".", "_")] = adapter
            self._handles.append(modules[name].register_forward_hook(adapter.hook))

    @contextlib.contextmanager
    def active(self, image_mask: torch.Tensor) -> Iterator[None]:
        """Within the block, the adapters act at the positions where ``image_mask [B, T]`` is true."""
        mask = image_mask.unsqueeze(-1).to(next(iter(self.parameters())).dtype)
        for adapter in self.adapters.values():
            adapter.mask = mask
        try:
            yield
        finally:
            for adapter in self.adapters.values():
                adapter.mask = None

    def remove(self) -> None:
        """Take the hooks off the model (the adapters stay as plain modules)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
