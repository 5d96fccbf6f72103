"""Every shape threshold that picks between two forms of an op, with the measurement that set it.

The ops read these names at call time (``thresholds.SMALL_ROWS``), so a test or a benchmark can move one. A threshold
only ever changes speed: both forms compute the same values (within float rounding, tested against the reference
forms of glm_lightning/model/ops/reference.py). Kernel limits (what a C++ op is compiled for) are listed last; they are
not tuning knobs.

- SMALL_ROWS: linear without autograd, C++ small_matmul or BLAS mm;
- SMALL_TOKENS: MoE experts without autograd, small_matmul or bmm;
- SEGMENT_TOKENS, SEGMENT_PADDING, SEGMENT_PADDING_WORK: MoE experts, per-expert segments or the padded batch;
- DECODE_GATHER_MIN_KEYS_PER_TOP_K: a DSA decode step, gather the top-k keys or mask all keys.

SMALL_ROWS and SMALL_TOKENS depend on the CPU's vector width (``torch.backends.cpu.get_cpu_capability()``): the C++
``small_matmul`` is written for 16-float (AVX-512) lanes and measured faster than BLAS only there. The capability is
not enough (issue 49): on an Intel Xeon with AVX-512 and AMX (family 6 model 207, torch capability AVX512, MKL, 1
thread, load 3-5) BLAS won with these AVX-512 defaults: cached generation 251 tok/s with both 0 against 233 as shipped
(``bench_decode_thresholds``, 5 alternated rounds, BLAS faster in each), and one [192 x 384] weight of 300 cycled
through took ``small_matmul`` 113 / 102 / 139 us at 1 / 4 / 16 rows against 71 / 79 / 128 us for ``mm(x, W.t())``.
The values here are the shipped defaults (DEFAULTS below); the op-choice table (choice.py), measured on the CPU at hand
by ``python -m glm_lightning.model.ops.tune``, replaces SMALL_ROWS, SMALL_TOKENS and DECODE_GATHER_MIN_KEYS_PER_TOP_K
there (it measures both forms at a few sizes and moves a threshold only where the other form won by its margin).
"""

from __future__ import annotations

import torch

AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
"""Whether this CPU runs AVX-512 (where small_matmul's 16-float lanes are native)."""

SMALL_ROWS = 32 if AVX512 else 0
"""Without autograd, fp32 inputs of at most this many rows (decoding) run ``linear`` through
``glm_lightning::small_matmul`` (csrc/small_matmul.cpp) instead of BLAS's ``mm``, which packs the whole weight matrix on
every call. In a decode step every weight is cold (the step streams the whole model), and there, on the AVX-512
machine, 1 thread, the C++ op was 1.3-1.7x faster than ``mm`` at 16 rows and 1.6-2.2x at 1-4 rows (the model's
[192-768] x [192-384] weights), 1.06-1.17x at 32 and 0.86-1.09x at 64. On an AVX2 CPU (GCC splits the 16-float vectors
in two) BLAS wins, so 0 there: flash-25m cached generation, 16 x 48, 5 alternated rounds on a loaded 2-core AMD EPYC
without AVX-512 (``python -m benchmarks.bench_decode_thresholds``): 1 thread, 77 tok/s with both thresholds as on
AVX-512, 141 with both 0 (1.83x), 109 with only this one 0, 94 with only SMALL_TOKENS 0; 2 threads 28 vs 50 tok/s.
The choice depends on the shape only. small_matmul also sums each row in the same order whatever the other rows are,
which BLAS does not promise: with BLAS a decode row's last bits may depend on how many rows the call has."""

SMALL_TOKENS = 96 if AVX512 else 0
"""Without autograd, an MoE call with at most this many tokens (decoding a few rows, a prefill of a short prompt) runs
its experts through ``small_matmul`` (each weight row streamed once, padding rows skipped; inside a cached decode
``panel_matmul``, the same values) instead of BLAS, which repacks every expert's whole weight matrix per call.
flash-25m's 12 MoE layers, AVX-512, 1 thread: 1.46x faster at 16 tokens, 1.12x at 64, 1.05x at 96 (the dot-product
small_matmul, an AMD EPYC). Since small_matmul packs its weight blocks into panels as it goes (issue 49, Intel Xeon
with AVX-512, 12 layers' weights cycled cold, process time, medians of 9 in turns): 17.8 vs bmm 20.4 ms at 64 tokens,
22.4 vs 27.0 at 96, 25.7 vs 26.3 at 128; this Xeon's measured op table had 96 too. On AVX2 the dot-product form was
slower than BLAS (see SMALL_ROWS): 0 there (the panel form is not measured there yet). The choice depends on the shape
only, never on the routing."""

