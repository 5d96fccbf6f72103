// The per-token stream algebra of an mHC site (glm_lightning/model/mhc.py) as CPU ops, forward and backward:
//
//   read:   h[t, c]      = sum_i pre[t, i] x[t, i, c]                                  [T, n] x [T, n, C] -> [T, C]
//   write:  out[t, i, c] = sum_j res[t, i, j] x[t, j, c] + post[t, i] y[t, c]          -> [T, n, C]
//
// n (2 or 4 streams) is tiny, so ATen runs these either as one tiny GEMM per token or as a chain of broadcast
// multiply-adds (~15 ops forward, ~55 backward per site). Here every token is a few loops over the C channels
// (contiguous, vectorised), all tokens in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::kLanes;
using glm_lightning_ops::Lanes;
using glm_lightning_ops::kMaxStreams;

// A [..., k] operand as (pointer offset per token): row-major with a uniform token stride (e.g. H_post, a slice of
// the fused gates), so that no copy is needed; anything else is made contiguous (one copy).
struct Tokens {
  at::Tensor t;
  int64_t stride;
};

Tokens tokens(const at::Tensor& t, int64_t k) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(t.device().is_cpu(), "CPU only");
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == k, "expected a last dimension of ", k, ", got ", t.sizes());
  bool uniform = t.stride(-1) == 1;
  const int64_t d = t.dim();
  const int64_t ts = d >= 2 ? t.stride(d - 2) : k;
  for (int64_t i = d - 3; i >= 0 && uniform; --i)
    uniform = t.size(i) == 1 || t.stride(i) == t.stride(i + 1) * t.size(i + 1);
  if (uniform && (d < 2 || t.size(d - 2) == 1 || ts >= k)) return {t, d >= 2 ? ts : k};
  return {t.contiguous(), k};
}

// A [..., n, C] (or [..., C]) operand that must be contiguous.
at::Tensor dense(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(t.device().is_cpu(), "CPU only");
  return t.contiguous();
}

std::vector<int64_t> without_stream_dim(const at::Tensor& x) {  // [..., n, C] -> [..., C]
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.erase(s.end() - 2);
  return s;
}

// h[t, c] = sum_i w[t, i] x[t, i, c]:  w [..., n], x [..., n, C] -> [..., C]
at::Tensor stream_read(const at::Tensor& w_in, const at::Tensor& x_in) {
  const at::Tensor x = dense(x_in);
  const int64_t n = x.size(-2), C = x.size(-1), T = x.numel() / (n * C);
  const Tokens w = tokens(w_in, n);
  TORCH_CHECK(w.t.numel() == T * n && w.t.scalar_type() == x.scalar_type(), "w must be [..., n] like x");
  at::Tensor h = at::empty(without_stream_dim(x), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_read", [&] {
    const scalar_t *wp = w.t.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        scalar_t* ht = hp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t wi = wp[t * w.stride + i];
          const scalar_t* xi = xp + (t * n + i) * C;
          if (i == 0)
            for (int64_t c = 0; c < C; ++c) ht[c] = wi * xi[c];
          else
            for (int64_t c = 0; c < C; ++c) ht[c] += wi * xi[c];
        }
      }
    });
  });
  return h;
}

// grad [..., C] -> (dL/dw [..., n] = <grad, x_i>, dL/dx [..., n, C] = w_i grad)
std::tuple<at::Tensor, at::Tensor> stream_read_backward(const at::Tensor& g_in, const at::Tensor& w_in,
                                                        const at::Tensor& x_in) {
  const at::Tensor g = dense(g_in), x = dense(x_in);
  const int64_t n = x.size(-2), C = x.size(-1), T = x.numel() / (n * C);
  const Tokens w = tokens(w_in, n);
  TORCH_CHECK(g.numel() == T * C && g.scalar_type() == x.scalar_type(), "grad must be [..., C] like x");
  at::Tensor gw = at::empty(w_in.sizes(), x.options()), gx = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_read_backward", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *wp = w.t.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    scalar_t *gwp = gw.data_ptr<scalar_t>(), *gxp = gx.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* gt = gp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* xi = xp + (t * n + i) * C;
          scalar_t* gxi = gxp + (t * n + i) * C;
          const scalar_t wi = wp[t * w.stride + i];
          scalar_t dot = 0;
          for (int64_t c = 0; c < C; ++c) {
            dot += gt[c] * xi[c];
            gxi[c] = wi * gt[c];
          }
          gwp[t * n + i] = dot;
        }
      }
    });
  });
  return {gw, gx};
}

