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
#include <cstring>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::exp_;
using glm_lightning_ops::kLanes;
using FL = glm_lightning_ops::Lanes<float>;
using FVec = FL::Vec;

// exp_ (kernel_helpers.h) on kLanes lanes: the same operations in the same order (each lane as exp_ would give it).
inline FVec exp_lanes(FVec x) {
  typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
  return glm_lightning_ops::exp_poly<FVec, IVec>(x);
}

// The model's case (fp32, 4 taps, C a multiple of kLanes) as one walk over the tokens per row and kLanes channels, the
// taps' inputs and the dz of the last tokens in registers: the general loops below pass over a row's channels once per
// tap (zero-fill, four accumulations, SiLU; the backward ~15 stores per value), this one reads x (and dy) once and
// writes y (dx) once. The sums run in the general loops' order (a tap before t = 0 adds an exact +0), so values are
// theirs bit for bit.
constexpr int64_t kTaps = 4;
// Tokens ahead that a walk prefetches its next inputs: a walk reads one cache line per token, C * 4 bytes apart (2,304
// at flash-25m's C = 576), a stride the hardware prefetchers do not follow; without it the walks ran 0.6x the
// general loops.
constexpr int64_t kAhead = 16;

inline bool conv4_takes(const at::Tensor& x, int64_t C, int64_t ks) {
  return x.scalar_type() == at::kFloat && ks == kTaps && C % kLanes == 0;
}

// The conv's pre-activation at one token: the taps in order j = 0..3 from +0 (the general loops' order).
inline FVec conv4_z(FVec w0, FVec w1, FVec w2, FVec w3, FVec x0, FVec x1, FVec x2, FVec x3) {
  FVec z{};
  z += w0 * x0;
  z += w1 * x1;
  z += w2 * x2;
  z += w3 * x3;
  return z;
}

// y[b, :, c0 .. c0 + kLanes) of row xb (y_pre = the taps in order j = 0..3 from +0, then SiLU).
inline void conv4_forward_block(const float* __restrict xb, const float* __restrict wt, float* __restrict yb,
                                int64_t T_, int64_t C, int64_t c0) {
  const FVec w0 = FL::load(wt + c0), w1 = FL::load(wt + C + c0), w2 = FL::load(wt + 2 * C + c0),
             w3 = FL::load(wt + 3 * C + c0);
  FVec x0{}, x1{}, x2{};  // x at t - 3, t - 2, t - 1 (0 before the row's start)
  for (int64_t t = 0; t < T_; ++t) {
    __builtin_prefetch(xb + (t + kAhead) * C + c0);
    const FVec x3 = FL::load(xb + t * C + c0);
    const FVec z = conv4_z(w0, w1, w2, w3, x0, x1, x2, x3);
    FL::store(yb + t * C + c0, z / (1.f + exp_lanes(-z)));
    x0 = x1;
    x1 = x2;
    x2 = x3;
  }
}

// dx[b, :, block] and dw[:, block] += this row's terms, for one block of kLanes channels (dwb: the thread's [4, C]).
inline void conv4_backward_block(const float* __restrict xb, const float* __restrict dyb, const float* __restrict wt,
                                 float* __restrict dxb, float* __restrict dwb, int64_t T_, int64_t C, int64_t c0) {
  const FVec w0 = FL::load(wt + c0), w1 = FL::load(wt + C + c0), w2 = FL::load(wt + 2 * C + c0),
             w3 = FL::load(wt + 3 * C + c0);
  FVec dw0 = FL::load(dwb + c0), dw1 = FL::load(dwb + C + c0), dw2 = FL::load(dwb + 2 * C + c0),
       dw3 = FL::load(dwb + 3 * C + c0);
  FVec x0{}, x1{}, x2{};     // x at t - 3, t - 2, t - 1
  FVec d0{}, d1{}, d2{};     // dz at t - 3, t - 2, t - 1
  for (int64_t t = 0; t < T_ + kTaps - 1; ++t) {
    FVec d3{};
    if (t < T_) {
      __builtin_prefetch(xb + (t + kAhead) * C + c0);
      __builtin_prefetch(dyb + (t + kAhead) * C + c0);
      const FVec x3 = FL::load(xb + t * C + c0);
      const FVec z = conv4_z(w0, w1, w2, w3, x0, x1, x2, x3);
      const FVec sg = 1.f / (1.f + exp_lanes(-z));
      d3 = FL::load(dyb + t * C + c0) * sg * (1.f + z * (1.f - sg));
      dw0 += d3 * x0;
      dw1 += d3 * x1;
      dw2 += d3 * x2;
      dw3 += d3 * x3;
      x0 = x1;
      x1 = x2;
      x2 = x3;
    }
    if (t >= kTaps - 1) {  // dx[t - 3] = sum_j w[j] dz[t - j], j = 0..3
      FVec dx{};
      dx += w0 * d3;
      dx += w1 * d2;
      dx += w2 * d1;
      dx += w3 * d0;
      FL::store(dxb + (t - (kTaps - 1)) * C + c0, dx);
    }
    d0 = d1;
    d1 = d2;
    d2 = d3;
  }
  FL::store(dwb + c0, dw0);
  FL::store(dwb + C + c0, dw1);
  FL::store(dwb + 2 * C + c0, dw2);
  FL::store(dwb + 3 * C + c0, dw3);
}

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
  if (conv4_takes(x, C, ks)) {
    const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t blocks = C / kLanes;
    at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks;
        conv4_forward_block(xp + b * T_ * C, wp, yp + b * T_ * C, T_, C, (i % blocks) * kLanes);
      }
    });
    return y;
  }
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
  if (conv4_takes(x, C, ks)) {
    const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>(), *dyp = dy.data_ptr<float>();
    float *dxp = dx.data_ptr<float>(), *dwp = dwt.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {  // rows per thread, in order: as the general loops
      float* dw = dwp + at::get_thread_num() * ks * C;
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t c0 = 0; c0 < C; c0 += kLanes)
          conv4_backward_block(xp + b * T_ * C, dyp + b * T_ * C, wp, dxp + b * T_ * C, dw, T_, C, c0);
    });
    return {dx, dwt.sum(0).t().contiguous()};
  }
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
