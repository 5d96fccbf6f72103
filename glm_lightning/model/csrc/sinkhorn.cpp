// Sinkhorn-Knopp of [N, n, n] logits as two CPU ops (forward, backward), one call for all N tokens of an mHC site.
//
// Same arithmetic, in the same order, as the eager `_Sinkhorn` of glm_lightning/model/mhc.py: row softmax, + eps,
// then 2 * iters - 1 half steps m <- m / (sum + eps), columns first, alternating. The eager path dispatches ~3 ops per
// half step forward and ~4 backward (~270 ops per site for 20 iterations); here a block of W tokens is copied into an
// entries-major [n * n][W] block and iterated there, every step a loop over the W tokens that the compiler
// vectorises. The stream count is a compile-time constant (1 .. kMaxStreams), so every loop over the entries unrolls
// and a block's n * n rows stay in vector registers through all half steps (with a runtime n they went through memory
// on each, ~5x slower).
//
// The forward returns the row softmax with the result; the backward starts from it (no scalar exp to redo),
// recomputes the half steps keeping their 2 * iters - 1 denominators, and walks them back carrying P = dL/dm * m:  P_in = P_out - sum_dim(P_out) * m_out,  m_in = m_out * d.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernel_helpers.h"
#include "sinkhorn.h"

