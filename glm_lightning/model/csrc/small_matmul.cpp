// x @ W^T for a few rows per weight matrix, W as the model stores it, [out, in] (without autograd: prefill, decoding
// without packed weights).
//
// Why: a prefill sends each MoE expert 5-40 tokens, a decode step 2-8; BLAS packs the whole weight matrix into its
// panel layout on every call, so a GEMM with 4 rows costs nearly what one with 100 rows does. Here each weight is read
// once. The form before (dot products along `in`, each ending in a horizontal sum) ran the weights at 2-3 GB/s on an
// Intel Xeon (AVX-512, 1 thread), a third of a plain read, and 2.7x slower than panel_matmul even with the weights in
// L2 (flash-25m's experts at 44 tokens). Now each task transposes its block of 64 weight rows once into a per-thread
// scratch of output panels, [panels, in, L] (the layout of csrc/panel_matmul.cpp's panel_pack: panel p holds
// W[pL .. pL+L-1, k] at row k), with register transposes of L x L blocks, and multiplies from there: each x[m, k]
// broadcast into a vector of L outputs, a register tile of rows x panels over the whole `in` loop, no horizontal sums.
// flash-25m's routed experts, 12 layers' weights cycled cold, 1 thread, Intel Xeon (AVX-512, a shared machine, process
// time, medians of 11, the forms in turns): 44 tokens 24-26 -> 17-18 ms, 64 tokens 31-32 -> 17-19, 16 tokens 16-18 ->
// 12-13 (panel_matmul on weights packed beforehand: 12-13 / 12-14 / 10; a plain read of the 85 MB: 9-10 ms). Tried and
// dropped: weights broadcast against x's rows as lanes (no transposes, but every weight's multiply-add on a vector of
// rows, mostly padding at 5-16 rows: 1.2-1.5x slower), prefetching the next chunk during the tiles (no gain).
//
//   small_matmul(x [E, M, in], W [E, out, in], counts [E] int64, bias [E, out]) -> y [E, M, out]
//       y[e, m] = W[e] x[e, m] + bias[e] for m < counts[e]; 0 for the padding rows m >= counts[e]
//   small_matmul(x [M, in], W [out, in], None, bias [out]) -> y [M, out]: one matrix, the few-row linear layers
//
// Each output sums its `in` products in order k = 0, 1, ... (one multiply-add per k, then the bias), whatever the other
// rows or outputs are: a token's output never depends on its batch, and equals panel_matmul's on the packed weights
// bit for bit (the same operations in the same order; tests/test_moe.py), so a prefill and the decode steps after it
// compute their matmuls alike. The order differs from BLAS's in the last bits (tests: within 1e-5 of torch.bmm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernel_helpers.h"