// Calls fn.template operator()<NS>() with NS = n for the common stream counts (2, 4), else NS = 0 (n at run time):
// with n known at compile time the per-stream vectors and the n^2 partial sums below stay in registers.
template <typename F>
void with_stream_count(int64_t n, F&& fn) {
  if (n == 4) return fn.template operator()<4>();
  if (n == 2) return fn.template operator()<2>();
  return fn.template operator()<0>();
}

// One token of the write, out_i = post_i y + sum_j res_ij x_j, kLanes channels at a time in registers (C a multiple of
// kLanes), each output vector stored once, past the cache where `streaming` (a training step's 12.6 MB output, read
// by the next site much later). The same products and sums in the same order as the scalar loop: the same values.
template <typename T, int NS>
inline void write_token(const T* __restrict r, const T* __restrict x, const T* __restrict p, const T* __restrict y,
                        T* __restrict out, int64_t n_rt, int64_t C, bool streaming) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int kMax = NS > 0 ? NS : kMaxStreams;
  const int64_t n = NS > 0 ? NS : n_rt;
  for (int64_t c = 0; c < C; c += kLanes) {
    Vec xv[kMax];
    for (int64_t j = 0; j < n; ++j) xv[j] = L::load(x + j * C + c);
    const Vec yv = L::load(y + c);
    for (int64_t i = 0; i < n; ++i) {
      // (post_i y rounded, then one FMA per j: written with the j = 0 product first, for the compiler contracts the
      // first product it meets into the add; post_i y first became the FMA and the sums differed in the last bit)
      Vec o = r[i * n] * xv[0] + p[i] * yv;
      for (int64_t j = 1; j < n; ++j) o += r[i * n + j] * xv[j];
      if (streaming)
        glm_lightning_ops::store_streaming<T>(out + i * C + c, o);
      else
        L::store(out + i * C + c, o);
    }
  }
}

// res [..., n, n], x [..., n, C], post [..., n], y [..., C] -> res x + post^T y  [..., n, C]
at::Tensor stream_write(const at::Tensor& res_in, const at::Tensor& x_in, const at::Tensor& post_in,
                        const at::Tensor& y_in) {
  const at::Tensor x = dense(x_in), y = dense(y_in);
  const int64_t n = x.size(-2), C = x.size(-1), T = x.numel() / (n * C);
  const Tokens res = tokens(res_in.reshape({-1, n * n}), n * n), post = tokens(post_in, n);
  TORCH_CHECK(res.t.numel() == T * n * n && post.t.numel() == T * n && y.numel() == T * C, "operand shapes");
  TORCH_CHECK(res.t.scalar_type() == x.scalar_type() && post.t.scalar_type() == x.scalar_type() &&
              y.scalar_type() == x.scalar_type(), "dtype mismatch");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_write", [&] {
    const scalar_t *rp = res.t.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>(),
                   *pp = post.t.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    if (C % kLanes == 0 && n <= kMaxStreams) {
      const bool streaming = glm_lightning_ops::streaming_output(op, T * n * C);
      with_stream_count(n, [&]<int NS>() {
        at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
          for (int64_t t = b; t < e; ++t)
            write_token<scalar_t, NS>(rp + t * res.stride, xp + t * n * C, pp + t * post.stride, yp + t * C,
                                      op + t * n * C, n, C, streaming);
          glm_lightning_ops::streaming_done();
        });
      });
      return;
    }
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* yt = yp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          scalar_t* oi = op + (t * n + i) * C;
          const scalar_t pi = pp[t * post.stride + i];
          for (int64_t c = 0; c < C; ++c) oi[c] = pi * yt[c];
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t rij = rp[t * res.stride + i * n + j];
            const scalar_t* xj = xp + (t * n + j) * C;
            for (int64_t c = 0; c < C; ++c) oi[c] += rij * xj[c];
          }
        }
      }
    });
  });
  return out;
}

