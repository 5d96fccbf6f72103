// RMSNorm over the rows of a tensor as two CPU ops, one pass each way, optionally gated by a sigmoid
// (glm_lightning/model/norm.py: RMSNorm; glm_lightning/model/kda_fused.py: KDA's gated output norm per head).
// Each row of K values (a token's model width, or one KDA head):
//
//   xh = x rstd,  rstd = 1 / sqrt(|x|^2 / K + eps),  out = xh w [sigmoid(gate)]
//   rms_norm(x [R, K], w [K], eps) -> out;  gated_head_norm(o [.., H, K], gate [.., HK], w [K], eps) -> out
//   backward, with sg = sigmoid(gate) (1 without a gate) and dn = dout sg w:
//     dgate = dout xh w sg (1 - sg),  dw = sum_rows dout sg xh,  dx = rstd (dn - xh <dn, xh> / K)
//
// Why: as ATen ops a norm is ~5 dispatched ops forward and ~8 backward (the gated one ~8 and ~10), over tensors the
// dispatch-bound study model reads in microseconds. Each row is one function over __restrict pointers (written inline
// in the ops' lambdas, whose captured pointers may alias the outputs, such loops ran ~3x slower); dw sums fixed blocks
// of rows and then the blocks in order, so it does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::as_rows;
using glm_lightning_ops::dot_;
using glm_lightning_ops::kRowBlock;
using glm_lightning_ops::sigmoid_;
using glm_lightning_ops::sum_squares;

template <typename T, bool GATED>
void norm_row(const T* __restrict x, const T* __restrict gate, const T* __restrict w, T eps, int64_t width,
              int64_t K, T* __restrict out) {
  for (int64_t j0 = 0; j0 < width; j0 += K) {
    const T rstd = T(1) / std::sqrt(sum_squares(x + j0, K) / K + eps);
    for (int64_t k = 0; k < K; ++k) {
      const T y = x[j0 + k] * rstd * w[k];
      out[j0 + k] = GATED ? y * sigmoid_(gate[j0 + k]) : y;
    }
  }
}

// One row's dx (and dgate); adds its dout sg xh into dw [K]. xh, dn: [K] scratch.
template <typename T, bool GATED>
void norm_row_backward(const T* __restrict dout, const T* __restrict x, const T* __restrict gate,
                       const T* __restrict w, T eps, int64_t width, int64_t K, T* __restrict dx, T* __restrict dgate,
                       T* __restrict dw, T* __restrict xh, T* __restrict dn) {
  for (int64_t j0 = 0; j0 < width; j0 += K) {
    const T rstd = T(1) / std::sqrt(sum_squares(x + j0, K) / K + eps);
    for (int64_t k = 0; k < K; ++k) {
      const T v = x[j0 + k] * rstd;
      T d = dout[j0 + k];
      if constexpr (GATED) {
        const T sg = sigmoid_(gate[j0 + k]);
        dgate[j0 + k] = d * v * w[k] * sg * (T(1) - sg);
        d *= sg;
      }
      xh[k] = v;
      dw[k] += d * v;
      dn[k] = d * w[k];
    }
    const T c = dot_(dn, xh, K) / K;
    for (int64_t k = 0; k < K; ++k) dx[j0 + k] = (dn[k] - xh[k] * c) * rstd;
  }
}

// x [R, width] normalised in rows of K (width a multiple of K), gated when `gate` is given.
at::Tensor norm_forward(const at::Tensor& x_in, const std::optional<at::Tensor>& gate_in, const at::Tensor& w_in,
                        double eps, int64_t width) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kDouble, "fp32 or fp64 only");
  const int64_t K = w_in.numel();
  TORCH_CHECK(K >= 1 && width % K == 0 && x_in.numel() % width == 0, "rows of a multiple of w's ", K, " values");
  const int64_t R = x_in.numel() / width;
  const at::Tensor x = as_rows(x_in, R, width, "x"), w = w_in.contiguous();
  const at::Tensor gate = gate_in ? as_rows(*gate_in, R, width, "gate") : at::Tensor();
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && (!gate_in || gate.scalar_type() == x.scalar_type()),
              "dtypes differ");
  at::Tensor out = at::empty({R, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *gp = gate_in ? gate.data_ptr<T>() : nullptr, *wp = w.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    const T e = static_cast<T>(eps);
    at::parallel_for(0, R, kRowBlock, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (gp) norm_row<T, true>(xp + r * width, gp + r * width, wp, e, width, K, yp + r * width);
        else norm_row<T, false>(xp + r * width, nullptr, wp, e, width, K, yp + r * width);
      }
    });
  });
  return out;
}