// Named, not anonymous: a one-unit build of the library (cext.py, one job) puts every source in one translation unit,
// where panel_matmul.cpp's and short_conv.cpp's helpers of the same names (kTileAcc, tile, exp_lanes) live.
namespace small_matmul_kernel {

using Ln = glm_lightning_ops::Lanes<float>;
using Vec = Ln::Vec;
constexpr int64_t kL = glm_lightning_ops::kLanes;  // outputs per panel: one vector
constexpr int64_t kChunkPanels = 4;                // panels per task: 64 weight rows at 16 lanes, 32 at 8

// Accumulators per register tile: 24 where the target has 32 vector registers (AVX-512, aarch64; with the 4 weight
// vectors and the broadcast, 29), 12 where it has 16 (AVX2, SSE: the tile's accumulators, its weight vectors and the
// broadcast must fit without spilling). 24 against 16 (6 rows of 4 panels per tile instead of 4): flash-25m's experts
// with the SwiGLU form, 12 layers, 1 thread, Intel Xeon AVX-512, medians of 11 in turns: 44 tokens 1.04-1.06x cold,
// 1.08x in cache; 16 and 64 tokens within 1.01-1.03x.
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kTileAcc = 24;
#else
constexpr int kTileAcc = 12;
#endif

// Weight rows [n0, n0 + cols) of W [out, in] (cols <= kChunkPanels * kL) as panels [ceil(cols / L), in, L] in P,
// a ragged last panel's missing outputs zero. L full rows are read as L vectors at a time (each row contiguously),
// transposed in registers and stored as L panel rows; while one panel's rows are read, the next L weight rows (the
// next panel's, or the next chunk's: W is contiguous) are prefetched at the same k, one panel's bytes ahead.
inline void pack_chunk(const float* __restrict W, int64_t in, int64_t n0, int64_t cols, float* __restrict P) {
  const int64_t kv = in - in % kL;
  for (int64_t p = 0; p * kL < cols; ++p) {
    const int64_t n = std::min(kL, cols - p * kL);
    const float* src = W + (n0 + p * kL) * in;
    float* dst = P + p * in * kL;
    if (n == kL) {
      for (int64_t k = 0; k < kv; k += kL) {
        Vec r[kL];
        for (int64_t c = 0; c < kL; ++c) {
          r[c] = Ln::load(src + c * in + k);
          __builtin_prefetch(src + (kL + c) * in + k, 0, 2);
        }
        Ln::transpose(r);
        for (int64_t j = 0; j < kL; ++j) Ln::store(dst + (k + j) * kL, r[j]);
      }
      for (int64_t k = kv; k < in; ++k)
        for (int64_t c = 0; c < kL; ++c) dst[k * kL + c] = src[c * in + k];
    } else {
      for (int64_t k = 0; k < in; ++k)
        for (int64_t c = 0; c < kL; ++c) dst[k * kL + c] = c < n ? src[c * in + k] : 0.f;
    }
  }
}

// exp_ (kernel_helpers.h) on kL lanes: each lane as exp_ gives it (the same operations in the same order).
inline Vec exp_lanes(Vec x) {
  typedef int32_t IVec __attribute__((vector_size(kL * sizeof(int32_t))));
  return glm_lightning_ops::exp_poly<Vec, IVec>(x);
}

// a = SiLU(g) u for H gate panels acc[i][0 .. H) and their up panels acc[i][H .. 2H): the operations of
// csrc/swiglu.cpp on the sums small_matmul would store (each plus a zero bias, as stored), g / (1 + exp_(-g)) * u.
template <int MB, int H>
inline void swiglu_out(const Vec (&acc)[MB][2 * H], float* __restrict y, int64_t out, int64_t last_cols) {
  for (int v = 0; v < H; ++v) {
    const int64_t cols = v == H - 1 ? last_cols : kL;
    for (int i = 0; i < MB; ++i) {
      const Vec g = acc[i][v] + Vec{}, u = acc[i][H + v] + Vec{};
      const Vec r = g / (1.f + exp_lanes(-g)) * u;
      float* yr = y + i * out + v * kL;
      if (cols == kL) {
        Ln::store(yr, r);
      } else {
        for (int64_t c = 0; c < cols; ++c) yr[c] = r[c];
      }
    }
  }
}

// y[m0 .. m0+MB, panels 0 .. V) for MB rows of x (row stride `in`) and V panels starting at P (panel stride in * L);
// the MB x V accumulators stay in registers across k. Writes the first `last_cols` outputs of the last panel, adding
// bias (nullable) at the panels' outputs. (No prefetch here: the next chunk's weights prefetched while the tiles ran,
// all at once or spread over them, did not pay: flash-25m's experts at 16-64 tokens, 12 layers cold, 1 thread.)
// SWIGLU: the first V / 2 panels are gate outputs and the last V / 2 the matching up outputs; writes
// a = SiLU(gate) up (V / 2 panels, `last_cols` in the last) as csrc/swiglu.cpp computes it from the stored sums.
template <int MB, int V, bool SWIGLU>
inline void tile(const float* __restrict x, const float* __restrict P, float* __restrict y, int64_t in, int64_t out,
                 int64_t last_cols, const float* bias) {
  Vec acc[MB][V];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = Vec{};
  const int64_t stride = in * kL;
  for (int64_t k = 0; k < in; ++k) {
    Vec w[V];
    for (int v = 0; v < V; ++v) w[v] = Ln::load(P + v * stride + k * kL);
    for (int i = 0; i < MB; ++i) {
      const float xi = x[i * in + k];
      for (int v = 0; v < V; ++v) acc[i][v] += xi * w[v];
    }
  }
  if constexpr (SWIGLU) return swiglu_out<MB, V / 2>(acc, y, out, last_cols);
  for (int v = 0; v < V; ++v) {
    const int64_t cols = v == V - 1 ? last_cols : kL;
    Vec b{};
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) b[c] = bias[v * kL + c];
    for (int i = 0; i < MB; ++i) {
      const Vec r = acc[i][v] + b;
      float* yr = y + i * out + v * kL;
      if (cols == kL) {
        Ln::store(yr, r);
      } else {
        for (int64_t c = 0; c < cols; ++c) yr[c] = r[c];
      }
    }
  }
}

