"""GLMModel: the one shared model that every training stage wraps. Read top to bottom.

    ids ──embed──> x [B,T,C] ──expand──> streams [B,T,n,C]
        for each block (pattern "LLLS": KDA, KDA, KDA, DSA, ...):
            streams = mHC_site(streams, h -> Mixer(RMSNorm(h)))      Mixer = KDA linear attn | DSA sparse attn
            streams = mHC_site(streams, h -> MoE(RMSNorm(h)))        routed top-k SwiGLU experts + shared expert
        streams ──mean──> RMSNorm ──> @ embed.T (tied) ──> logits [B,T,V]

aux_loss = sum over layers of the MoE sequence-balance loss and the DSA indexer KL loss (each already weighted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm_lightning.model.cache import DSACache, KDACache, LayerCache, ModelCache, PanelStore
from glm_lightning.model.config import GLMConfig
from glm_lightning.model.dsa import SparseAttention
from glm_lightning.model.kda import KDAttention
from glm_lightning.model.kept_panels import kept_panels
from glm_lightning.model.mhc import HyperConnection, collapse_streams, expand_streams
from glm_lightning.model.mlp import DenseSwiGLU
from glm_lightning.model.moe import MoE
from glm_lightning.model.norm import RMSNorm
from glm_lightning.model.ops import block_decode, decode, linear
from glm_lightning.model.ops.matmul import packed_weights


@dataclass
class GLMOutput:
    logits: torch.Tensor
    """[B, T, vocab] next-token logits."""
    aux_loss: torch.Tensor
    """Scalar: MoE balance loss + DSA indexer loss over all layers (weighted); 0 for a call with a decoding cache
    unless training with autograd on (generation never reads it)."""


class Block(nn.Module):
    """Token mixer (KDA or DSA) and MoE (or, with ``ffn: dense``, a dense SwiGLU of equal active size), each wrapped
    by its own mHC site."""

    def __init__(self, cfg: GLMConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = KDAttention(cfg) if kind == "L" else SparseAttention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoE(cfg) if cfg.ffn == "moe" else DenseSwiGLU(cfg)  # `moe` either way: checkpoint keys stay
        site = dict(n=cfg.hc_streams, dim=cfg.d_model, iters=cfg.sinkhorn_iters, eps=cfg.hc_eps,
                    alpha_init=cfg.hc_alpha_init, norm_eps=cfg.norm_eps)
        self.hc_mixer = HyperConnection(**site, site_index=2 * index)
        self.hc_moe = HyperConnection(**site, site_index=2 * index + 1)

    def forward(self, streams: torch.Tensor, valid: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [B,T,n,C] -> (streams, aux loss of this block: DSA indexer loss + MoE balance loss)."""
        if cache is not None:  # a decode step's block as one op, where it takes it (ops/block_decode.py)
            out = block_decode.block(self, streams, valid, cache)
            if out is not None:
                return out, self.moe._no_aux
        h, maps = self.hc_mixer.read(streams)
        y, mixer_aux = self.mixer(self.mixer_norm(h), valid=valid, cache=cache)
        streams = self.hc_mixer.write(streams, maps, y)
        if cache is not None:  # a decode step's MoE half as one op, where it takes it
            out = block_decode.moe_half(self, streams)
            if out is not None:
                return out, mixer_aux
        h, maps = self.hc_moe.read(streams)
        # with a cache and nothing to train (decoding) no one reads the balance loss (DSA skips its own likewise)
        y, moe_aux = self.moe(self.moe_norm(h), want_aux=cache is None or (self.training and torch.is_grad_enabled()))
        return self.hc_moe.write(streams, maps, y), mixer_aux + moe_aux


