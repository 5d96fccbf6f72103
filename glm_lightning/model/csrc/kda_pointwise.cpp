// KDA's features between the short conv and the recurrence (glm_lightning/model/kda_fused.py: KDAFeatures) as two
// CPU ops, one pass over the tokens each way (the gated output norm after the recurrence is csrc/rms_norm.cpp's).
// Per token row r, with H heads of size K and a = exp(A_log):
//   qk[r, i, :] = u / (max(|u|, 1e-6) rescale[i]),  u = y[r, iK : (i+1)K]   i < 2H (q heads, then k heads)
//   g[r, j]     = lb sigmoid(a[j / K] f[r, j])                               j < HK
//   beta[r, h]  = sigmoid(b[r, h])                                           (v is y's last HK columns, a view)
// kda_features(y [R, 3HK], f [R, HK], b [R, H], a [H], rescale [2H], lb) -> (qk [R, 2H, K], g [R, HK], beta [R, H])
// kda_features_backward(dq [R, H, K], dk [R, H, K], dv [R, HK], dg [R, HK], dbeta [R, H], y, f, beta, a, rescale, lb)
//     -> (dy [R, 3HK], df [R, HK], db [R, H], dA_log [H]); the norms and gate sigmoids are recomputed:
//   du = (dqk - x <x, dqk>) / (max(|u|, 1e-6) rescale),  x = u / |u| (0 where the norm is clamped)
//   dz = lb dg s (1 - s), s = sigmoid(a f):  df = a dz,  dA_log[h] = a[h] sum_{r, k} dz f,  db = dbeta beta (1 - beta)
//
// Why: as ATen ops these were ~14 forward and ~18 backward per layer over small [B, T, HK]-sized tensors, which the
// dispatch-bound study model pays for in overhead, not arithmetic. Each token row is one function over __restrict
// pointers (written inline in the ops' lambdas, whose captured pointers may alias the outputs, the loops ran ~3x
// slower), its head-channel sums `omp simd` reductions. dA_log sums fixed blocks of rows and then the blocks in order,
// so its value does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::as_rows;
using glm_lightning_ops::dot_;
using glm_lightning_ops::kRowBlock;
using glm_lightning_ops::sigmoid_;
using glm_lightning_ops::sum_squares;

constexpr double kL2Eps = 1e-6;      // as F.normalize (kda_fused._L2_EPS)
// ---- the features ------------------------------------------------------------------------------------------------
template <typename T>
void features_row(const T* __restrict y, const T* __restrict f, const T* __restrict b, const T* __restrict a,
                  const T* __restrict rescale, T lb, int64_t H, int64_t K, T* __restrict qk, T* __restrict g,
                  T* __restrict beta) {
  for (int64_t i = 0; i < 2 * H; ++i) {
    const T* u = y + i * K;
    const T inv = T(1) / (std::max(std::sqrt(sum_squares(u, K)), static_cast<T>(kL2Eps)) * rescale[i]);
    T* out = qk + i * K;
    for (int64_t k = 0; k < K; ++k) out[k] = u[k] * inv;
  }
  for (int64_t h = 0; h < H; ++h) {
    const T ah = a[h];
    for (int64_t k = 0; k < K; ++k) g[h * K + k] = lb * sigmoid_(ah * f[h * K + k]);
    beta[h] = sigmoid_(b[h]);
  }
}

