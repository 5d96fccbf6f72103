"""A cached fp32 decode step's blocks as one C++ op each (csrc/block_decode.cpp): a KDA block (``kda_block_decode``),
a DSA block below its gathered form (``dsa_block_decode``: sparse, or the dense bypass within top-k keys) and, where those do not take the block, its MoE half
(``moe_half_decode``: site read, RMSNorm, MoE layer, stream write). They call the kernels of the ops' path in the same
order as C++ functions, so the values are the same bit for bit (tests/test_block_decode.py).

Why: with every op of a decode step in C++, the step was still ~4-5 ms of Python and dispatch out of ~15 (flash-25m,
16 rows, 1 thread): module calls, views and each op's entry checks between ~170 C++ calls. A block is now one call.

Entered from ``Block.forward`` with a decoding cache; each entry returns None where the ops' path would not run these
C++ forms on these tensors (outside an fp32 decode step, the op table switching a part off, more rows than the
few-row forms take, streams not contiguous fp32, one stream, a dense FFN, DSA's gathered form): the
caller then runs the block's modules as before. The parameter lists are built once per generation and block, and
kept in the generation's panel store beside the packed weights they hold (ops.matmul.packed: the same lifetime).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm_lightning.model.ops import backend, decode, matmul, thresholds

Args = tuple[list[Tensor], list[float], list[int]]
"""The op's parameter lists (tensors, floats, ints), in the order csrc/block_decode.cpp reads them."""


def block(block: nn.Module, streams: Tensor, valid: Tensor | None, cache) -> Tensor | None:
    """A block's decode step as one op (:func:`kda_block` or :func:`dsa_block` by its kind), or None."""
    if block.kind == "L":
        return kda_block(block, streams, valid, cache)
    return dsa_block(block, streams, valid, cache)


def kda_block(block: nn.Module, streams: Tensor, valid: Tensor | None, cache) -> Tensor | None:
    """A KDA block's decode step (mHC site, RMSNorm, KDA, then the MoE half) on streams [B, 1, n, C], the layer's
    KDACache updated in place, with padding rows (``valid`` [B, 1] False) as identity steps where the padded path's
    C++ ops are on (``kda_block_pads``); None where the ops' path would not run it as these C++ forms."""
    if not decode.cpp("kda_block") or not _takes(streams) or not cache.writable():
        return None
    if valid is not None and not decode.cpp("kda_block_pads"):
        return None
    args = _cached(block, "kda_block", lambda: _kda_args(block, cache))
    if args is None:
        return None
    return torch.ops.glm_lightning.kda_block_decode(streams, cache.conv_state, cache.state,
                                                    None if valid is None else valid.to(torch.bool), *args)


def dsa_block(block: nn.Module, streams: Tensor, valid: Tensor | None, cache) -> Tensor | None:
    """A DSA block's decode step (mHC site, RMSNorm, DSA with the new token written into its DSACache, its ``valid``
    flag [B, 1] too, then the MoE half) on streams [B, 1, n, C], sparse or, while the cache holds at most top-k keys,
    the dense bypass; None where the ops' path would not run it as these C++ forms: the gathered form (a long cache:
    thresholds), a full cache (the module path raises)."""
    if not decode.cpp("dsa_block") or not _takes(streams):
        return None
    args = _cached(block, "dsa_block", lambda: _dsa_args(block))
    if args is None:
        return None
    start, top_k = cache.length, block.mixer.top_k
    keys = start + 1
    if (keys >= thresholds.DECODE_GATHER_MIN_KEYS_PER_TOP_K * top_k or keys > cache.max_seq_len
            or streams.shape[0] != cache.batch_size):
        return None
    out = torch.ops.glm_lightning.dsa_block_decode(
        streams, cache.k, cache.v, cache.index_k, cache.key_valid, start,
        None if valid is None else valid.to(torch.bool),
        backend.takes(streams, fp64=False, op="single_query_attention"), *args)
    cache.length = keys
    return out


def moe_half(block: nn.Module, streams: Tensor) -> Tensor | None:
    """A block's MoE half (mHC site, RMSNorm, MoE layer, stream write) on streams [B, 1, n, C] inside a decode step;
    None where the ops' path would not run it as these C++ forms."""
    if not decode.cpp("moe_half") or not _takes(streams):
        return None
    args = _cached(block, "moe_half", lambda: _join(_site_args(block.hc_moe, block.moe_norm), _moe_args(block.moe)))
    if args is None:
        return None
    return torch.ops.glm_lightning.moe_half_decode(streams, *args)


def _takes(streams: Tensor) -> bool:
    """The per-call conditions of the C++ forms the block op runs: contiguous fp32 streams [B, 1, n, C], 2..max
    streams, and few enough rows for the few-row linears and the one-op MoE layer (ops.matmul.linear, ops.moe_decode;
    their thresholds read per call: the op table may change them)."""
    if streams.dtype is not torch.float32 or streams.dim() != 4 or not streams.is_contiguous():
        return False
    rows, _, n, _ = streams.shape
    return (matmul._packs is not None and 1 < n <= min(thresholds.SITE_READ_MAX_STREAMS, thresholds.CPP_MAX_STREAMS)
            and 0 < rows <= thresholds.SMALL_ROWS and rows <= thresholds.SMALL_TOKENS
            and rows < thresholds.SEGMENT_TOKENS)


