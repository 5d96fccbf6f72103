"""The decoding caches: one per layer (:class:`KDACache`, :class:`DSACache`) and the model's (:class:`ModelCache`, the
layers' caches plus the shared position counter).

KDA layers hold a constant-size recurrent state and the short-conv buffer; DSA layers hold preallocated K/V and
indexer-key buffers. mHC, MoE and norms are stateless, so nothing else needs caching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from glm_lightning.model.config import GLMConfig
from glm_lightning.model.kept_panels import KeptPanels


@dataclass
class KDACache:
    """Decode state of one KDA layer.

    ``conv_state [B, ks-1, 3*H*K]``: the last ks-1 raw (pre-conv) q|k|v projections (channel order q, k, v), time
    before channels, so that decoding appends the new projection with one contiguous ``cat`` (the channel-major layout
    made that cat and the conv's product strided).
    ``state [B, H, K, V]``: the fp32 recurrent state.
    """

    conv_state: Tensor
    state: Tensor
    in_weights: tuple[Tensor, Tensor] | None = None
    """The layer's fused input projections for this decode: set by ``model.new_cache`` from the model's kept panels
    (model/kept_panels.py, which sees a change of their parts, also through writes that bump no version counter),
    else built on first use. Weights cannot change during one generation."""

    @classmethod
    def empty(cls, batch: int, cfg: GLMConfig, device: torch.device | str | None = None) -> KDACache:
        H, K = cfg.n_heads, cfg.head_dim
        return cls(
            conv_state=torch.zeros(batch, cfg.kda_conv_size - 1, 3 * H * K, device=device),
            state=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32),
        )

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def repeat_interleave(self, n: int) -> KDACache:
        """Each row replicated n times along the batch (row i -> rows i*n .. i*n+n-1)."""
        return KDACache(self.conv_state.repeat_interleave(n, dim=0), self.state.repeat_interleave(n, dim=0),
                        self.in_weights)

    def index_select(self, rows: Tensor) -> KDACache:
        """The cache of the given batch rows (a copy)."""
        rows = rows.to(self.state.device)
        return KDACache(self.conv_state.index_select(0, rows), self.state.index_select(0, rows), self.in_weights)

    def writable(self) -> bool:
        """Whether the buffers may be updated in place here (inference tensors only inside inference mode)."""
        return torch.is_inference_mode_enabled() or not (self.state.is_inference() or self.conv_state.is_inference())

    def update(self, conv_state: Tensor, state: Tensor) -> None:
        """Take a prefill's last raw projections [B, ks-1, 3HK] and final state: copied in place, or rebound when
        autograd records them (or the buffers are inference tensors outside inference mode)."""
        state = state if state.dtype == torch.float32 else state.float()
        if state.requires_grad or conv_state.requires_grad or not self.writable():
            self.conv_state, self.state = conv_state.contiguous(), state.contiguous()  # decode steps write in place
        else:
            self.conv_state.copy_(conv_state)
            self.state.copy_(state)


@dataclass
class DSACache:
    """Preallocated per-layer DSA decoding state (no ``torch.cat`` growth).

    ``k``, ``v``: ``[B, H_kv, max_seq_len, D]``; ``index_k``: the separate indexer keys ``[B, max_seq_len, D_I]``;
    ``key_valid``: ``[B, max_seq_len]`` (False = padding); ``length``: positions ``[0, length)`` are filled.
    Create it under the same grad mode it is used in (e.g. inside ``torch.inference_mode()`` for rollouts).
    """

    k: torch.Tensor
    v: torch.Tensor
    index_k: torch.Tensor
    key_valid: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, cfg: GLMConfig, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> DSACache:
        """Zeroed buffers for ``batch`` rows and ``cfg.max_seq_len`` positions, length 0."""
        n = cfg.max_seq_len
        return cls(
            k=torch.zeros(batch, cfg.n_kv_heads, n, cfg.head_dim, device=device, dtype=dtype),
            v=torch.zeros(batch, cfg.n_kv_heads, n, cfg.head_dim, device=device, dtype=dtype),
            index_k=torch.zeros(batch, n, cfg.index_head_dim if cfg.dsa_indexer else 0, device=device, dtype=dtype),
            key_valid=torch.zeros(batch, n, device=device, dtype=torch.bool),
            length=0,
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def repeat_interleave(self, n: int) -> DSACache:
        """A new cache with every row repeated ``n`` times consecutively (row b -> rows b*n .. b*n+n-1)."""
        return DSACache(self.k.repeat_interleave(n, 0), self.v.repeat_interleave(n, 0),
                        self.index_k.repeat_interleave(n, 0), self.key_valid.repeat_interleave(n, 0), self.length)

    def index_select(self, rows: torch.Tensor | list[int]) -> DSACache:
        """A new cache holding only ``rows`` (in that order), e.g. to drop finished samples."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        return DSACache(self.k.index_select(0, rows), self.v.index_select(0, rows),
                        self.index_k.index_select(0, rows), self.key_valid.index_select(0, rows), self.length)

    def check_append(self, batch: int, n_new: int) -> None:
        """Raise ``ValueError`` if ``n_new`` tokens for ``batch`` rows do not fit."""
        if batch != self.batch_size:
            raise ValueError(f"DSACache holds {self.batch_size} rows but the input has {batch}")
        if self.length + n_new > self.max_seq_len:
            raise ValueError(f"DSACache overflow: {self.length} cached + {n_new} new tokens > max_seq_len "
                             f"{self.max_seq_len}")

    def append(self, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None, valid: torch.Tensor | None) -> int:
        """Write ``T`` new positions at ``[length, length + T)`` and advance ``length``; returns the new length.
        ``index_k`` None: a layer without an indexer (its cache holds no indexer keys)."""
        n_new = k.shape[2]
        self.check_append(k.shape[0], n_new)
        start, end = self.length, self.length + n_new
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        if index_k is not None:
            self.index_k[:, start:end] = index_k
        self.key_valid[:, start:end] = True if valid is None else valid
        self.length = end
        return end


LayerCache = KDACache | DSACache


class PanelStore(dict):
    """weight -> its panel-packed copy for one generation's decode (ops.matmul.packed), and the dtype the panels hold:
    fp32, or bf16 for a model whose matrices hold bf16 values (generation.sampling_weights' copy), whose decode then
    streams half the bytes for the same products. With ``kept`` (the model's :class:`KeptPanels`) it starts with the
    panels kept from earlier generations, and what it packs is kept for later ones."""

    def __init__(self, dtype: torch.dtype = torch.float32, kept: KeptPanels | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.kept = kept
        if kept is not None:
            self.update((weight, held.value) for weight, held in kept.panels.items())


@dataclass
class ModelCache:
    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0
    """Tokens (including left padding) already processed; the next token sits at position `length`."""
    packed: PanelStore = field(default_factory=PanelStore)
    """The weights' panel-packed copies for this generation's few-row linears and experts (ops.matmul.packed_weights:
    packed on first use, shared by the caches derived from this one; ``model.new_cache`` starts it with the panels
    the model kept from earlier generations, model/kept_panels.py). Weights cannot change during one generation."""

    def repeat_interleave(self, n: int) -> ModelCache:
        """Each row replicated n times (prefill a prompt once, then sample G completions from it)."""
        return ModelCache([c.repeat_interleave(n) for c in self.layers], self.length, self.packed)

    def index_select(self, rows: torch.Tensor) -> ModelCache:
        return ModelCache([c.index_select(rows) for c in self.layers], self.length, self.packed)
