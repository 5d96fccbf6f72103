"""ModelCache: the decoding state of the whole model (one entry per layer plus the shared position counter).

KDA layers hold a constant-size recurrent state and the short-conv buffer; DSA layers hold preallocated K/V and
indexer-key buffers. mHC, MoE and norms are stateless, so nothing else needs caching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm_lightning.model.dsa import DSACache
from glm_lightning.model.kda import KDACache

LayerCache = KDACache | DSACache


@dataclass
class ModelCache:
    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0
    """Tokens (including left padding) already processed; the next token sits at position `length`."""

    def repeat_interleave(self, n: int) -> ModelCache:
        """Each row replicated n times (prefill a prompt once, then sample G completions from it)."""
        return ModelCache([c.repeat_interleave(n) for c in self.layers], self.length)

    def index_select(self, rows: torch.Tensor) -> ModelCache:
        return ModelCache([c.index_select(rows) for c in self.layers], self.length)
