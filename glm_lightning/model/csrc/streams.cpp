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

namespace {

void check_same(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "dtype mismatch");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "CPU only");
}

// x [T, n, C], w [T, n] -> sum_i w[t, i] x[t, i, :]  (the read, and the y-gradient of the write)
at::Tensor stream_read(const at::Tensor& w_in, const at::Tensor& x_in) {
  check_same(w_in, x_in);
  const at::Tensor w = w_in.contiguous(), x = x_in.contiguous();
  const int64_t T = x.size(0), n = x.size(1), C = x.size(2);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == T && w.size(1) == n, "expected w [T, n] for x ", x.sizes());
  at::Tensor h = at::zeros({T, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_read", [&] {
    const scalar_t *wp = w.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t wi = wp[t * n + i];
          const scalar_t* xi = xp + (t * n + i) * C;
          scalar_t* ht = hp + t * C;
          for (int64_t c = 0; c < C; ++c) ht[c] += wi * xi[c];
        }
    });
  });
  return h;
}

// grad [T, C], w [T, n], x [T, n, C] -> (dL/dw [T, n] = <grad, x_i>, dL/dx [T, n, C] = w_i grad)
std::tuple<at::Tensor, at::Tensor> stream_read_backward(const at::Tensor& g_in, const at::Tensor& w_in,
                                                        const at::Tensor& x_in) {
  check_same(g_in, x_in);
  const at::Tensor g = g_in.contiguous(), w = w_in.contiguous(), x = x_in.contiguous();
  const int64_t T = x.size(0), n = x.size(1), C = x.size(2);
  at::Tensor gw = at::empty({T, n}, x.options()), gx = at::empty({T, n, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_read_backward", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>();
    scalar_t *gwp = gw.data_ptr<scalar_t>(), *gxp = gx.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* gt = gp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* xi = xp + (t * n + i) * C;
          scalar_t* gxi = gxp + (t * n + i) * C;
          const scalar_t wi = wp[t * n + i];
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

// res [T, n, n], x [T, n, C], post [T, n], y [T, C] -> res x + post^T y  [T, n, C]
at::Tensor stream_write(const at::Tensor& res_in, const at::Tensor& x_in, const at::Tensor& post_in,
                        const at::Tensor& y_in) {
  check_same(res_in, x_in);
  const at::Tensor res = res_in.contiguous(), x = x_in.contiguous(), post = post_in.contiguous(),
                   y = y_in.contiguous();
  const int64_t T = x.size(0), n = x.size(1), C = x.size(2);
  TORCH_CHECK(res.dim() == 3 && res.size(0) == T && res.size(1) == n && res.size(2) == n, "res shape");
  TORCH_CHECK(post.numel() == T * n && y.numel() == T * C, "post / y shape");
  at::Tensor out = at::empty({T, n, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_write", [&] {
    const scalar_t *rp = res.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>(), *pp = post.data_ptr<scalar_t>(),
                   *yp = y.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* yt = yp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          scalar_t* oi = op + (t * n + i) * C;
          const scalar_t pi = pp[t * n + i];
          for (int64_t c = 0; c < C; ++c) oi[c] = pi * yt[c];
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t rij = rp[(t * n + i) * n + j];
            const scalar_t* xj = xp + (t * n + j) * C;
            for (int64_t c = 0; c < C; ++c) oi[c] += rij * xj[c];
          }
        }
      }
    });
  });
  return out;
}

// grad [T, n, C] -> (d res [T, n, n] = grad x^T, d x = res^T grad, d post [T, n] = grad y, d y [T, C] = post grad)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stream_write_backward(
    const at::Tensor& g_in, const at::Tensor& res_in, const at::Tensor& x_in, const at::Tensor& post_in,
    const at::Tensor& y_in) {
  check_same(g_in, x_in);
  const at::Tensor g = g_in.contiguous(), res = res_in.contiguous(), x = x_in.contiguous(),
                   post = post_in.contiguous(), y = y_in.contiguous();
  const int64_t T = x.size(0), n = x.size(1), C = x.size(2);
  at::Tensor gres = at::empty({T, n, n}, x.options()), gx = at::zeros({T, n, C}, x.options()),
             gpost = at::empty({T, n}, x.options()), gy = at::zeros({T, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stream_write_backward", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *rp = res.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>(),
                   *pp = post.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    scalar_t *grp = gres.data_ptr<scalar_t>(), *gxp = gx.data_ptr<scalar_t>(), *gpp = gpost.data_ptr<scalar_t>(),
             *gyp = gy.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* yt = yp + t * C;
        scalar_t* gyt = gyp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* gi = gp + (t * n + i) * C;
          const scalar_t pi = pp[t * n + i];
          scalar_t dot = 0;
          for (int64_t c = 0; c < C; ++c) {
            dot += gi[c] * yt[c];
            gyt[c] += pi * gi[c];
          }
          gpp[t * n + i] = dot;
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* xj = xp + (t * n + j) * C;
            scalar_t* gxj = gxp + (t * n + j) * C;
            const scalar_t rij = rp[(t * n + i) * n + j];
            scalar_t s = 0;
            for (int64_t c = 0; c < C; ++c) {
              s += gi[c] * xj[c];
              gxj[c] += rij * gi[c];
            }
            grp[(t * n + i) * n + j] = s;
          }
        }
      }
    });
  });
  return {gres, gx, gpost, gy};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("stream_read(Tensor w, Tensor x) -> Tensor");
  m.def("stream_read_backward(Tensor grad, Tensor w, Tensor x) -> (Tensor, Tensor)");
  m.def("stream_write(Tensor res, Tensor x, Tensor post, Tensor y) -> Tensor");
  m.def("stream_write_backward(Tensor grad, Tensor res, Tensor x, Tensor post, Tensor y) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("stream_read", &stream_read);
  m.impl("stream_read_backward", &stream_read_backward);
  m.impl("stream_write", &stream_write);
  m.impl("stream_write_backward", &stream_write_backward);
}