class GLMModel(nn.Module):
    """Byte-level GLM-5-style LM: tied embeddings, mHC streams, KDA/DSA hybrid, MoE."""

    decode_weights: torch.dtype = torch.float32
    """The dtype a cached decode packs the weights of its few-row matmuls in (ModelCache.packed): bf16 only on a model
    whose matrices hold bf16 values (generation.sampling_weights' bf16 copy), else its decode would round them."""

    def __init__(self, cfg: GLMConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, kind, i) for i, kind in enumerate(cfg.layer_kinds))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head: nn.Linear | None = None  # None = tied to the embedding (the default); see untie_head()

    # --- forward ------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                cache: ModelCache | None = None, input_embeds: torch.Tensor | None = None) -> GLMOutput:
        """Logits for `input_ids` [B, T] (or precomputed `input_embeds` [B, T, C], e.g. with image tokens spliced in).

        `valid` [B, T] marks real tokens (False = left padding); `cache` (from `new_cache`) makes the call
        incremental: the tokens continue the sequences held in the cache, which is updated in place. Decode steps (one
        token per row with a cache, no autograd) pack the weights of their few-row matmuls once into the cache
        (ops.matmul.packed_weights); a prefill does not (a cache used for one call would pay the packing for nothing).
        Decode steps of an fp32 model also decide once which C++ ops they call directly (ops.decode.fp32_step).
        """
        src = input_ids if input_ids is not None else input_embeds  # checked in _forward (_embed_checked)
        decoding = (cache is not None and not torch.is_grad_enabled() and isinstance(src, torch.Tensor)
                    and src.dim() >= 2 and src.shape[1] == 1)
        weight = self.embed.weight
        fp32 = decoding and weight.dtype is torch.float32 and weight.is_cpu
        with packed_weights(cache.packed if decoding else None), decode.fp32_step(fp32):
            return self._forward(input_ids, valid, cache, input_embeds)

    def _forward(self, input_ids: torch.Tensor | None, valid: torch.Tensor | None, cache: ModelCache | None,
                 input_embeds: torch.Tensor | None) -> GLMOutput:
        x = self._embed_checked(input_ids, input_embeds, cache)
        streams = expand_streams(x, self.cfg.hc_streams)
        aux = x.new_zeros(())
        want_aux = cache is None or (self.training and torch.is_grad_enabled())  # decoding: nothing reads it
        for i, block in enumerate(self.blocks):
            streams, block_aux = block(streams, valid=valid, cache=None if cache is None else cache.layers[i])
            if want_aux:
                aux = aux + block_aux
        if cache is not None:
            cache.length += x.shape[1]
        h = self.final_norm(collapse_streams(streams))
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return GLMOutput(logits=linear(h, head), aux_loss=aux)

    def untie_head(self) -> None:
        """Give the output head its own copy of the embedding matrix, so a stage (e.g. RL) can train the head while
        the input embedding stays frozen. Idempotent."""
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=False,
                                     device=self.embed.weight.device)
            with torch.no_grad():
                self.lm_head.weight.copy_(self.embed.weight)

    def _embed_checked(self, input_ids: torch.Tensor | None, input_embeds: torch.Tensor | None,
                       cache: ModelCache | None) -> torch.Tensor:
        """Shape, dtype and context checks (no host sync), then the embedding. The id *range* is checked by
        `check_ids` at the API boundary (generation, datasets), not here: min/max would sync on every forward; an
        out-of-range id still fails loudly, in the embedding lookup."""
        if (input_ids is None) == (input_embeds is None):
            raise ValueError("pass exactly one of input_ids or input_embeds")
        if input_embeds is not None:
            if input_embeds.dim() != 3 or input_embeds.shape[-1] != self.cfg.d_model:
                raise ValueError(f"input_embeds must be [B, T, {self.cfg.d_model}], got {tuple(input_embeds.shape)}")
            length = input_embeds.shape[1]
        else:
            self._check_id_tensor(input_ids)
            length = input_ids.shape[1]
        past = 0 if cache is None else cache.length
        if past + length > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {past + length} exceeds the configured context "
                             f"max_seq_len={self.cfg.max_seq_len}")
        return input_embeds if input_embeds is not None else self.embed(input_ids)

    @staticmethod
    def _check_id_tensor(input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a LongTensor of shape [B, T]")
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}): give at least one token per row")

    def check_ids(self, input_ids: torch.Tensor) -> None:
        """Raise a clear error for a non-[B,T] / non-integer / out-of-range id tensor (the API-boundary check)."""
        self._check_id_tensor(input_ids)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    # --- decoding caches ----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, device: torch.device | None = None) -> ModelCache:
        """Empty decoding cache: constant-size KDA state for 'L' layers, preallocated KV + indexer keys for 'S', and
        the decode's weight panels this model kept from earlier generations where its weights are unchanged
        (model/kept_panels.py)."""
        device = device or self.embed.weight.device
        dtype = self.embed.weight.dtype  # the keys and values DSA caches are the model's activations
        layers: list[LayerCache] = [
            KDACache.empty(batch, self.cfg, device) if kind == "L" else DSACache.empty(batch, self.cfg, device, dtype)
            for kind in self.cfg.layer_kinds]
        kept = kept_panels(self, self.decode_weights)
        if kept is not None:
            for block, layer in zip(self.blocks, layers):
                if isinstance(layer, KDACache) and isinstance(block.mixer, KDAttention):
                    layer.in_weights = block.mixer.kept_in_weights(kept)
        return ModelCache(layers, packed=PanelStore(self.decode_weights, kept))

    # --- MoE balancing and logging ------------------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.blocks if isinstance(b.moe, MoE)]  # none with ffn "dense"

    def update_balance_bias(self) -> None:
        """Aux-loss-free balancing: nudge every MoE's selection bias toward equal load (call after optimizer.step)."""
        for moe in self.moe_layers():
            moe.update_balance_bias()

    def expert_loads(self) -> dict[int, torch.Tensor]:
        """Per-layer fraction of routed tokens per expert, as last observed during training."""
        return {i: moe.expert_load() for i, moe in enumerate(self.moe_layers())}

    # --- parameter accounting -----------------------------------------------------------------------------------
    def num_parameters(self) -> dict[str, int]:
        """Total (tied weights counted once) and active per token (only top_k of n_experts routed experts)."""
        total = sum(p.numel() for p in self.parameters())  # parameters() already deduplicates the tied weight
        cfg = self.cfg
        routed = cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.expert_hidden if cfg.ffn == "moe" else 0
        inactive = routed - routed * cfg.moe_top_k // cfg.n_experts
        return {"total": total, "active": total - inactive}
