// x @ W^T for a few rows per weight matrix, streaming each weight row once (decoding without autograd).
//
// Why: decoding 16 rows sends each MoE expert 2-8 tokens. BLAS packs the whole weight matrix into its panel layout
// on every call, so a GEMM with 4 rows costs nearly what one with 100 rows does: the experts' two bmm were 1.2 ms
// per layer (1 thread) for 7 MB of weights, ~6 GB/s on a machine that streams ~30 GB/s, and most of the MoE's half
// of a 16-row decode step. Here every weight row is read once, straight from the [out, in] layout the model stores,
// and multiplied into all the rows that use it while they sit in L1; rows beyond an expert's count (padding) are not
// computed at all. A decode step's dense linear layers have the same shape problem (a few rows against a weight
// matrix that is cold: the step streams the whole model), so they use it too (glm_lightning/model/linear.py).
//
//   small_matmul(x [E, M, in], W [E, out, in], counts [E] int64, bias [E, out]) -> y [E, M, out]
//       y[e, m] = W[e] x[e, m] + bias[e] for m < counts[e]; 0 for the padding rows m >= counts[e]
//   small_matmul(x [M, in], W [out, in], None, bias [out]) -> y [M, out]: one matrix, decoding's linear layers
//
// A row's sums run in the same order whatever the other rows are, so a token's output never depends on its batch.
//
// Accumulation runs over 16-float vector lanes (glm_lightning_ops::Lanes, kernel_helpers.h), so the sum order differs
// from BLAS in the last bits (tests: within 1e-5 of torch.bmm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::kLanes;
using v16 = glm_lightning_ops::Lanes<float>::Vec;  // kLanes floats (the name is from the 16-lane AVX-512 form)
constexpr auto load16 = glm_lightning_ops::Lanes<float>::load;
constexpr auto hsum = glm_lightning_ops::Lanes<float>::sum;
constexpr auto sums16 = glm_lightning_ops::Lanes<float>::sums16;

// y[m, n] = <x[m], W[n]> for MB rows of x (from m0) and NB weight rows (from n0); rows `in` floats long. The NB
// weight vectors are loaded once per 16 columns and multiplied into all MB rows (from L1). A 4-column block's up to
// 16 lane sums are reduced together (Lanes::sums16; the same sums as 16 Lanes::sum, ~10% off a 16-row decode step's
// matmuls).
template <int MB, int NB>
inline void block(const float* __restrict x, const float* __restrict W, float* __restrict y, int64_t m0, int64_t n0,
                  int64_t in, int64_t out, const float* prefetch = nullptr) {
  static_assert(MB * NB <= 16, "one register tile");
  v16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = v16{};
  const int64_t kv = in - in % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(W + (n0 + j) * in + k);
    if (prefetch != nullptr)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(prefetch + j * in + k, 0, 0);
    for (int i = 0; i < MB; ++i) {
      const v16 xv = load16(x + (m0 + i) * in + k);
      for (int j = 0; j < NB; ++j) acc[i * NB + j] += xv * w[j];
    }
  }
  float sums[16];
  if constexpr (NB == 4) {
    for (int i = 0; i < 16; i += kLanes) glm_lightning_ops::Lanes<float>::store(sums + i, sums16(acc + i));
  } else {
    for (int i = 0; i < MB * NB; ++i) sums[i] = hsum(acc[i]);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = sums[i * NB + j];
      for (int64_t k = kv; k < in; ++k) s += x[(m0 + i) * in + k] * W[(n0 + j) * in + k];
      y[(m0 + i) * out + n0 + j] = s;
    }
}

// Weight rows [n_begin, n_end) of one matrix against its `rows` rows: each weight row is read once from memory.
// The first pass over 4 weight rows takes the rows % 4 (else 4) leading rows in one block, so that it is the only
// pass that waits on memory (the rest find the 4 weight rows in L1), and it prefetches the weight rows kPrefetchRows
// ahead: the hardware prefetcher alone left the loads waiting (flash-25m's 12 layers of experts at 16 decode rows,
// 1 thread: 6.7 -> 3.9 ms; one pass 6.7 -> 6.0 of that). A row's sums run in the same order whatever the block.
constexpr int64_t kPrefetchRows = 8;

inline void matrix(const float* x, const float* W, float* y, int64_t rows, int64_t n_begin, int64_t n_end, int64_t in,
                   int64_t out) {
  const int64_t lead = rows % 4 == 0 ? 4 : rows % 4;
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    // within the matrix: the last 4 rows prefetch themselves
    const float* ahead = W + std::min(n + kPrefetchRows, out - 4) * in;
    switch (lead) {
      case 1: block<1, 4>(x, W, y, 0, n, in, out, ahead); break;
      case 2: block<2, 4>(x, W, y, 0, n, in, out, ahead); break;
      case 3: block<3, 4>(x, W, y, 0, n, in, out, ahead); break;
      default: block<4, 4>(x, W, y, 0, n, in, out, ahead);
    }
    for (int64_t m = lead; m + 4 <= rows; m += 4) block<4, 4>(x, W, y, m, n, in, out);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < rows; ++m) block<1, 1>(x, W, y, m, n, in, out);
}

// x [E, M, in] and W [E, out, in] (or x [M, in] and W [out, in]: one matrix, y [M, out]); counts [E] (None: all M
// rows); bias [E, out] or [out] (None: none), added to the real rows.
at::Tensor small_matmul(const at::Tensor& x_in, const at::Tensor& W_in, const std::optional<at::Tensor>& counts_in,
                        const std::optional<at::Tensor>& bias_in) {
  const bool one = x_in.dim() == 2 && W_in.dim() == 2;
  TORCH_CHECK((one || (x_in.dim() == 3 && W_in.dim() == 3 && x_in.size(0) == W_in.size(0))) &&
                  x_in.size(-1) == W_in.size(-1),
              "expected x [E, M, in] and W [E, out, in], or x [M, in] and W [out, in]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && W_in.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x_in.device().is_cpu() && W_in.device().is_cpu(), "CPU only");
  const at::Tensor x = one ? x_in.contiguous().unsqueeze(0) : x_in.contiguous();
  const at::Tensor W = one ? W_in.contiguous().unsqueeze(0) : W_in.contiguous();
  const int64_t E = x.size(0), M = x.size(1), in = x.size(2), out = W.size(1);
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
  at::Tensor y = at::empty(one ? at::IntArrayRef{M, out} : at::IntArrayRef{E, M, out}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t* cp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  glm_lightning_ops::zero_padding_rows(yp, cp, E, M, out);
  constexpr int64_t CHUNK = 32;  // weight rows per task (a multiple of 4; a [192, in] linear: 6 tasks for 2 threads)
  const int64_t per_e = (out + CHUNK - 1) / CHUNK;
  at::parallel_for(0, E * per_e, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / per_e, n_begin = (task % per_e) * CHUNK, n_end = std::min(out, n_begin + CHUNK);
      const int64_t rows = cp == nullptr ? M : cp[e];
      if (rows == 0) continue;
      float* ye = yp + e * M * out;
      matrix(xp + e * M * in, wp + e * out * in, ye, rows, n_begin, n_end, in, out);
      if (bp != nullptr)
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t n = n_begin; n < n_end; ++n) ye[m * out + n] += bp[e * out + n];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("small_matmul(Tensor x, Tensor W, Tensor? counts=None, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("small_matmul", &small_matmul);
}
