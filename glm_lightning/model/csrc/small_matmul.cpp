// x @ W^T for a few rows per weight matrix, streaming each weight row once (decoding without autograd).
//
// Why: decoding 16 rows sends each MoE expert 2-8 tokens. BLAS packs the whole weight matrix into its panel layout
// on every call, so a GEMM with 4 rows costs nearly what one with 100 rows does: the experts' two bmm were 1.2 ms
// per layer (1 thread) for 7 MB of weights, ~6 GB/s on a machine that streams ~30 GB/s, and most of the MoE's half
// of a 16-row decode step. Here every
// weight row is read once, straight from the [out, in] layout the model stores, and multiplied into all the rows
// that use it while they sit in L1; rows beyond an expert's count (padding) are not computed at all.
//
//   small_matmul(x [E, M, in], W [E, out, in], counts [E] int64) -> y [E, M, out]
//       y[e, m] = W[e] x[e, m] for m < counts[e]; 0 for the padding rows m >= counts[e]
//
// Accumulation runs over 16-float vector lanes (glm_lightning_ops::Lanes, kernel_helpers.h), so the sum order differs
// from BLAS in the last bits (tests: within 1e-5 of torch.bmm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel_helpers.h"

namespace {

using v16 = glm_lightning_ops::Lanes<float>::Vec;
constexpr auto load16 = glm_lightning_ops::Lanes<float>::load;
constexpr auto hsum = glm_lightning_ops::Lanes<float>::sum;

// y[m, n] = <x[m], W[n]> for MB rows of x (from m0) and NB weight rows (from n0); rows `in` floats long. The NB
// weight vectors are loaded once per 16 columns and multiplied into all MB rows (from L1).
template <int MB, int NB>
inline void block(const float* __restrict x, const float* __restrict W, float* __restrict y, int64_t m0, int64_t n0,
                  int64_t in, int64_t out) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  const int64_t kv = in - in % 16;
  for (int64_t k = 0; k < kv; k += 16) {
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(W + (n0 + j) * in + k);
    for (int i = 0; i < MB; ++i) {
      const v16 xv = load16(x + (m0 + i) * in + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * w[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = kv; k < in; ++k) s += x[(m0 + i) * in + k] * W[(n0 + j) * in + k];
      y[(m0 + i) * out + n0 + j] = s;
    }
}

// Weight rows [n_begin, n_end) of one matrix against its `rows` rows: each weight row is read once from memory.
inline void matrix(const float* x, const float* W, float* y, int64_t rows, int64_t n_begin, int64_t n_end, int64_t in,
                   int64_t out) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) block<4, 4>(x, W, y, m, n, in, out);
    for (; m < rows; ++m) block<1, 4>(x, W, y, m, n, in, out);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < rows; ++m) block<1, 1>(x, W, y, m, n, in, out);
}

at::Tensor small_matmul(const at::Tensor& x_in, const at::Tensor& W_in, const at::Tensor& counts_in) {
  TORCH_CHECK(x_in.dim() == 3 && W_in.dim() == 3 && x_in.size(0) == W_in.size(0) && x_in.size(2) == W_in.size(2),
              "expected x [E, M, in] and W [E, out, in]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && W_in.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x_in.device().is_cpu() && W_in.device().is_cpu(), "CPU only");
  const at::Tensor x = x_in.contiguous(), W = W_in.contiguous();
  const at::Tensor counts = counts_in.to(at::kLong).contiguous();
  const int64_t E = x.size(0), M = x.size(1), in = x.size(2), out = W.size(1);
  TORCH_CHECK(counts.numel() == E, "counts must hold one row count per matrix");
  at::Tensor y = at::empty({E, M, out}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(cp[e] >= 0 && cp[e] <= M, "counts must lie in [0, M]");
    std::fill(yp + (e * M + cp[e]) * out, yp + (e + 1) * M * out, 0.f);  // padding rows
  }
  constexpr int64_t CHUNK = 64;  // weight rows per task (a multiple of 4)
  const int64_t per_e = (out + CHUNK - 1) / CHUNK;
  at::parallel_for(0, E * per_e, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / per_e, n_begin = (task % per_e) * CHUNK, n_end = std::min(out, n_begin + CHUNK);
      if (cp[e] > 0) matrix(xp + e * M * in, wp + e * out * in, yp + e * M * out, cp[e], n_begin, n_end, in, out);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("small_matmul(Tensor x, Tensor W, Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("small_matmul", &small_matmul);
}
