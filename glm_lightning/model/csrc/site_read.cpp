// The read half of an mHC site (glm_lightning/model/mhc.py, SiteReadFused) as two CPU ops that each stream the
// site's input once: the streams x [N, n, C] (4 x 192 floats per token for flash-25m) were read three times by the
// forward (norm, projection, read) and about ten times by the backward (read backward, the projection's two GEMMs,
// the norm's correction, the sums), and those passes were most of the site's time.
//
// Forward, per token (flat = x as one nC row, L = n^2 + 2n logits):
//   inv_rms = (eps + |flat|^2 / nC)^-1/2,  raw = phi flat,  z = raw inv_rms,  logits = bias + alpha_e z,
//   sig = sigmoid(logits[:2n]),  gates = shift + scale sig (H_pre | H_post),  h = sum_i H_pre[i] x_i;
//   the n^2 residual logits go to Sinkhorn (its own op, glm_lightning::sinkhorn).
// Backward, with dlogits = [dgates scale sig (1 - sig) | dres_logits] (dgates = [<dh, x_i> | dpost]):
//   dz = dlogits alpha_e,  draw = dz inv_rms,  coef = inv_rms^3 / nC sum(dz raw),
//   dx_i = H_pre[i] dh + (phi^T draw)_i - coef x_i,  dphi = sum_t draw flat^T,
//   dbias = sum_t dlogits,  dalpha_l = sum_t dlogits z  (per logit; mhc.py sums them per alpha).
// Tokens are processed in blocks of TB so that each phi row is loaded once per block, not once per token.
//
//   site_read(x, phi, alpha_e, bias, scale, shift, norm_eps) -> (h [N, C], gates [N, 2n], res_logits [N, n, n],
//                                                                inv_rms [N], raw [N, L], sig [N, 2n])
//   site_read_backward(dh, dpost, dres_logits, x, phi, alpha_e, scale, inv_rms, raw, sig, gates, dx_acc=None)
//       -> (dx [N, n, C], dphi [L, nC], dbias [L], dalpha_l [L])
//          dx_acc [N, n, C]: the streams' other gradient (the site write's, which takes x too), added to dx block by
//          block while it is in cache: one pass over the streams instead of autograd's separate add (dx_acc + dx)
//   site_read_decode(x, phi, alpha, alpha_index, bias, scale, shift, norm_eps, iters, eps)
//       -> (h [..., C], H_post [..., n], H_res [..., n, n])   a decode step's whole read half (x [..., n, C]),
//          Sinkhorn included
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"
#include "sinkhorn.h"

namespace {

constexpr int64_t kSiteBlock = 8;  // tokens per block (TB)
using glm_lightning_ops::kLanes;
using glm_lightning_ops::Lanes;

// sum_c a[c] b[c] as kLanes partial sums
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t len) {
  using L = Lanes<T>;
  typename L::Vec acc = {};
  int64_t c = 0;
  for (; c + kLanes <= len; c += kLanes) acc += L::load(a + c) * L::load(b + c);
  T s = L::sum(acc);
  for (; c < len; ++c) s += a[c] * b[c];
  return s;
}

// The len values from p into the cache ahead of their use: the next block's streams, while this block computes.
template <typename T>
inline void prefetch(const T* p, int64_t len) {
  for (int64_t k = 0; k < len; k += 64 / sizeof(T)) __builtin_prefetch(p + k);
}

// raw [NT, L] = x [NT, nC] phi [L, nC]^T for a full block, in register tiles of 4 phi rows x 4 tokens: each x and phi
// vector is loaded once per tile, 8 loads per 16 FMAs (tiles of 2 rows x 8 tokens, 10 loads per 16 FMAs and the x
// loads repeated per row, made this the site read's largest part). The 16 partial sums of a tile are reduced at once
// (Lanes::sums16, bit for bit as one sum each): the same values as one dot product per (token, row).
template <typename T, int NT>
inline void project(const T* __restrict x, const T* __restrict phi, T* __restrict raw, int64_t L, int64_t nC) {
  using Vec = typename Lanes<T>::Vec;
  constexpr auto load = Lanes<T>::load;
  constexpr int R = 4, TT = 4;
  static_assert(NT % TT == 0, "whole tiles of tokens");
  const int64_t full = nC / kLanes * kLanes;
  int64_t l = 0;
  for (; l + R <= L; l += R)
    for (int t0 = 0; t0 < NT; t0 += TT) {
      Vec a[R * TT] = {};
      for (int64_t c = 0; c < full; c += kLanes) {
        Vec q[R];
        for (int r = 0; r < R; ++r) q[r] = load(phi + (l + r) * nC + c);
        for (int t = 0; t < TT; ++t) {
          const Vec xv = load(x + (t0 + t) * nC + c);
          for (int r = 0; r < R; ++r) a[t * R + r] += xv * q[r];
        }
      }
      alignas(64) T sums[R * TT];
      for (int k = 0; k < R * TT; k += kLanes) Lanes<T>::store(sums + k, Lanes<T>::sums16(a + k));
      for (int t = 0; t < TT; ++t)
        for (int r = 0; r < R; ++r) {
          T v = sums[t * R + r];
          for (int64_t c = full; c < nC; ++c) v += x[(t0 + t) * nC + c] * phi[(l + r) * nC + c];
          raw[(t0 + t) * L + l + r] = v;
        }
    }
  for (; l < L; ++l)
    for (int t = 0; t < NT; ++t) raw[t * L + l] = dot(x + t * nC, phi + l * nC, nC);
}