SEGMENT_TOKENS = 2048
SEGMENT_PADDING = 1.0
"""MoE calls with at least SEGMENT_TOKENS tokens whose padded batch would be at least SEGMENT_PADDING times the real
assignments run per expert segment (no padding); 1.0: every call from SEGMENT_TOKENS on. First 1.25 (the largest load
25% above the mean: a 96-prompt RL prefill, 1.26x faster), with balanced loads left on the padded batch for its ~330
fewer dispatched ops per layer (fwd + bwd). Measured in CPU time, forms in turns (issue 49, Intel Xeon AVX-512 + AMX,
1 thread, ``python -m benchmarks.bench_moe_train --step``): at flash-25m's 4,096 tokens the segments win already
with balanced loads (a fresh layer's largest load is 1.07-1.18x the mean): 1.03x at 1.01x, 1.11-1.16x at 1.09x, 1.22x
at 1.21x (one layer's experts fwd + bwd, the same values bit for bit there), a whole training step 1.05x; the study
model's layer (d 48, 1,024 tokens) 1.01x at 1.04x, 1.10x at 1.07x. The padding's zero rows cost their full GEMM
flops (7-18% of the routed GEMMs), far more than the dispatches at these sizes; SEGMENT_TOKENS (the op table's,
per CPU) keeps small calls on the padded batch."""

SEGMENT_PADDING_WORK = 1_000_000
"""...and whose padding rows' GEMM work, rows x d x h, is at least this much per expert: 18 d h flops per row (fwd +
bwd) wasted on the padded batch against the segments' ~50 extra dispatched ops per expert (views, the per-expert mm).
1e6 is ~18 MFLOP, ~120 us at 150 GFLOP/s, about what those ops cost: the dispatch-bound study model (d 48, h 96, 4
experts, 8 x 128) lost 1.7 ms of its 34 ms step to the segments at SEGMENT_PADDING 1.0 alone (0.95x; Intel Xeon
AVX-512 + AMX, 1 thread, ``python -m benchmarks.bench_moe_train --study-step``) and keeps the padded batch up to a
largest load ~1.4x the mean; flash-25m (d 192, h 384) switches from ~14 padding rows per expert (a largest load
~1.013x the mean at 4,096 tokens; a fresh model's 12 layers: 1.04-1.18x)."""

SEGMENT_PADDING_BF16 = 1.25
"""SEGMENT_PADDING where the experts' GEMMs run in bf16 (bf16-mixed training, mixed_precision.py): the earlier rule,
kept because there the padded batch's bf16 GEMMs (oneDNN, AMX on this Xeon) make its padding rows cheap and the
segments' per-expert calls dear: a whole bf16-mixed flash-25m step took 3.03 s with segments at 1.0 against 2.40 s
with the padded batch (medians of 4, in turns in one process, CPU time, Intel Xeon AVX-512 + AMX, 1 thread;
`bench_bf16_trees` read bf16 / fp32 1.24x with them, 1.78x before)."""

DECODE_GATHER_MIN_KEYS_PER_TOP_K = 4
"""A DSA decode step (one query per row) gathers its top-k keys and values once the cache holds at least this many
times top_k keys; below, it attends over all keys under the top-k mask. Both give the same result. First set with
SDPA (B=16, top_k=64: mask 1.7 vs gather 3.2 ms at 101 keys, gather 4.5 vs mask 5.7 ms at 501 keys). Re-measured
with the C++ decode ops (one flash-25m DSA layer, 16 rows, 1 thread, `python -m benchmarks.bench_decode_gather`):
gather/mask 1.16x at 100 keys, 1.22x at 160, 0.90x at 256, 1.06x at 384, 0.96x at 512 (a loaded machine; see
docs/performance.md, "The ops layer")."""

DEFAULTS: dict[str, float] = {"SMALL_ROWS": SMALL_ROWS, "SMALL_TOKENS": SMALL_TOKENS, "SEGMENT_TOKENS": SEGMENT_TOKENS,
                               "SEGMENT_PADDING": SEGMENT_PADDING, "SEGMENT_PADDING_WORK": SEGMENT_PADDING_WORK,
                               "SEGMENT_PADDING_BF16": SEGMENT_PADDING_BF16,
                               "DECODE_GATHER_MIN_KEYS_PER_TOP_K": DECODE_GATHER_MIN_KEYS_PER_TOP_K}
"""The shipped values above: the op table's defaults (choice.py). Where this CPU's table was measured
(``python -m glm_lightning.model.ops.tune``), choice.apply sets the names above to its values."""

# --- kernel limits: what the C++ ops are compiled for ---------------------------------------------------------------
CPP_MAX_STREAMS = 8
"""Sinkhorn and the stream read/write ops (kMaxStreams, csrc/kernel_helpers.h: Sinkhorn is compiled per stream
count)."""
SITE_READ_MAX_STREAMS = 6
"""The mHC site read (csrc/site_read.cpp: at most 64 logits, (2 + n) n)."""
SHORT_CONV_MAX_KERNEL = 16
"""The short conv + SiLU (csrc/short_conv.cpp)."""
KDA_RECURRENT_SIZES = (16, 32, 64)
"""Head sizes the C++ KDA recurrence is compiled for in fp32 (square; smaller heads are zero-padded up)."""
KDA_RECURRENT_FP64_SIZES = (16,)
"""...and in fp64 (gradcheck only): the 32 and 64 fp64 instantiations took 374 of the file's 474 s of g++ on an AVX2
machine (a fresh clone's first test run waited ~9 min for the build), 100 s without them."""