// tile<mb, V> for a run-time mb in [1, kTileAcc / V]: every row count its own register tile.
template <int V, bool SWIGLU, int MB = 1>
inline void tile_rows(int64_t mb, const float* x, const float* P, float* y, int64_t in, int64_t out, int64_t last_cols,
                      const float* bias) {
  if constexpr ((MB + 1) * V <= kTileAcc) {
    if (mb > MB) return tile_rows<V, SWIGLU, MB + 1>(mb, x, P, y, in, out, last_cols, bias);
  }
  tile<MB, V, SWIGLU>(x, P, y, in, out, last_cols, bias);
}

// All `rows` rows against the `V` packed panels of one chunk, up to kTileAcc / V rows per register tile.
template <int V, bool SWIGLU = false>
inline void chunk_rows(const float* x, const float* P, float* y, int64_t rows, int64_t in, int64_t out,
                       int64_t last_cols, const float* bias) {
  for (int64_t m = 0; m < rows; m += kTileAcc / V)
    tile_rows<V, SWIGLU>(std::min<int64_t>(kTileAcc / V, rows - m), x + m * in, P, y + m * out, in, out, last_cols,
                         bias);
}

// One SwiGLU task: hidden units [n0, n0 + cols) of W = [W_gate; W_up] (2h rows), their gate and up rows packed
// side by side into P (gate panels first), against `rows` rows of x; writes a [rows, h] at columns n0...
inline void swiglu_chunk(const float* x, const float* W, float* a, int64_t rows, int64_t n0, int64_t cols, int64_t in,
                         int64_t h, float* P) {
  const int64_t panels = (cols + kL - 1) / kL, last_cols = cols - (panels - 1) * kL;
  pack_chunk(W, in, n0, cols, P);
  pack_chunk(W, in, h + n0, cols, P + panels * in * kL);
  if (panels == 1) return chunk_rows<2, true>(x, P, a + n0, rows, in, h, last_cols, nullptr);
  return chunk_rows<4, true>(x, P, a + n0, rows, in, h, last_cols, nullptr);
}

// One task: weight rows [n0, n0 + cols) of one matrix, packed into P, against its `rows` rows of x.
inline void chunk(const float* x, const float* W, float* y, const float* bias, int64_t rows, int64_t n0, int64_t cols,
                  int64_t in, int64_t out, float* P) {
  pack_chunk(W, in, n0, cols, P);
  const int64_t panels = (cols + kL - 1) / kL, last_cols = cols - (panels - 1) * kL;
  const float* b = bias == nullptr ? nullptr : bias + n0;
  float* yc = y + n0;
  switch (panels) {
    case 1: return chunk_rows<1>(x, P, yc, rows, in, out, last_cols, b);
    case 2: return chunk_rows<2>(x, P, yc, rows, in, out, last_cols, b);
    case 3: return chunk_rows<3>(x, P, yc, rows, in, out, last_cols, b);
    default: return chunk_rows<4>(x, P, yc, rows, in, out, last_cols, b);
  }
}