// Over a block of nt tokens (NT > 0: exactly NT, known at compile time): dx [nt, nC] += draw [nt, L] phi [L, nC] and
// dphi [L, nC] += draw^T x [nt, nC], kLanes channels at a time.
template <typename T, int NT>
inline void draw_products(const T* __restrict draw, const T* __restrict phi, const T* __restrict x, T* __restrict dx,
                          T* __restrict dphi, int64_t L, int64_t nC, int64_t nt = NT) {
  int64_t c0 = 0;
  if constexpr (NT > 0) {
    // explicit vectors: left to itself the compiler vectorised over the tokens (gathers), 10x slower
    using Vec = typename Lanes<T>::Vec;
    constexpr auto load = Lanes<T>::load;
    constexpr auto store = Lanes<T>::store;
    for (; c0 + kLanes <= nC; c0 += kLanes) {
      Vec acc[NT];
      for (int t = 0; t < NT; ++t) acc[t] = load(dx + t * nC + c0);
      for (int64_t l = 0; l < L; ++l) {
        const Vec p = load(phi + l * nC + c0);
        Vec g = load(dphi + l * nC + c0);
        for (int t = 0; t < NT; ++t) {
          const T a = draw[t * L + l];
          acc[t] += a * p;
          g += a * load(x + t * nC + c0);
        }
        store(dphi + l * nC + c0, g);
      }
      for (int t = 0; t < NT; ++t) store(dx + t * nC + c0, acc[t]);
    }
  }
  for (int64_t l = 0; l < L; ++l)  // the rest: a partial block, or channels past the last full kLanes
    for (int64_t t = 0; t < nt; ++t) {
      const T a = draw[t * L + l];
      for (int64_t c = c0; c < nC; ++c) {
        dx[t * nC + c] += a * phi[l * nC + c];
        dphi[l * nC + c] += a * x[t * nC + c];
      }
    }
}

void check_phi(const at::Tensor& phi, int64_t n, int64_t nC, at::ScalarType dt) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(phi.dim() == 2 && phi.size(0) == n * n + 2 * n && phi.size(1) == nC && phi.is_contiguous(),
              "phi must be a contiguous [n^2 + 2n, nC]");
  TORCH_CHECK(n * n + 2 * n <= 64, "site_read: at most 6 streams");
  TORCH_CHECK(phi.scalar_type() == dt, "phi must have x's dtype");
}

void check_site(const at::Tensor& x, const at::Tensor& phi) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous [N, n, C]");
  check_phi(phi, x.size(1), x.size(1) * x.size(2), x.scalar_type());
}

