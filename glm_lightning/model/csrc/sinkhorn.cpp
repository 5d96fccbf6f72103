// Sinkhorn-Knopp of [N, n, n] logits as two CPU ops (forward, backward), one call for all N tokens of an mHC site.
//
// Same arithmetic, in the same order, as the eager `_Sinkhorn` of glm_lightning/model/mhc.py: row softmax, + eps,
// then 2 * iters - 1 half steps m <- m / (sum + eps), columns first, alternating. The eager path dispatches ~3 ops per
// half step forward and ~4 backward (~270 ops per site for 20 iterations); here a block of W tokens is copied into an
// entries-major [n * n][W] buffer and iterated there, every step a loop over the W tokens that the compiler
// vectorises. The backward recomputes its block's forward (keeping the 2 * iters - 1 denominators) and walks the
// half steps back carrying P = dL/dm * m:  P_in = P_out - sum_dim(P_out) * m_out,  m_in = m_out * d.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t W = 16;  // tokens per block: one AVX-512 register of fp32, two of AVX2

// Sizes of the per-block work buffers, in elements.
struct Block {
  int64_t n, iters;
  int64_t mat() const { return n * n * W; }
  int64_t dens() const { return (2 * iters - 1) * n * W; }
};

// Load tokens [t0, t0 + nt) of x (token stride ts, each n x n row-major) entries-major into buf[k * W + w]; the unused
// lanes get zeros (a uniform softmax, harmless and never stored).
template <typename T>
void load(const T* x, int64_t ts, int64_t nt, int64_t nn, T* buf) {
  for (int64_t k = 0; k < nn; ++k) {
    for (int64_t w = 0; w < nt; ++w) buf[k * W + w] = x[w * ts + k];
    for (int64_t w = nt; w < W; ++w) buf[k * W + w] = 0;
  }
}

template <typename T>
void store(const T* buf, int64_t nt, int64_t nn, T* y) {
  for (int64_t w = 0; w < nt; ++w)
    for (int64_t k = 0; k < nn; ++k) y[w * nn + k] = buf[k * W + w];
}

// Forward of one block, in place on m (holding the logits on entry). `soft` gets the softmax and `dens` the
// denominator of every half step, when not null.
template <typename T>
void block_forward(const Block& b, T eps, T* m, T* soft, T* dens) {
  const int64_t n = b.n;
  T mx[W], s[W];
  for (int64_t i = 0; i < n; ++i) {  // row softmax
    T* row = m + i * n * W;
    for (int64_t w = 0; w < W; ++w) mx[w] = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < n; ++j)
      for (int64_t w = 0; w < W; ++w) mx[w] = std::max(mx[w], row[j * W + w]);
    for (int64_t w = 0; w < W; ++w) s[w] = 0;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t w = 0; w < W; ++w) {
        row[j * W + w] = std::exp(row[j * W + w] - mx[w]);
        s[w] += row[j * W + w];
      }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t w = 0; w < W; ++w) {
        T v = row[j * W + w] / s[w];
        if (soft) soft[(i * n + j) * W + w] = v;
        row[j * W + w] = v + eps;
      }
  }
  for (int64_t step = 0; step < 2 * b.iters - 1; ++step) {
    // column step: entry (i, j) divided by d_j = sum_i m_ij + eps; row step: by d_i = sum_j m_ij + eps
    const bool col = step % 2 == 0;
    for (int64_t a = 0; a < n; ++a) {  // a = the column (or row) being normalised
      for (int64_t w = 0; w < W; ++w) s[w] = 0;
      for (int64_t c = 0; c < n; ++c) {
        const T* e = m + (col ? c * n + a : a * n + c) * W;
        for (int64_t w = 0; w < W; ++w) s[w] += e[w];
      }
      for (int64_t w = 0; w < W; ++w) s[w] += eps;
      for (int64_t c = 0; c < n; ++c) {
        T* e = m + (col ? c * n + a : a * n + c) * W;
        for (int64_t w = 0; w < W; ++w) e[w] /= s[w];
      }
      if (dens)
        for (int64_t w = 0; w < W; ++w) dens[(step * n + a) * W + w] = s[w];
    }
  }
}