namespace {

constexpr int64_t W = 16;  // tokens per block: one AVX-512 register of fp32, two of AVX2
using glm_lightning_ops::kMaxStreams;

// Load tokens [t0, t0 + nt) of x (token stride ts, each n x n row-major) entries-major into buf[k][w]; the unused
// lanes get `fill` (zeros: a uniform softmax, or ones as a softmax; harmless and never stored).
template <int NN, typename T>
[[gnu::always_inline]] inline void load(const T* x, int64_t ts, int64_t nt, T fill, T (*buf)[W]) {
#pragma GCC unroll 8
  for (int k = 0; k < NN * NN; ++k) {
    for (int64_t w = 0; w < nt; ++w) buf[k][w] = x[w * ts + k];
    for (int64_t w = nt; w < W; ++w) buf[k][w] = fill;
  }
}

template <int NN, typename T>
[[gnu::always_inline]] inline void store(const T (*buf)[W], int64_t nt, T* y) {
  for (int64_t w = 0; w < nt; ++w)
#pragma GCC unroll 16
    for (int k = 0; k < NN * NN; ++k) y[w * NN * NN + k] = buf[k][w];
}

// The row softmax of m in place (the start of the forward).
template <int NN, typename T>
[[gnu::always_inline]] inline void softmax_rows(T (*m)[W]) {
  T mx[W], s[W];
#pragma GCC unroll 8
  for (int i = 0; i < NN; ++i) {
    for (int w = 0; w < W; ++w) mx[w] = -std::numeric_limits<T>::infinity();
#pragma GCC unroll 8
    for (int j = 0; j < NN; ++j)
      for (int w = 0; w < W; ++w) mx[w] = std::max(mx[w], m[i * NN + j][w]);
    for (int w = 0; w < W; ++w) s[w] = 0;
#pragma GCC unroll 8
    for (int j = 0; j < NN; ++j)
      for (int w = 0; w < W; ++w) {
        m[i * NN + j][w] = std::exp(m[i * NN + j][w] - mx[w]);
        s[w] += m[i * NN + j][w];
      }
#pragma GCC unroll 8
    for (int j = 0; j < NN; ++j)
      for (int w = 0; w < W; ++w) m[i * NN + j][w] = m[i * NN + j][w] / s[w];
  }
}

// m = soft + eps (the start of the half steps).
template <int NN, typename T>
[[gnu::always_inline]] inline void plus_eps(const T (*soft)[W], T (*m)[W], T eps) {
#pragma GCC unroll 16
  for (int k = 0; k < NN * NN; ++k)
    for (int w = 0; w < W; ++w) m[k][w] = soft[k][w] + eps;
}

// The half steps, in place on m (softmax + eps on entry); `dens` gets the denominator of every half step when not
// null. Column step: entry (i, j) divided by d_j = sum_i m_ij + eps; row step: by d_i = sum_j m_ij + eps.
template <int NN, typename T>
[[gnu::always_inline]] inline void iterate(int64_t iters, T eps, T (*m)[W], T* dens) {
  T s[W];
  for (int64_t step = 0; step < 2 * iters - 1; ++step) {
    const bool col = step % 2 == 0;
#pragma GCC unroll 8
    for (int a = 0; a < NN; ++a) {  // a = the column (or row) being normalised
      for (int w = 0; w < W; ++w) s[w] = 0;
#pragma GCC unroll 8
      for (int c = 0; c < NN; ++c) {
        const int k = col ? c * NN + a : a * NN + c;
        for (int w = 0; w < W; ++w) s[w] += m[k][w];
      }
      for (int w = 0; w < W; ++w) s[w] += eps;
#pragma GCC unroll 8
      for (int c = 0; c < NN; ++c) {
        const int k = col ? c * NN + a : a * NN + c;
        for (int w = 0; w < W; ++w) m[k][w] /= s[w];
      }
      if (dens)
        for (int w = 0; w < W; ++w) dens[(step * NN + a) * W + w] = s[w];
    }
  }
}

// Backward through the half steps: g holds dL/dout on entry and P = dL/dm * m of the start on exit; m is the forward's
// output on entry and the start (softmax + eps) on exit; dens the denominators (from iterate).
template <int NN, typename T>
[[gnu::always_inline]] inline void walk_back(int64_t iters, T (*g)[W], T (*m)[W], const T* dens) {
  T s[W];
#pragma GCC unroll 16
  for (int k = 0; k < NN * NN; ++k)
    for (int w = 0; w < W; ++w) g[k][w] *= m[k][w];  // P = dL/dm * m
  for (int64_t step = 2 * iters - 2; step >= 0; --step) {
    const bool col = step % 2 == 0;
#pragma GCC unroll 8
    for (int a = 0; a < NN; ++a) {
      for (int w = 0; w < W; ++w) s[w] = 0;
#pragma GCC unroll 8
      for (int c = 0; c < NN; ++c) {
        const int k = col ? c * NN + a : a * NN + c;
        for (int w = 0; w < W; ++w) s[w] += g[k][w];
      }
      const T* d = dens + (step * NN + a) * W;
#pragma GCC unroll 8
      for (int c = 0; c < NN; ++c) {
        const int k = col ? c * NN + a : a * NN + c;
        for (int w = 0; w < W; ++w) {
          g[k][w] -= s[w] * m[k][w];
          m[k][w] *= d[w];
        }
      }
    }
  }
}

// g: P of the start on entry (m its softmax + eps, soft the softmax), dL/dlogits on exit: dL/dsoft = P / m, then the
// row softmax backward soft * (dsoft - <dsoft, soft>).
template <int NN, typename T>
[[gnu::always_inline]] inline void softmax_backward(T (*g)[W], const T (*m)[W], const T (*soft)[W]) {
  T s[W];
#pragma GCC unroll 8
  for (int i = 0; i < NN; ++i) {
    for (int w = 0; w < W; ++w) s[w] = 0;
#pragma GCC unroll 8
    for (int j = 0; j < NN; ++j) {
      const int k = i * NN + j;
      for (int w = 0; w < W; ++w) {
        g[k][w] /= m[k][w];
        s[w] += g[k][w] * soft[k][w];
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NN; ++j) {
      const int k = i * NN + j;
      for (int w = 0; w < W; ++w) g[k][w] = soft[k][w] * (g[k][w] - s[w]);
    }
  }
}

// Calls fn.template operator()<NN>() with the compile-time stream count NN == n (1 .. kMaxStreams).
template <typename F>
void with_streams(int64_t n, F&& fn) {
  TORCH_CHECK(n >= 1 && n <= kMaxStreams, "Sinkhorn op: 1 to ", kMaxStreams, " streams, got ", n);
  switch (n) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    case 4: return fn.template operator()<4>();
    case 5: return fn.template operator()<5>();
    case 6: return fn.template operator()<6>();
    case 7: return fn.template operator()<7>();
    default: return fn.template operator()<8>();
  }
}

at::Tensor as_tokens(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == t.size(2), "expected [N, n, n], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(t.device().is_cpu(), "CPU only");
  // any token stride is fine (e.g. a slice of the fused mHC logits); each n x n matrix must be row-major
  return (t.stride(2) == 1 && t.stride(1) == t.size(2)) ? t : t.contiguous();
}

}  // namespace

