// KDA's causal depthwise short convolution + SiLU (glm_lightning/model/kda.py, KDAttention._short_conv, training and
// cache-free forwards) as two CPU ops, each one pass over [B, T, C].
//
// Why: as oneDNN's depthwise conv2d on the channels-last view, SiLU and their backward it is ~6 passes and a
// convolution backward that took 0.5 ms per layer for the study model's [8, 128, 144] (under torch.profiler).
//
//   y_pre[b, t, c] = sum_j w[c, j] x[b, t - (ks-1) + j, c]   (x = 0 before t = 0),   y = SiLU(y_pre)
//   short_conv_silu(x [B, T, C], w [C, ks]) -> y [B, T, C]
//   short_conv_silu_backward(dy, x, w) -> (dx [B, T, C], dw [C, ks]), with y_pre recomputed:
//       dz = dy s (1 + y_pre (1 - s)), s = sigmoid(y_pre);  dx[t] = sum_j w[j] dz[t + (ks-1) - j];
//       dw[c, j] = sum_{b, t} dz[b, t, c] x[b, t - (ks-1) + j, c]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::exp_;

void check_conv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous [B, T, C]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == x.size(2) && w.size(1) >= 1 && w.size(1) <= 16 && w.is_contiguous(),
              "w must be a contiguous [C, ks], ks <= 16");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "w must have x's dtype");
}

// y_pre of row b at time t for all channels into z [C]
template <typename T>
inline void conv_at(const T* __restrict xb, const T* __restrict wt, int64_t t, int64_t C, int64_t ks,
                    T* __restrict z) {
  for (int64_t c = 0; c < C; ++c) z[c] = T(0);
  for (int64_t j = 0; j < ks; ++j) {
    const int64_t src = t - (ks - 1) + j;
    if (src < 0) continue;
    const T* xs = xb + src * C;
    const T* wj = wt + j * C;  // the weight transposed to [ks, C]
    for (int64_t c = 0; c < C; ++c) z[c] += wj[c] * xs[c];
  }
}

at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& w) {
  check_conv(x, w);
  const int64_t B = x.size(0), T_ = x.size(1), C = x.size(2), ks = w.size(1);
  const at::Tensor wt = w.t().contiguous();
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "short_conv_silu", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *wp = wt.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, B * T_, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / T_, t = r % T_;
        T* yr = yp + r * C;
        conv_at(xp + b * T_ * C, wp, t, C, ks, yr);
        for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] / (T(1) + exp_(-yr[c]));
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> short_conv_silu_backward(const at::Tensor& dy_in, const at::Tensor& x,
                                                            const at::Tensor& w) {
  check_conv(x, w);
  const at::Tensor dy = dy_in.contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes(), "dy must be [B, T, C] like x");
  const int64_t B = x.size(0), T_ = x.size(1), C = x.size(2), ks = w.size(1);
  const at::Tensor wt = w.t().contiguous();
  at::Tensor dx = at::empty_like(x);
  const int threads = at::get_num_threads();
  at::Tensor dwt = at::zeros({threads, ks, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "short_conv_silu_backward", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *wp = wt.data_ptr<T>(), *dyp = dy.data_ptr<T>();
    T *dxp = dx.data_ptr<T>(), *dwp = dwt.data_ptr<T>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      T* dw = dwp + at::get_thread_num() * ks * C;
      std::vector<T> dz_row(T_ * C);  // one row's dz (L2-sized), not a [B, T, C] tensor
      for (int64_t b = b0; b < b1; ++b) {
        const T* xb = xp + b * T_ * C;
        T* dzb = dz_row.data();
        for (int64_t t = 0; t < T_; ++t) {  // dz = dy * SiLU'(y_pre), and dw
          T* dz = dzb + t * C;
          conv_at(xb, wp, t, C, ks, dz);
          const T* dyr = dyp + (b * T_ + t) * C;
          for (int64_t c = 0; c < C; ++c) {
            const T z = dz[c], s = T(1) / (T(1) + exp_(-z));
            dz[c] = dyr[c] * s * (T(1) + z * (T(1) - s));
          }
          for (int64_t j = 0; j < ks; ++j) {
            const int64_t src = t - (ks - 1) + j;
            if (src < 0) continue;
            const T* xs = xb + src * C;
            T* dwj = dw + j * C;
            for (int64_t c = 0; c < C; ++c) dwj[c] += dz[c] * xs[c];
          }
        }
        for (int64_t t = 0; t < T_; ++t) {  // dx[t] = sum_j w[j] dz[t + (ks-1) - j]
          T* dxr = dxp + (b * T_ + t) * C;
          for (int64_t c = 0; c < C; ++c) dxr[c] = T(0);
          for (int64_t j = 0; j < ks; ++j) {
            const int64_t dst = t + (ks - 1) - j;
            if (dst >= T_) continue;
            const T* dz = dzb + dst * C;
            const T* wj = wp + j * C;
            for (int64_t c = 0; c < C; ++c) dxr[c] += wj[c] * dz[c];
          }
        }
      }
    });
  });
  return {dx, dwt.sum(0).t().contiguous()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("short_conv_silu(Tensor x, Tensor w) -> Tensor");
  m.def("short_conv_silu_backward(Tensor dy, Tensor x, Tensor w) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("short_conv_silu", &short_conv_silu);
  m.impl("short_conv_silu_backward", &short_conv_silu_backward);
}