// Backward of one block: g holds dL/dout on entry and dL/dlogits on exit; m, soft, dens from block_forward.
template <typename T>
void block_backward(const Block& b, T* g, T* m, const T* soft, const T* dens) {
  const int64_t n = b.n, nn = n * n;
  T s[W];
  for (int64_t k = 0; k < nn * W; ++k) g[k] *= m[k];  // P = dL/dm * m
  for (int64_t step = 2 * b.iters - 2; step >= 0; --step) {
    const bool col = step % 2 == 0;
    for (int64_t a = 0; a < n; ++a) {
      for (int64_t w = 0; w < W; ++w) s[w] = 0;
      for (int64_t c = 0; c < n; ++c) {
        const T* p = g + (col ? c * n + a : a * n + c) * W;
        for (int64_t w = 0; w < W; ++w) s[w] += p[w];
      }
      const T* d = dens + (step * n + a) * W;
      for (int64_t c = 0; c < n; ++c) {
        const int64_t k = (col ? c * n + a : a * n + c) * W;
        for (int64_t w = 0; w < W; ++w) {
          g[k + w] -= s[w] * m[k + w];
          m[k + w] *= d[w];
        }
      }
    }
  }
  // m is the softmax + eps again: dL/dsoft = P / m, then the row softmax backward soft * (dsoft - <dsoft, soft>)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t w = 0; w < W; ++w) s[w] = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = (i * n + j) * W;
      for (int64_t w = 0; w < W; ++w) {
        g[k + w] /= m[k + w];
        s[w] += g[k + w] * soft[k + w];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = (i * n + j) * W;
      for (int64_t w = 0; w < W; ++w) g[k + w] = soft[k + w] * (g[k + w] - s[w]);
    }
  }
}

at::Tensor as_tokens(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == t.size(2), "expected [N, n, n], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(t.device().is_cpu(), "CPU only");
  // any token stride is fine (e.g. a slice of the fused mHC logits); each n x n matrix must be row-major
  return (t.stride(2) == 1 && t.stride(1) == t.size(2)) ? t : t.contiguous();
}

at::Tensor sinkhorn(const at::Tensor& logits_in, int64_t iters, double eps) {
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const at::Tensor logits = as_tokens(logits_in);
  const int64_t N = logits.size(0), n = logits.size(1), ts = logits.stride(0);
  at::Tensor out = at::empty({N, n, n}, logits.options());
  const Block b{n, iters};
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "sinkhorn", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, (N + W - 1) / W, 16, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> m(b.mat());
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * W, nt = std::min(W, N - t0);
        load(x + t0 * ts, ts, nt, n * n, m.data());
        block_forward<scalar_t>(b, static_cast<scalar_t>(eps), m.data(), nullptr, nullptr);
        store(m.data(), nt, n * n, y + t0 * n * n);
      }
    });
  });
  return out;
}

at::Tensor sinkhorn_backward(const at::Tensor& grad_in, const at::Tensor& logits_in, int64_t iters, double eps) {
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const at::Tensor logits = as_tokens(logits_in);
  const at::Tensor grad = as_tokens(grad_in);
  const int64_t N = logits.size(0), n = logits.size(1), ts = logits.stride(0), gs = grad.stride(0);
  TORCH_CHECK(grad.sizes() == logits.sizes(), "grad shape ", grad.sizes(), " != logits ", logits.sizes());
  at::Tensor out = at::empty({N, n, n}, logits.options());
  const Block b{n, iters};
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "sinkhorn_backward", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const scalar_t* gy = grad.data_ptr<scalar_t>();
    scalar_t* gx = out.data_ptr<scalar_t>();
    at::parallel_for(0, (N + W - 1) / W, 16, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> buf(3 * b.mat() + b.dens());
      scalar_t *m = buf.data(), *soft = m + b.mat(), *g = soft + b.mat(), *dens = g + b.mat();
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * W, nt = std::min(W, N - t0);
        load(x + t0 * ts, ts, nt, n * n, m);
        block_forward<scalar_t>(b, static_cast<scalar_t>(eps), m, soft, dens);
        load(gy + t0 * gs, gs, nt, n * n, g);
        block_backward<scalar_t>(b, g, m, soft, dens);
        store(g, nt, n * n, gx + t0 * n * n);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(glm_lightning, m) {
  m.def("sinkhorn(Tensor logits, int iters, float eps) -> Tensor");
  m.def("sinkhorn_backward(Tensor grad, Tensor logits, int iters, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("sinkhorn", &sinkhorn);
  m.impl("sinkhorn_backward", &sinkhorn_backward);
}