namespace glm_lightning_ops {

template <typename T>
void sinkhorn_forward(const T* x, int64_t ts, int64_t N, int64_t n, int64_t iters, T eps, T* y, T* sm) {
  with_streams(n, [&]<int NN>() {
    at::parallel_for(0, (N + W - 1) / W, 16, [&](int64_t begin, int64_t end) {
      T m[NN * NN][W];
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * W, nt = std::min(W, N - t0);
        load<NN>(x + t0 * ts, ts, nt, T(0), m);
        softmax_rows<NN>(m);
        if (sm) store<NN>(m, nt, sm + t0 * NN * NN);
        plus_eps<NN>(m, m, eps);
        iterate<NN>(iters, eps, m, static_cast<T*>(nullptr));
        store<NN>(m, nt, y + t0 * NN * NN);
      }
    });
  });
}

template void sinkhorn_forward<float>(const float*, int64_t, int64_t, int64_t, int64_t, float, float*, float*);
template void sinkhorn_forward<double>(const double*, int64_t, int64_t, int64_t, int64_t, double, double*, double*);

template <typename T>
void sinkhorn_backward_tokens(const T* gy, int64_t gs, const T* sm, int64_t ss, int64_t N, int64_t n, int64_t iters,
                              T e, T* gx) {
  with_streams(n, [&]<int NN>() {
    at::parallel_for(0, (N + W - 1) / W, 16, [&](int64_t begin, int64_t end) {
      T m[NN * NN][W], sf[NN * NN][W], g[NN * NN][W];
      std::vector<T> dens((2 * iters - 1) * NN * W);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * W, nt = std::min(W, N - t0);
        load<NN>(sm + t0 * ss, ss, nt, T(1) / NN, sf);
        plus_eps<NN>(sf, m, e);
        iterate<NN>(iters, e, m, dens.data());
        load<NN>(gy + t0 * gs, gs, nt, T(0), g);
        walk_back<NN>(iters, g, m, dens.data());
        load<NN>(sm + t0 * ss, ss, nt, T(1) / NN, sf);  // again: not held in registers through the walk
        softmax_backward<NN>(g, m, sf);
        store<NN>(g, nt, gx + t0 * NN * NN);
      }
    });
  });
}

template void sinkhorn_backward_tokens<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                                              float, float*);
template void sinkhorn_backward_tokens<double>(const double*, int64_t, const double*, int64_t, int64_t, int64_t,
                                               int64_t, double, double*);

}  // namespace glm_lightning_ops

namespace {

// (doubly stochastic result, row softmax of the logits): both [N, n, n]; the backward takes the softmax.
std::tuple<at::Tensor, at::Tensor> sinkhorn(const at::Tensor& logits_in, int64_t iters, double eps) {
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const at::Tensor logits = as_tokens(logits_in);
  const int64_t N = logits.size(0), n = logits.size(1), ts = logits.stride(0);
  at::Tensor out = at::empty({N, n, n}, logits.options());
  at::Tensor soft = at::empty({N, n, n}, logits.options());
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "sinkhorn", [&] {
    glm_lightning_ops::sinkhorn_forward(logits.data_ptr<scalar_t>(), ts, N, n, iters, static_cast<scalar_t>(eps),
                                        out.data_ptr<scalar_t>(), soft.data_ptr<scalar_t>());
  });
  return {out, soft};
}

at::Tensor sinkhorn_backward(const at::Tensor& grad_in, const at::Tensor& soft_in, int64_t iters, double eps) {
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const at::Tensor soft = as_tokens(soft_in);
  const at::Tensor grad = as_tokens(grad_in);
  const int64_t N = soft.size(0), n = soft.size(1), ss = soft.stride(0), gs = grad.stride(0);
  TORCH_CHECK(grad.sizes() == soft.sizes(), "grad shape ", grad.sizes(), " != softmax ", soft.sizes());
  TORCH_CHECK(grad.scalar_type() == soft.scalar_type(), "grad and softmax dtypes differ");
  at::Tensor out = at::empty({N, n, n}, soft.options());
  AT_DISPATCH_FLOATING_TYPES(soft.scalar_type(), "sinkhorn_backward", [&] {
    glm_lightning_ops::sinkhorn_backward_tokens(grad.data_ptr<scalar_t>(), gs, soft.data_ptr<scalar_t>(), ss, N, n,
                                                iters, static_cast<scalar_t>(eps), out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(glm_lightning, m) {
  m.def("sinkhorn(Tensor logits, int iters, float eps) -> (Tensor, Tensor)");
  m.def("sinkhorn_backward(Tensor grad, Tensor softmax, int iters, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("sinkhorn", &sinkhorn);
  m.impl("sinkhorn_backward", &sinkhorn_backward);
}