// One token of the write's backward from its output gradient g [n, C]: gy = sum_i p_i g_i, gx_j = sum_i r_ij g_i,
// gp_i = <g_i, y>, gr_ij = <g_i, x_j>, all per kLanes channels in one pass (each vector loaded once, no gradient row
// read back). The n^2 + n dot products are kLanes partial sums in registers (a scalar `s +=` loop is not vectorised
// without -ffast-math), reduced kLanes at a time (Lanes::sums16: bit for bit as one reduction each).
template <typename T, int NS>
inline void write_backward_token(const T* __restrict g, const T* __restrict r, const T* __restrict x,
                                 const T* __restrict p, const T* __restrict y, T* __restrict gr, T* __restrict gx,
                                 T* __restrict gp, T* __restrict gy, int64_t n_rt, int64_t C) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int kMax = NS > 0 ? NS : kMaxStreams;
  const int64_t n = NS > 0 ? NS : n_rt;
  Vec s[kMax * kMax] = {}, d[kMax] = {}, gv[kMax];
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes) {
    for (int64_t i = 0; i < n; ++i) gv[i] = L::load(g + i * C + c);
    const Vec yv = L::load(y + c);
    Vec acc = {};
    for (int64_t i = 0; i < n; ++i) {
      acc += p[i] * gv[i];
      d[i] += gv[i] * yv;
    }
    L::store(gy + c, acc);
    for (int64_t j = 0; j < n; ++j) {
      const Vec xv = L::load(x + j * C + c);
      Vec a = {};
      for (int64_t i = 0; i < n; ++i) {
        a += r[i * n + j] * gv[i];
        s[i * n + j] += gv[i] * xv;
      }
      L::store(gx + j * C + c, a);
    }
  }
  if constexpr (NS > 0 && NS * NS % kLanes == 0) {
    for (int k = 0; k < NS * NS; k += kLanes) L::store(gr + k, L::sums16(s + k));
  } else {
    for (int64_t k = 0; k < n * n; ++k) gr[k] = L::sum(s[k]);
  }
  for (int64_t i = 0; i < n; ++i) gp[i] = L::sum(d[i]);
  for (; c < C; ++c) {  // channels past the last full kLanes
    T acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc += p[i] * g[i * C + c];
      gp[i] += g[i * C + c] * y[c];
      for (int64_t j = 0; j < n; ++j) gr[i * n + j] += g[i * C + c] * x[j * C + c];
    }
    gy[c] = acc;
    for (int64_t j = 0; j < n; ++j) {
      T a = 0;
      for (int64_t i = 0; i < n; ++i) a += r[i * n + j] * g[i * C + c];
      gx[j * C + c] = a;
    }
  }
}

// grad [..., n, C] -> (d res = grad x^T, d x = res^T grad, d post = grad y, d y = post grad), shaped as the inputs
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stream_write_backward(
    const at::Tensor& g_in, const at::Tensor& res_in, const at::Tensor& x_in, const at::Tensor& post_in,
    const at::Tensor& y_in) {
  const at::Tensor g = dense(g_in), x = dense(x_in), y = dense(y_in);
  const int64_t n = x.size(-2), C = x.size(-1), T = x.numel() / (n * C);
  const Tokens res = tokens(res_in.reshape({-1, n * n}), n * n), post = tokens(post_in, n);
  TORCH_CHECK(g.numel() == T * n * C && g.scalar_type() == x.scalar_type(), "grad must be shaped as x");
  TORCH_CHECK(n <= kMaxStreams, "stream_write_backward: at most ", kMaxStreams, " streams");
  at::Tensor gres = at::empty(res_in.sizes(), x.options()), gx = at::empty(x.sizes(), x.options()),
             gpost = at::empty(post_in.sizes(), x.options()), gy = at::empty(y_in.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_write_backward", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *rp = res.t.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>(),
                   *pp = post.t.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    scalar_t *grp = gres.data_ptr<scalar_t>(), *gxp = gx.data_ptr<scalar_t>(), *gpp = gpost.data_ptr<scalar_t>(),
             *gyp = gy.data_ptr<scalar_t>();
    with_stream_count(n, [&]<int NS>() {
      at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t)
          write_backward_token<scalar_t, NS>(gp + t * n * C, rp + t * res.stride, xp + t * n * C,
                                             pp + t * post.stride, yp + t * C, grp + t * n * n, gxp + t * n * C,
                                             gpp + t * n, gyp + t * C, n, C);
      });
    });
  });
  return {gres, gx, gpost, gy};
}