// The forward over N tokens into raw pointers (the outputs of site_read; the decode op passes scratch for the ones
// only the backward reads): h [N, C], gates [N, 2n], res logits [N, n, n], inv_rms [N], raw [N, L], sig [N, 2n].
template <typename T>
void site_read_forward(const T* xp, const T* pp, const T* ap, const T* bp, const T* sc, const T* sh, T eps, int64_t N,
                       int64_t n, int64_t C, T* hp, T* gp, T* rp, T* ip, T* rawp, T* sp) {
  const int64_t nC = n * C, L = n * n + 2 * n;
  at::parallel_for(0, (N + kSiteBlock - 1) / kSiteBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * kSiteBlock, t1 = std::min(N, t0 + kSiteBlock);
      if (t1 - t0 == kSiteBlock)  // each phi row once per block
        project<T, kSiteBlock>(xp + t0 * nC, pp, rawp + t0 * L, L, nC);
      else
        for (int64_t l = 0; l < L; ++l)
          for (int64_t t = t0; t < t1; ++t) rawp[t * L + l] = dot(xp + t * nC, pp + l * nC, nC);
      for (int64_t t = t0; t < t1; ++t) {
        const T* xt = xp + t * nC;
        if (t + kSiteBlock < N) prefetch(xt + kSiteBlock * nC, nC);
        const T ss = dot(xt, xt, nC);
        const T r = T(1) / std::sqrt(eps + ss / static_cast<T>(nC));
        ip[t] = r;
        for (int64_t l = 0; l < L; ++l) {
          const T logit = bp[l] + ap[l] * (rawp[t * L + l] * r);
          if (l < 2 * n) {
            const T s = T(1) / (T(1) + std::exp(-logit));
            sp[t * 2 * n + l] = s;
            gp[t * 2 * n + l] = sh[l] + s * sc[l];
          } else {
            rp[t * n * n + l - 2 * n] = logit;
          }
        }
        T* ht = hp + t * C;
        for (int64_t i = 0; i < n; ++i) {
          const T w = gp[t * 2 * n + i];
          const T* xi = xt + i * C;
          if (i == 0)
            for (int64_t c = 0; c < C; ++c) ht[c] = w * xi[c];
          else
            for (int64_t c = 0; c < C; ++c) ht[c] += w * xi[c];
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_read(
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha_e_in, const at::Tensor& bias_in,
    const at::Tensor& scale_in, const at::Tensor& shift_in, double norm_eps) {
  check_site(x, phi);
  const int64_t N = x.size(0), n = x.size(1), C = x.size(2), L = n * n + 2 * n;
  const auto dt = x.scalar_type();
  const at::Tensor alpha_e = alpha_e_in.to(dt).contiguous(), bias = bias_in.to(dt).contiguous(),
                   scale = scale_in.to(dt).contiguous(), shift = shift_in.to(dt).contiguous();
  TORCH_CHECK(alpha_e.numel() == L && bias.numel() == L && scale.numel() == 2 * n && shift.numel() == 2 * n,
              "alpha_e, bias: [n^2 + 2n]; scale, shift: [2n]");
  auto opt = x.options();
  at::Tensor h = at::empty({N, C}, opt), gates = at::empty({N, 2 * n}, opt), res = at::empty({N, n, n}, opt),
             inv = at::empty({N}, opt), raw = at::empty({N, L}, opt), sig = at::empty({N, 2 * n}, opt);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "site_read", [&] {
    using T = scalar_t;
    site_read_forward<T>(x.data_ptr<T>(), phi.data_ptr<T>(), alpha_e.data_ptr<T>(), bias.data_ptr<T>(),
                         scale.data_ptr<T>(), shift.data_ptr<T>(), static_cast<T>(norm_eps), N, n, C, h.data_ptr<T>(),
                         gates.data_ptr<T>(), res.data_ptr<T>(), inv.data_ptr<T>(), raw.data_ptr<T>(),
                         sig.data_ptr<T>());
  });
  return {h, gates, res, inv, raw, sig};
}

// A contiguous [len] parameter of dtype dt, checked rather than converted: a conversion is a dispatched op per call.
const at::Tensor& param(const at::Tensor& t, at::ScalarType dt, int64_t len, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.numel() == len, name, " must be a contiguous [", len,
              "] of x's dtype");
  return t;
}

// The read half of a site for a decode step (no autograd): site_read and Sinkhorn in one call, with alpha expanded per
// logit here (alpha[alpha_index]) and only (h [N, C], H_post [N, n], H_res [N, n, n]) allocated; the same arithmetic
// as the two ops, so the same values bit for bit. Why: the two ops with their Python around them were ~23 dispatched
// ops per site (expansion, six outputs, dtype conversions, slices), 24 sites per flash-25m step.
std::tuple<at::Tensor, at::Tensor, at::Tensor> site_read_decode(
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha, const at::Tensor& alpha_index,
    const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& shift, double norm_eps, int64_t iters,
    double eps) {
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous(), "x must be a contiguous [..., n, C]");
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const int64_t n = x.size(-2), C = x.size(-1), N = x.numel() / std::max<int64_t>(1, n * C), L = n * n + 2 * n;
  check_phi(phi, n, n * C, x.scalar_type());
  const auto dt = x.scalar_type();
  TORCH_CHECK(alpha.scalar_type() == dt && alpha.is_contiguous(), "alpha must be contiguous, of x's dtype");
  TORCH_CHECK(alpha_index.scalar_type() == at::kLong && alpha_index.is_contiguous() && alpha_index.numel() == L,
              "alpha_index must be a contiguous int64 [n^2 + 2n]");
  param(bias, dt, L, "bias");
  param(scale, dt, 2 * n, "scale");
  param(shift, dt, 2 * n, "shift");
  // the outputs shaped as the leading dims of x: no views to make in Python
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2), h_size = lead, post_size = lead, res_size = lead;
  h_size.push_back(C);
  post_size.push_back(n);
  res_size.insert(res_size.end(), {n, n});
  auto opt = x.options();
  at::Tensor h = at::empty(h_size, opt), post = at::empty(post_size, opt), res = at::empty(res_size, opt);
  AT_DISPATCH_FLOATING_TYPES(dt, "site_read_decode", [&] {
    using T = scalar_t;
    const int64_t* ix = alpha_index.data_ptr<int64_t>();
    const T* ap = alpha.data_ptr<T>();
    std::vector<T> alpha_e(L), scratch(N * (2 * n + n * n + 1 + L + 2 * n));
    for (int64_t l = 0; l < L; ++l) {
      TORCH_CHECK(ix[l] >= 0 && ix[l] < alpha.numel(), "alpha_index out of range");
      alpha_e[l] = ap[ix[l]];
    }
    T *gp = scratch.data(), *lp = gp + N * 2 * n, *ip = lp + N * n * n, *rawp = ip + N, *sp = rawp + N * L;
    site_read_forward<T>(x.data_ptr<T>(), phi.data_ptr<T>(), alpha_e.data(), bias.data_ptr<T>(), scale.data_ptr<T>(),
                         shift.data_ptr<T>(), static_cast<T>(norm_eps), N, n, C, h.data_ptr<T>(), gp, lp, ip, rawp,
                         sp);
    T* pp = post.data_ptr<T>();
    for (int64_t t = 0; t < N; ++t)
      for (int64_t i = 0; i < n; ++i) pp[t * n + i] = gp[t * 2 * n + n + i];
    glm_lightning_ops::sinkhorn_forward<T>(lp, n * n, N, n, iters, static_cast<T>(eps), res.data_ptr<T>(), nullptr);
  });
  return {h, post, res};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_read_backward(
    const at::Tensor& dh_in, const at::Tensor& dpost_in, const at::Tensor& dres_in, const at::Tensor& x,
    const at::Tensor& phi, const at::Tensor& alpha_e_in, const at::Tensor& scale_in, const at::Tensor& inv,
    const at::Tensor& raw, const at::Tensor& sig, const at::Tensor& gates, const std::optional<at::Tensor>& acc_in) {
  check_site(x, phi);
  const int64_t N = x.size(0), n = x.size(1), C = x.size(2), nC = n * C, L = n * n + 2 * n;
  const auto dt = x.scalar_type();
  const at::Tensor dh = dh_in.to(dt).contiguous(), dpost = dpost_in.to(dt).contiguous(),
                   dres = dres_in.to(dt).contiguous(), alpha_e = alpha_e_in.to(dt).contiguous(),
                   scale = scale_in.to(dt).contiguous();
  TORCH_CHECK(dh.numel() == N * C && dpost.numel() == N * n && dres.numel() == N * n * n, "gradient shapes");
  TORCH_CHECK(inv.numel() == N && raw.numel() == N * L && sig.numel() == N * 2 * n && gates.numel() == N * 2 * n &&
                  inv.is_contiguous() && raw.is_contiguous() && sig.is_contiguous() && gates.is_contiguous(),
              "saved tensors of site_read");
  const at::Tensor acc = acc_in.has_value() ? acc_in->to(dt).contiguous() : at::Tensor();
  TORCH_CHECK(!acc.defined() || acc.numel() == N * nC, "dx_acc must be shaped as x");
  const int threads = at::get_num_threads();
  at::Tensor dx = at::empty({N, n, C}, x.options());
  at::Tensor dphi_t = at::zeros({threads, L, nC}, x.options()), dsum_t = at::zeros({threads, 2, L}, x.options());
  AT_DISPATCH_FLOATING_TYPES(dt, "site_read_backward", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *pp = phi.data_ptr<T>(), *ap = alpha_e.data_ptr<T>(), *sc = scale.data_ptr<T>(),
            *ip = inv.data_ptr<T>(), *rawp = raw.data_ptr<T>(), *sp = sig.data_ptr<T>(), *gp = gates.data_ptr<T>(),
            *dhp = dh.data_ptr<T>(), *dpp = dpost.data_ptr<T>(), *drp = dres.data_ptr<T>();
    const T* accp = acc.defined() ? acc.data_ptr<T>() : nullptr;
    T *dxp = dx.data_ptr<T>(), *dphi_all = dphi_t.data_ptr<T>(), *dsum_all = dsum_t.data_ptr<T>();
    at::parallel_for(0, (N + kSiteBlock - 1) / kSiteBlock, 1, [&](int64_t b0, int64_t b1) {
      const int tid = at::get_thread_num();
      T* dphi = dphi_all + tid * L * nC;
      T* dbias = dsum_all + tid * 2 * L;
      T* dalpha = dbias + L;
      T draw[kSiteBlock * 64];  // [TB, L], L <= 64 (n <= 7)
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t t0 = blk * kSiteBlock, t1 = std::min(N, t0 + kSiteBlock), nt = t1 - t0;
        for (int64_t t = t0; t < t1; ++t) {
          const T* xt = xp + t * nC;
          const T* dht = dhp + t * C;
          if (t + kSiteBlock < N) prefetch(xt + kSiteBlock * nC, nC), prefetch(dht + kSiteBlock * C, C);
          const T r = ip[t];
          T dz_raw = 0;
          for (int64_t l = 0; l < L; ++l) {
            T dlogit;
            if (l < 2 * n) {
              const T dg = l < n ? dot(dht, xt + l * C, C) : dpp[t * n + l - n];
              const T s = sp[t * 2 * n + l];
              dlogit = dg * sc[l] * (s - s * s);
            } else {
              dlogit = drp[t * n * n + l - 2 * n];
            }
            const T rw = rawp[t * L + l];
            dbias[l] += dlogit;
            dalpha[l] += dlogit * rw * r;
            const T dz = dlogit * ap[l];
            dz_raw += dz * rw;
            draw[(t - t0) * L + l] = dz * r;
          }
          const T coef = dz_raw * r * r * r / static_cast<T>(nC);
          T* dxt = dxp + t * nC;
          for (int64_t i = 0; i < n; ++i) {  // H_pre[i] dh - coef x_i
            const T w = gp[t * 2 * n + i];
            for (int64_t c = 0; c < C; ++c) dxt[i * C + c] = w * dht[c] - coef * xt[i * C + c];
          }
        }
        // dx += draw phi and dphi += draw^T x over the block, kLanes channels at a time; a full block has a
        // compile-time token count, so its kSiteBlock x kLanes accumulators stay in registers
        if (nt == kSiteBlock)
          draw_products<T, kSiteBlock>(draw, pp, xp + t0 * nC, dxp + t0 * nC, dphi, L, nC);
        else
          draw_products<T, 0>(draw, pp, xp + t0 * nC, dxp + t0 * nC, dphi, L, nC, nt);
        if (accp != nullptr)  // the block's dx is still in L1
          for (int64_t k = t0 * nC; k < t1 * nC; ++k) dxp[k] += accp[k];
      }
    });
  });
  at::Tensor sums = dsum_t.sum(0);
  return {dx, dphi_t.sum(0), sums[0], sums[1]};
}

}  // namespace

namespace site_read_ops {  // block_decode.cpp calls it as a C++ function (no dispatch per call)
std::tuple<at::Tensor, at::Tensor, at::Tensor> site_read_decode(
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha, const at::Tensor& alpha_index,
    const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& shift, double norm_eps, int64_t iters,
    double eps) {
  return ::site_read_decode(x, phi, alpha, alpha_index, bias, scale, shift, norm_eps, iters, eps);
}
}  // namespace site_read_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("site_read(Tensor x, Tensor phi, Tensor alpha_e, Tensor bias, Tensor scale, Tensor shift, float norm_eps) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("site_read_backward(Tensor dh, Tensor dpost, Tensor dres_logits, Tensor x, Tensor phi, Tensor alpha_e, "
        "Tensor scale, Tensor inv_rms, Tensor raw, Tensor sig, Tensor gates, Tensor? dx_acc=None) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("site_read_decode(Tensor x, Tensor phi, Tensor alpha, Tensor alpha_index, Tensor bias, Tensor scale, "
        "Tensor shift, float norm_eps, int iters, float eps) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("site_read", &site_read);
  m.impl("site_read_backward", &site_read_backward);
  m.impl("site_read_decode", &site_read_decode);
}