def _cached(block: nn.Module, kind: str, build) -> Args | None:
    """The block's parameter lists for ``kind``, built on its first decode step of this generation and kept in the
    panel store (None, kept too: the block's parameters are not all fp32, or a sub-layer of another kind)."""
    store = matmul._packs
    key = (block, kind)
    if key not in store:
        store[key] = build()
    return store[key]


def _join(*parts: Args | None) -> Args | None:
    if any(p is None for p in parts):
        return None
    return ([t for p in parts for t in p[0]], [f for p in parts for f in p[1]], [i for p in parts for i in p[2]])


def _fp32(*tensors: Tensor | None) -> bool:
    return all(t is not None and t.dtype is torch.float32 for t in tensors)


def _site_args(site: nn.Module, norm: nn.Module) -> Args | None:
    """An mHC site's read (HyperConnection._params) and the sub-layer's RMSNorm."""
    if getattr(site, "n", 1) == 1:
        return None
    phi, alpha, bias, alpha_index, scale, shift, site_eps, iters, eps = site._params()
    if not _fp32(phi, alpha, bias, scale, shift, norm.weight):
        return None
    return [phi, alpha, alpha_index, bias, scale, shift, norm.weight], [site_eps, eps, norm.eps], [iters]


def _kda_args(block: nn.Module, cache) -> Args | None:
    """The KDA block: its mixer site and norm, KDAttention's decode step (kda.py: the fused input projections of
    ``_in_weights``, the gates' projections, the core's parameters, o_proj), then the MoE half."""
    from glm_lightning.model.kda import KDAttention

    kda = block.mixer
    if not isinstance(kda, KDAttention):
        return None
    w_qkv, w_small = kda._in_weights(cache)
    mats = (w_qkv, w_small, kda.f_b_proj.weight, kda.g_b_proj.weight, kda.o_proj.weight)
    conv = kda.conv.weight
    if not _fp32(*mats, kda.dt_bias, kda.g_b_proj.bias, conv, kda.A_log, kda.o_norm.weight):
        return None
    p_qkv, p_small, p_fb, p_gb, p_o = (matmul.packed(w) for w in mats)
    mixer = ([p_qkv, p_small, p_fb, kda.dt_bias, p_gb, kda.g_b_proj.bias, conv.view(conv.shape[0], conv.shape[-1]),
              kda.A_log, kda._qk_rescale, kda.o_norm.weight, p_o], [kda.lower_bound, kda.o_norm.eps],
             [kda.n_heads, kda.head_dim, kda.o_proj.weight.shape[0]])
    moe = _join(_site_args(block.hc_moe, block.moe_norm), _moe_args(block.moe))
    return _join(_site_args(block.hc_mixer, block.mixer_norm), mixer, moe)


def _dsa_args(block: nn.Module) -> Args | None:
    """The DSA block: its mixer site and norm, SparseAttention's decode step (dsa.py ``_forward_cached``: the
    projections, q/k norms, the indexer's key and query with its RoPE table, the scale of its head weights), then the
    MoE half. Only for a layer with an indexer with RoPE and no RoPE on the main attention (the presets')."""
    from glm_lightning.model.dsa import SparseAttention

    dsa = block.mixer
    if not isinstance(dsa, SparseAttention) or dsa.indexer is None or dsa.indexer.rope is None or dsa.rope is not None:
        return None
    ix = dsa.indexer
    mats = (dsa.q_proj.weight, dsa.k_proj.weight, dsa.v_proj.weight, dsa.o_proj.weight, ix.q_proj.weight,
            ix.w_proj.weight, ix.k_proj.weight)
    vectors = (dsa.q_norm.weight, dsa.k_norm.weight, ix.k_norm.weight, ix.k_norm.bias, ix.rope.cos, ix.rope.sin)
    if not _fp32(*mats, *vectors):
        return None
    wq, wk, wv, wo, iwq, iww, iwk = (matmul.packed(w) for w in mats)
    mixer = ([wq, dsa.q_norm.weight, wk, dsa.k_norm.weight, wv, wo, iwq, iww, iwk, ix.k_norm.weight, ix.k_norm.bias,
              ix.rope.cos, ix.rope.sin], [dsa.q_norm.eps, dsa.k_norm.eps, ix.k_norm.eps, ix.w_scale],
             [dsa.n_heads, dsa.n_kv_heads, dsa.head_dim, ix.n_heads, ix.head_dim, dsa.top_k,
              dsa.o_proj.weight.shape[0]])
    moe = _join(_site_args(block.hc_moe, block.moe_norm), _moe_args(block.moe))
    return _join(_site_args(block.hc_mixer, block.mixer_norm), mixer, moe)


def _moe_args(moe: nn.Module) -> Args | None:
    """The MoE layer's decode op (ops.moe_decode's arguments)."""
    from glm_lightning.model.moe import MoE

    if not isinstance(moe, MoE):
        return None
    shared = moe.shared_gate_up is not None and moe.shared_down is not None
    if not _fp32(moe.router_weight, moe.w_gate_up, moe.w_down) or (
            shared and not _fp32(moe.shared_gate_up, moe.shared_down)):
        return None
    packed = matmul.packed
    tensors = [packed(moe.router_weight), moe.expert_bias, packed(moe.w_gate_up), packed(moe.w_down)]
    if shared:
        tensors += [packed(moe.shared_gate_up), packed(moe.shared_down)]
    return tensors, [moe.routed_scaling], [moe.router_weight.shape[0], moe.top_k, moe.w_gate_up.shape[1],
                                           moe.shared_gate_up.shape[0] if shared else 0]
