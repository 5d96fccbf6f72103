// The SwiGLU activation of the MoE experts (glm_lightning/model/moe.py) as two CPU ops, one pass each way over the
// fused [gate | up] projections.
//
// Why: eager, a = SiLU(gate) * up is two passes forward, and its backward (da * up, silu_backward, da * SiLU(gate),
// cat into [dgate | dup]) four more, each over [tokens * top-k, 2h] (13-26 MB per routed layer of flash-25m).
//
//   swiglu(hgu [..., 2h]) -> a [..., h],                       a = SiLU(g) u,  [g | u] = hgu
//   swiglu_backward(da [..., h], hgu [..., 2h]) -> [dg | du],  dg = da u s (1 + g (1 - s)),  du = da SiLU(g),
//                                                               s = sigmoid(g)
// fp32, fp64 and bf16 (bf16-mixed training: bf16 in and out, fp32 math, each output rounded once; the eager bf16 form
// was three to six bf16 ops, each rounding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::Acc;
using glm_lightning_ops::exp_;
using glm_lightning_ops::widen;
using glm_lightning_ops::narrow;

void check_swiglu(const at::Tensor& hgu) {
  TORCH_CHECK(hgu.dim() >= 1 && hgu.size(-1) % 2 == 0 && hgu.is_contiguous(),
              "hgu must be a contiguous [..., 2h]");
  TORCH_CHECK(hgu.scalar_type() == at::kFloat || hgu.scalar_type() == at::kDouble ||
              hgu.scalar_type() == at::kBFloat16, "fp32, fp64 or bf16 only");
}

at::Tensor swiglu(const at::Tensor& hgu) {
  check_swiglu(hgu);
  const int64_t h = hgu.size(-1) / 2, rows = hgu.numel() / (2 * h);
  std::vector<int64_t> shape(hgu.sizes().begin(), hgu.sizes().end());
  shape.back() = h;
  at::Tensor a = at::empty(shape, hgu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, hgu.scalar_type(), "swiglu", [&] {
    using S = scalar_t;
    using T = Acc<S>;
    const S* hp = hgu.data_ptr<S>();
    S* ap = a.data_ptr<S>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const S *g = hp + r * 2 * h, *u = g + h;
        S* ar = ap + r * h;
        for (int64_t c = 0; c < h; ++c) {
          const T gc = widen(g[c]);
          ar[c] = narrow<S>(gc / (T(1) + exp_(-gc)) * widen(u[c]));
        }
      }
    });
  });
  return a;
}

// One row's span of the backward in T (fp32 or fp64), from and into T arrays.
template <typename T>
inline void backward_span(const T* __restrict g, const T* __restrict u, const T* __restrict d, T* __restrict dg,
                          T* __restrict du, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const T s = T(1) / (T(1) + exp_(-g[c]));
    du[c] = d[c] * g[c] * s;
    dg[c] = d[c] * u[c] * s * (T(1) + g[c] * (T(1) - s));
  }
}

// bf16 rows go through fp32 chunks: widen, the fp32 span, round (three simple loops the compiler vectorises; the one
// mixed loop did not, 3x the fp32 op's time).
constexpr int64_t kChunk = 64;

inline void backward_bf16_chunk(const at::BFloat16* g, const at::BFloat16* u, const at::BFloat16* d,
                                at::BFloat16* dg, at::BFloat16* du, int64_t n) {
  float g32[kChunk], u32[kChunk], d32[kChunk], dg32[kChunk], du32[kChunk];
  for (int64_t c = 0; c < n; ++c) {
    g32[c] = widen(g[c]);
    u32[c] = widen(u[c]);
    d32[c] = widen(d[c]);
  }
  backward_span<float>(g32, u32, d32, dg32, du32, n);
  for (int64_t c = 0; c < n; ++c) {
    dg[c] = narrow<at::BFloat16>(dg32[c]);
    du[c] = narrow<at::BFloat16>(du32[c]);
  }
}

template <typename T>
inline void backward_row(const T* g, const T* u, const T* d, T* dg, T* du, int64_t h) {
  backward_span<T>(g, u, d, dg, du, h);
}

inline void backward_row(const at::BFloat16* g, const at::BFloat16* u, const at::BFloat16* d, at::BFloat16* dg,
                         at::BFloat16* du, int64_t h) {
  for (int64_t c = 0; c < h; c += kChunk)
    backward_bf16_chunk(g + c, u + c, d + c, dg + c, du + c, std::min(kChunk, h - c));
}

at::Tensor swiglu_backward(const at::Tensor& da_in, const at::Tensor& hgu) {
  check_swiglu(hgu);
  const at::Tensor da = da_in.contiguous();
  const int64_t h = hgu.size(-1) / 2, rows = hgu.numel() / (2 * h);
  TORCH_CHECK(da.numel() == rows * h && da.scalar_type() == hgu.scalar_type(), "da must be [..., h] like hgu");
  at::Tensor dhgu = at::empty(hgu.sizes(), hgu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, hgu.scalar_type(), "swiglu_backward", [&] {
    using S = scalar_t;
    const S *hp = hgu.data_ptr<S>(), *dap = da.data_ptr<S>();
    S* dp = dhgu.data_ptr<S>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const S *g = hp + r * 2 * h, *u = g + h, *d = dap + r * h;
        S *dg = dp + r * 2 * h, *du = dg + h;
        backward_row(g, u, d, dg, du, h);
      }
    });
  });
  return dhgu;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("swiglu(Tensor hgu) -> Tensor");
  m.def("swiglu_backward(Tensor da, Tensor hgu) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}