// (dx, dgate (undefined without a gate), dw)
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                             const std::optional<at::Tensor>& gate_in,
                                                             const at::Tensor& w_in, double eps, int64_t width) {
  const int64_t K = w_in.numel();
  TORCH_CHECK(K >= 1 && width % K == 0 && x_in.numel() % width == 0, "rows of a multiple of w's ", K, " values");
  const int64_t R = x_in.numel() / width;
  const at::Tensor x = as_rows(x_in, R, width, "x"), dy = as_rows(dy_in, R, width, "dy"), w = w_in.contiguous();
  const at::Tensor gate = gate_in ? as_rows(*gate_in, R, width, "gate") : at::Tensor();
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && dy.scalar_type() == x.scalar_type() &&
              (!gate_in || gate.scalar_type() == x.scalar_type()), "dtypes differ");
  at::Tensor dx = at::empty({R, width}, x.options());
  at::Tensor dgate = gate_in ? at::empty({R, width}, x.options()) : at::Tensor();
  const int64_t blocks = (R + kRowBlock - 1) / kRowBlock;
  at::Tensor partial = at::zeros({blocks, K}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *gp = gate_in ? gate.data_ptr<T>() : nullptr, *wp = w.data_ptr<T>(),
            *dyp = dy.data_ptr<T>();
    T *dxp = dx.data_ptr<T>(), *dgp = gate_in ? dgate.data_ptr<T>() : nullptr, *pp = partial.data_ptr<T>();
    const T e = static_cast<T>(eps);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<T> scratch(2 * K);
      for (int64_t blk = b0; blk < b1; ++blk)
        for (int64_t r = blk * kRowBlock; r < std::min(R, (blk + 1) * kRowBlock); ++r) {
          const int64_t o = r * width;
          if (gp)
            norm_row_backward<T, true>(dyp + o, xp + o, gp + o, wp, e, width, K, dxp + o, dgp + o, pp + blk * K,
                                       scratch.data(), scratch.data() + K);
          else
            norm_row_backward<T, false>(dyp + o, xp + o, nullptr, wp, e, width, K, dxp + o, nullptr, pp + blk * K,
                                        scratch.data(), scratch.data() + K);
        }
    });
  });
  return {dx, dgate, partial.sum(0)};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return norm_forward(x, std::nullopt, w, eps, w.numel());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     double eps) {
  auto [dx, dgate, dw] = norm_backward(dy, x, std::nullopt, w, eps, w.numel());
  return {dx, dw};
}

at::Tensor gated_head_norm(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& w, double eps) {
  TORCH_CHECK(o.dim() >= 2 && o.size(-1) == w.numel() && o.numel() == gate.numel(),
              "o [.., H, K], gate [.., HK], w [K]");
  return norm_forward(o, gate, w, eps, o.size(-1) * o.size(-2));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_head_norm_backward(const at::Tensor& dy, const at::Tensor& o,
                                                                        const at::Tensor& gate, const at::Tensor& w,
                                                                        double eps) {
  TORCH_CHECK(o.dim() >= 2 && o.size(-1) == w.numel() && o.numel() == gate.numel(),
              "o [.., H, K], gate [.., HK], w [K]");
  return norm_backward(dy, o, gate, w, eps, o.size(-1) * o.size(-2));
}

}  // namespace

namespace norm_ops {  // block_decode.cpp calls it as a C++ function (no dispatch per call)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return ::rms_norm(x, w, eps); }
}  // namespace norm_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("gated_head_norm(Tensor o, Tensor gate, Tensor w, float eps) -> Tensor");
  m.def("gated_head_norm_backward(Tensor dy, Tensor o, Tensor gate, Tensor w, float eps) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("gated_head_norm", &gated_head_norm);
  m.impl("gated_head_norm_backward", &gated_head_norm_backward);
}