// The linked write's backward (glm_lightning/model/ops/mhc.py, _StreamWriteLinked): only d post = grad y and d y =
// post grad, one pass over grad; the write's gradients of H_res and of the streams are formed by the site read's
// backward from grad (csrc/site_read.cpp, site_read_backward_linked), which reads grad and the streams anyway. The
// sums in write_backward_token's order, so the same values bit for bit.
template <typename T, int NS>
inline void write_backward_token_linked(const T* __restrict g, const T* __restrict p, const T* __restrict y,
                                        T* __restrict gp, T* __restrict gy, int64_t n_rt, int64_t C) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int kMax = NS > 0 ? NS : kMaxStreams;
  const int64_t n = NS > 0 ? NS : n_rt;
  Vec d[kMax] = {};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes) {
    const Vec yv = L::load(y + c);
    Vec acc = {};
    for (int64_t i = 0; i < n; ++i) {
      const Vec gv = L::load(g + i * C + c);
      acc += p[i] * gv;
      d[i] += gv * yv;
    }
    L::store(gy + c, acc);
  }
  for (int64_t i = 0; i < n; ++i) gp[i] = L::sum(d[i]);
  for (; c < C; ++c) {
    T acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc += p[i] * g[i * C + c];
      gp[i] += g[i * C + c] * y[c];
    }
    gy[c] = acc;
  }
}

// grad [..., n, C] -> (d post = grad y [..., n], d y = post grad [..., C])
std::tuple<at::Tensor, at::Tensor> stream_write_backward_linked(const at::Tensor& g_in, const at::Tensor& post_in,
                                                                const at::Tensor& y_in) {
  const at::Tensor g = dense(g_in), y = dense(y_in);
  const int64_t n = g.size(-2), C = g.size(-1), T = g.numel() / (n * C);
  const Tokens post = tokens(post_in, n);
  TORCH_CHECK(post.t.numel() == T * n && y.numel() == T * C, "operand shapes");
  TORCH_CHECK(post.t.scalar_type() == g.scalar_type() && y.scalar_type() == g.scalar_type(), "dtype mismatch");
  TORCH_CHECK(n <= kMaxStreams, "stream_write_backward_linked: at most ", kMaxStreams, " streams");
  at::Tensor gpost = at::empty(post_in.sizes(), g.options()), gy = at::empty(y_in.sizes(), g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "stream_write_backward_linked", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *pp = post.t.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    scalar_t *gpp = gpost.data_ptr<scalar_t>(), *gyp = gy.data_ptr<scalar_t>();
    with_stream_count(n, [&]<int NS>() {
      at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t)
          write_backward_token_linked<scalar_t, NS>(gp + t * n * C, pp + t * post.stride, yp + t * C, gpp + t * n,
                                                    gyp + t * C, n, C);
      });
    });
  });
  return {gpost, gy};
}

}  // namespace

namespace streams_ops {  // block_decode.cpp calls it as a C++ function (no dispatch per call)
at::Tensor stream_write(const at::Tensor& res, const at::Tensor& x, const at::Tensor& post, const at::Tensor& y) {
  return ::stream_write(res, x, post, y);
}
}  // namespace streams_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("stream_read(Tensor w, Tensor x) -> Tensor");
  m.def("stream_read_backward(Tensor grad, Tensor w, Tensor x) -> (Tensor, Tensor)");
  m.def("stream_write(Tensor res, Tensor x, Tensor post, Tensor y) -> Tensor");
  m.def("stream_write_backward(Tensor grad, Tensor res, Tensor x, Tensor post, Tensor y) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("stream_write_backward_linked(Tensor grad, Tensor post, Tensor y) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("stream_read", &stream_read);
  m.impl("stream_read_backward", &stream_read_backward);
  m.impl("stream_write", &stream_write);
  m.impl("stream_write_backward", &stream_write_backward);
  m.impl("stream_write_backward_linked", &stream_write_backward_linked);
}
