// The SwiGLU activation of the MoE experts (glm_lightning/model/moe.py) as two CPU ops, one pass each way over the
// fused [gate | up] projections.
//
// Why: eager, a = SiLU(gate) * up is two passes forward, and its backward (da * up, silu_backward, da * SiLU(gate),
// cat into [dgate | dup]) four more, each over [tokens * top-k, 2h] (13-26 MB per routed layer of flash-25m).
//
//   swiglu(hgu [..., 2h]) -> a [..., h],                       a = SiLU(g) u,  [g | u] = hgu
//   swiglu_backward(da [..., h], hgu [..., 2h]) -> [dg | du],  dg = da u s (1 + g (1 - s)),  du = da SiLU(g),
//                                                               s = sigmoid(g)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::exp_;

void check_swiglu(const at::Tensor& hgu) {
  TORCH_CHECK(hgu.dim() >= 1 && hgu.size(-1) % 2 == 0 && hgu.is_contiguous(),
              "hgu must be a contiguous [..., 2h]");
  TORCH_CHECK(hgu.scalar_type() == at::kFloat || hgu.scalar_type() == at::kDouble, "fp32 or fp64 only");
}

at::Tensor swiglu(const at::Tensor& hgu) {
  check_swiglu(hgu);
  const int64_t h = hgu.size(-1) / 2, rows = hgu.numel() / (2 * h);
  std::vector<int64_t> shape(hgu.sizes().begin(), hgu.sizes().end());
  shape.back() = h;
  at::Tensor a = at::empty(shape, hgu.options());
  AT_DISPATCH_FLOATING_TYPES(hgu.scalar_type(), "swiglu", [&] {
    using T = scalar_t;
    const T* hp = hgu.data_ptr<T>();
    T* ap = a.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *g = hp + r * 2 * h, *u = g + h;
        T* ar = ap + r * h;
        for (int64_t c = 0; c < h; ++c) ar[c] = g[c] / (T(1) + exp_(-g[c])) * u[c];
      }
    });
  });
  return a;
}

at::Tensor swiglu_backward(const at::Tensor& da_in, const at::Tensor& hgu) {
  check_swiglu(hgu);
  const at::Tensor da = da_in.contiguous();
  const int64_t h = hgu.size(-1) / 2, rows = hgu.numel() / (2 * h);
  TORCH_CHECK(da.numel() == rows * h && da.scalar_type() == hgu.scalar_type(), "da must be [..., h] like hgu");
  at::Tensor dhgu = at::empty(hgu.sizes(), hgu.options());
  AT_DISPATCH_FLOATING_TYPES(hgu.scalar_type(), "swiglu_backward", [&] {
    using T = scalar_t;
    const T *hp = hgu.data_ptr<T>(), *dap = da.data_ptr<T>();
    T* dp = dhgu.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *g = hp + r * 2 * h, *u = g + h, *d = dap + r * h;
        T *dg = dp + r * 2 * h, *du = dg + h;
        for (int64_t c = 0; c < h; ++c) {
          const T s = T(1) / (T(1) + exp_(-g[c]));
          du[c] = d[c] * g[c] * s;
          dg[c] = d[c] * u[c] * s * (T(1) + g[c] * (T(1) - s));
        }
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
