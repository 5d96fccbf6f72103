"""The model's ops: one public function per op, below the model's layers.

Each op has its reference form in ``reference.py`` (plain PyTorch following the papers' equations, autograd for the
backward) and fast forms behind the function here: C++ ops (glm_lightning/model/cext.py, csrc/) where they take the
tensors, else PyTorch forms that dispatch fewer ops. ``backend.takes`` is the one predicate (device, dtype, library
loaded, the op not switched off); ``thresholds.py`` holds every shape threshold with its measurement; ``choice.py`` the
table of which form runs on this CPU (measured by ``python -m glm_lightning.model.ops.tune``, else the shipped
defaults; put in force on import); ``backend.cpp_ops(False)`` switches the
C++ ops off for a block (GLM_LIGHTNING_EXT=0 never loads them). ``mixed_precision.py`` is how the ops meet bf16 (GEMMs
in bf16, native or emulated; attention in fp32; every other op in fp32, cast at its boundary, except the MoE's SwiGLU
and row moves, whose C++ ops take bf16 with fp32 math). ``decode.py`` is a cached fp32 decode step's backend
decision, made once per step: the decode-only entries of a few ops call their C++ op directly.

| op | function | file |
|---|---|---|
| RMSNorm | ``rms_norm`` | norm.py |
| KDA's gated head norm | ``gated_head_norm`` | norm.py |
| linear (x W^T + b); a decode's few-row matmuls on weights packed once per generation | ``linear``,
  ``packed_weights`` | matmul.py |
| attention (SDPA; fp32 under bf16), a batched product (bf16 GEMM native or emulated) | ``attention``, ``product`` | mixed_precision.py |
| Sinkhorn-Knopp | ``sinkhorn`` | mhc.py |
| mHC stream read / write, site read | ``stream_read``, ``stream_write``, ``site_read`` | mhc.py |
| KDA short conv + SiLU, features | ``short_conv``, ``kda_features`` | kda_inputs.py |
| KDA over T tokens (training, prefill): conv, features, core, head norm | ``kda_sequence`` | kda_sequence.py |
| KDA core (the gated delta rule over T tokens) | ``kda_core`` (chunked form: ``kda_chunked``) | kda_recurrent.py, kda_chunkwise.py |
| KDA decode step | ``kda_decode_step`` | kda_decode.py |
| MoE routing, experts, shared expert | ``moe_route``, ``moe_experts``, ``swiglu_mlp``, ``moe_decode`` | moe.py |
| DSA indexer scores, top-k, decode attention | ``index_scores``, ``topk_mask``, ``topk_select``, ``decode_attention``,
  ``single_query_attention`` | dsa.py |
| a decode step's block (KDA, DSA, or its MoE half) as one op, the kernels above in their order | ``block``,
  ``moe_half`` (called by model.Block) | block_decode.py |
"""

from glm_lightning.model.ops import choice, reference
from glm_lightning.model.ops.backend import cpp_loaded, cpp_ops
from glm_lightning.model.ops.dsa import (decode_attention, fill_empty_rows, index_scores, single_query_attention,
                                         topk_mask, topk_select)
from glm_lightning.model.ops.kda_chunkwise import kda_chunked
from glm_lightning.model.ops.kda_decode import kda_decode_step
from glm_lightning.model.ops.kda_inputs import kda_features, short_conv
from glm_lightning.model.ops.kda_recurrent import kda_core
from glm_lightning.model.ops.kda_sequence import kda_sequence
from glm_lightning.model.ops.matmul import linear
from glm_lightning.model.ops.mixed_precision import attention, bf16_gemm, gemm_mode, product
from glm_lightning.model.ops.mhc import site_read, sinkhorn, stream_read, stream_write
from glm_lightning.model.ops.moe import moe_decode, moe_experts, moe_route, swiglu_mlp
from glm_lightning.model.ops.norm import gated_head_norm, rms_norm

__all__ = ["attention", "bf16_gemm", "cpp_loaded", "cpp_ops", "decode_attention", "fill_empty_rows", "gated_head_norm", "index_scores",
           "gemm_mode", "kda_chunked", "kda_core", "kda_decode_step", "kda_features", "kda_sequence", "linear", "product",
           "moe_decode", "moe_experts", "moe_route",
           "reference", "rms_norm", "short_conv", "single_query_attention", "sinkhorn", "site_read", "stream_read",
           "stream_write", "swiglu_mlp", "topk_mask", "topk_select"]

choice.apply()  # this CPU's op table for the thread count in force (glm_lightning.threads re-applies it)