// x [E, M, in] and W [E, out, in] (or x [M, in] and W [out, in]: one matrix, y [M, out]); counts [E] (None: all M
// rows); bias [E, out] or [out] (None: none), added to the real rows. swiglu: W = [W_gate; W_up] (out = 2h rows, no
// bias) -> a [E, M, h] = SiLU(x W_gate^T) * (x W_up^T), as swiglu(small_matmul(x, W)) computes it, bit for bit, in one
// pass (no [E, M, 2h] intermediate, no SwiGLU over the padding rows, one dispatched op less).
at::Tensor small_matmul(const at::Tensor& x_in, const at::Tensor& W_in, const std::optional<at::Tensor>& counts_in,
                        const std::optional<at::Tensor>& bias_in, bool swiglu) {
  const bool one = x_in.dim() == 2 && W_in.dim() == 2;
  TORCH_CHECK((one || (x_in.dim() == 3 && W_in.dim() == 3 && x_in.size(0) == W_in.size(0))) &&
                  x_in.size(-1) == W_in.size(-1),
              "expected x [E, M, in] and W [E, out, in], or x [M, in] and W [out, in]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && W_in.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x_in.device().is_cpu() && W_in.device().is_cpu(), "CPU only");
  const at::Tensor x = x_in.contiguous(), W = W_in.contiguous();
  const int64_t E = one ? 1 : x.size(0), M = x.size(-2), in = x.size(-1), out = W.size(-2);
  TORCH_CHECK(!swiglu || (out % 2 == 0 && !bias_in.has_value()), "swiglu needs W = [W_gate; W_up] (2h rows), no bias");
  const int64_t width = swiglu ? out / 2 : out;  // y's columns
  at::Tensor counts;
  if (counts_in.has_value()) {
    counts = counts_in->to(at::kLong).contiguous();
    TORCH_CHECK(counts.numel() == E, "counts must hold one row count per matrix");
  }
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == E * out, "bias must be fp32 [E, out] or [out]");
  }
  at::Tensor y = at::empty(one ? at::IntArrayRef{M, width} : at::IntArrayRef{E, M, width}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t* cp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  glm_lightning_ops::zero_padding_rows(yp, cp, E, M, width);
  if (M == 0 || in == 0) {
    if (in == 0) y.zero_();  // no products: y = 0 (+ bias on the real rows, below; SiLU(0) 0 = 0)
    if (bp != nullptr && in == 0)
      for (int64_t e = 0; e < E; ++e)
        for (int64_t m = 0; m < (cp == nullptr ? M : cp[e]); ++m)
          std::copy(bp + e * out, bp + (e + 1) * out, yp + (e * M + m) * out);
    return y;
  }
  // outputs per task: 64 weight rows at 16 lanes (a [192, in] linear: 3 tasks), or 32 hidden units' gate and up rows
  const int64_t unit = swiglu ? kChunkPanels / 2 * kL : kChunkPanels * kL, per_e = (width + unit - 1) / unit;
  at::parallel_for(0, E * per_e, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(kChunkPanels * kL * in + 16));
    float* P = scratch.data() + (16 - reinterpret_cast<uintptr_t>(scratch.data()) / sizeof(float) % 16) % 16;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / per_e, n0 = (task % per_e) * unit, cols = std::min(width, n0 + unit) - n0;
      const int64_t rows = cp == nullptr ? M : cp[e];
      if (rows == 0) continue;
      const float *xe = xp + e * M * in, *We = wp + e * out * in;
      float* ye = yp + e * M * width;
      if (swiglu) {
        swiglu_chunk(xe, We, ye, rows, n0, cols, in, width, P);
      } else {
        chunk(xe, We, ye, bp == nullptr ? nullptr : bp + e * out, rows, n0, cols, in, out, P);
      }
    }
  });
  return y;
}

}  // namespace small_matmul_kernel

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("small_matmul(Tensor x, Tensor W, Tensor? counts=None, Tensor? bias=None, bool swiglu=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("small_matmul", &small_matmul_kernel::small_matmul);
}