// One row's dy (qk part: the L2 norm's backward; v part: dv) and df, db; adds its dz f sums into dA [H].
template <typename T>
void features_row_backward(const T* __restrict dq, const T* __restrict dk, const T* __restrict dv,
                           const T* __restrict dg, const T* __restrict dbeta, const T* __restrict y,
                           const T* __restrict f, const T* __restrict beta, const T* __restrict a,
                           const T* __restrict rescale, T lb, int64_t H, int64_t K, T* __restrict dy,
                           T* __restrict df, T* __restrict db, T* __restrict dA) {
  const T eps = static_cast<T>(kL2Eps);
  for (int64_t i = 0; i < 2 * H; ++i) {
    const T* u = y + i * K;
    const T* d = i < H ? dq + i * K : dk + (i - H) * K;
    const T nrm = std::sqrt(sum_squares(u, K));
    const T inv_den = T(1) / (std::max(nrm, eps) * rescale[i]);
    const T inv = nrm >= eps ? T(1) / nrm : T(0);  // x = u / |u|, or 0 where the norm is clamped
    const T c = dot_(u, d, K) * inv * inv;          // <x, d> / |u|
    T* out = dy + i * K;
    for (int64_t k = 0; k < K; ++k) out[k] = (d[k] - u[k] * c) * inv_den;
  }
  for (int64_t j = 0; j < H * K; ++j) dy[2 * H * K + j] = dv[j];
  for (int64_t h = 0; h < H; ++h) {
    const T ah = a[h];
    const T* fh = f + h * K;
    T* dfh = df + h * K;
    for (int64_t k = 0; k < K; ++k) {  // dz into df first, then its sum with f, then df = a dz
      const T s = sigmoid_(ah * fh[k]);
      dfh[k] = lb * dg[h * K + k] * s * (T(1) - s);
    }
    dA[h] += dot_(dfh, fh, K);
    for (int64_t k = 0; k < K; ++k) dfh[k] *= ah;
    db[h] = dbeta[h] * beta[h] * (T(1) - beta[h]);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kda_features(const at::Tensor& y_in, const at::Tensor& f_in,
                                                            const at::Tensor& b_in, const at::Tensor& a_in,
                                                            const at::Tensor& rescale_in, double lb) {
  TORCH_CHECK(y_in.scalar_type() == at::kFloat || y_in.scalar_type() == at::kDouble, "fp32 or fp64 only");
  const int64_t H = a_in.numel();
  TORCH_CHECK(H >= 1 && rescale_in.numel() == 2 * H, "a must be [H] and rescale [2H]");
  TORCH_CHECK(y_in.size(-1) % (3 * H) == 0, "y's last dim must be 3 H K");
  const int64_t K = y_in.size(-1) / (3 * H), R = y_in.numel() / (3 * H * K), HK = H * K;
  const at::Tensor y = as_rows(y_in, R, 3 * HK, "y"), f = as_rows(f_in, R, HK, "f"),
                   b = as_rows(b_in, R, H, "b");
  const at::Tensor a = a_in.contiguous(), rescale = rescale_in.reshape({2 * H}).contiguous();
  for (const at::Tensor* t : {&f, &b, &a, &rescale})
    TORCH_CHECK(t->scalar_type() == y.scalar_type(), "all inputs must have y's dtype");
  at::Tensor qk = at::empty({R, 2 * H, K}, y.options()), g = at::empty({R, HK}, y.options()),
             beta = at::empty({R, H}, y.options());
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "kda_features", [&] {
    using T = scalar_t;
    const T *yp = y.data_ptr<T>(), *fp = f.data_ptr<T>(), *bp = b.data_ptr<T>(), *ap = a.data_ptr<T>(),
            *rp = rescale.data_ptr<T>();
    T *qkp = qk.data_ptr<T>(), *gp = g.data_ptr<T>(), *betap = beta.data_ptr<T>();
    const T l = static_cast<T>(lb);
    at::parallel_for(0, R, kRowBlock, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        features_row<T>(yp + r * 3 * HK, fp + r * HK, bp + r * H, ap, rp, l, H, K, qkp + r * 2 * HK, gp + r * HK,
                        betap + r * H);
    });
  });
  return {qk, g, beta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_features_backward(
    const at::Tensor& dq_in, const at::Tensor& dk_in, const at::Tensor& dv_in, const at::Tensor& dg_in,
    const at::Tensor& dbeta_in, const at::Tensor& y_in, const at::Tensor& f_in, const at::Tensor& beta_in,
    const at::Tensor& a_in, const at::Tensor& rescale_in, double lb) {
  const int64_t H = a_in.numel();
  TORCH_CHECK(H >= 1 && rescale_in.numel() == 2 * H && y_in.size(-1) % (3 * H) == 0, "bad sizes");
  const int64_t K = y_in.size(-1) / (3 * H), R = y_in.numel() / (3 * H * K), HK = H * K;
  const at::Tensor y = as_rows(y_in, R, 3 * HK, "y"), f = as_rows(f_in, R, HK, "f"),
                   beta = as_rows(beta_in, R, H, "beta");
  const at::Tensor dq = as_rows(dq_in, R, HK, "dq"), dk = as_rows(dk_in, R, HK, "dk"),
                   dv = as_rows(dv_in, R, HK, "dv"), dg = as_rows(dg_in, R, HK, "dg"),
                   dbeta = as_rows(dbeta_in, R, H, "dbeta");
  const at::Tensor a = a_in.contiguous(), rescale = rescale_in.reshape({2 * H}).contiguous();
  for (const at::Tensor* t : {&f, &beta, &dq, &dk, &dv, &dg, &dbeta, &a, &rescale})
    TORCH_CHECK(t->scalar_type() == y.scalar_type(), "all inputs must have y's dtype");
  at::Tensor dy = at::empty({R, 3 * HK}, y.options()), df = at::empty({R, HK}, y.options()),
             db = at::empty({R, H}, y.options());
  const int64_t blocks = (R + kRowBlock - 1) / kRowBlock;
  at::Tensor partial = at::zeros({blocks, H}, y.options());
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "kda_features_backward", [&] {
    using T = scalar_t;
    const T *yp = y.data_ptr<T>(), *fp = f.data_ptr<T>(), *betap = beta.data_ptr<T>(), *ap = a.data_ptr<T>(),
            *rp = rescale.data_ptr<T>(), *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>(),
            *dgp = dg.data_ptr<T>(), *dbetap = dbeta.data_ptr<T>();
    T *dyp = dy.data_ptr<T>(), *dfp = df.data_ptr<T>(), *dbp = db.data_ptr<T>(), *pp = partial.data_ptr<T>();
    const T l = static_cast<T>(lb);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk)
        for (int64_t r = blk * kRowBlock; r < std::min(R, (blk + 1) * kRowBlock); ++r)
          features_row_backward<T>(dqp + r * HK, dkp + r * HK, dvp + r * HK, dgp + r * HK, dbetap + r * H,
                                   yp + r * 3 * HK, fp + r * HK, betap + r * H, ap, rp, l, H, K, dyp + r * 3 * HK,
                                   dfp + r * HK, dbp + r * H, pp + blk * H);
    });
  });
  // dA_log = a * (the blocks' partial sums, added in block order)
  return {dy, df, db, partial.sum(0) * a};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("kda_features(Tensor y, Tensor f, Tensor b, Tensor a, Tensor rescale, float lb) -> (Tensor, Tensor, Tensor)");
  m.def("kda_features_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor y, Tensor f, "
        "Tensor beta, Tensor a, Tensor rescale, float lb) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("kda_features", &kda_features);
  m.impl("kda_features_backward", &kda_features_backward);
}
