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
using glm_lightning_ops::kMaxStreams;

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

// The linked write's part of the backward for one token (with g [n, C] the write's output gradient): gres = g x^T
// into gr [n, n]. The same sums in the same order as the stream write's backward (csrc/streams.cpp,
// write_backward_token): kLanes partial sums per entry, reduced kLanes entries at a time (Lanes::sums16) when n^2 is
// a multiple of kLanes, else one Lanes::sum each, then the channels past the last full vector.
template <typename T, int NS>
inline void write_res_grad(const T* __restrict g, const T* __restrict x, T* __restrict gr, int64_t n_rt, int64_t C) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int kMax = NS > 0 ? NS : kMaxStreams;
  const int64_t n = NS > 0 ? NS : n_rt;
  Vec s[kMax * kMax] = {}, gv[kMax];
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes) {
    for (int64_t i = 0; i < n; ++i) gv[i] = L::load(g + i * C + c);
    for (int64_t j = 0; j < n; ++j) {
      const Vec xv = L::load(x + j * C + c);
      for (int64_t i = 0; i < n; ++i) s[i * n + j] += gv[i] * xv;
    }
  }
  if constexpr (NS > 0 && NS * NS % kLanes == 0) {
    for (int k = 0; k < NS * NS; k += kLanes) L::store(gr + k, L::sums16(s + k));
  } else {
    for (int64_t k = 0; k < n * n; ++k) gr[k] = L::sum(s[k]);
  }
  for (; c < C; ++c)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) gr[i * n + j] += g[i * C + c] * x[j * C + c];
}

// dx [n, C] += res^T g for one token: the linked write's gradient of the streams (gx_j = sum_i res_ij g_i, summed as
// write_backward_token sums it), added where the unlinked form added the write's gx (dx_acc).
template <typename T, int NS>
inline void add_write_streams_grad(const T* __restrict g, const T* __restrict r, T* __restrict dx, int64_t n_rt,
                                   int64_t C) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int kMax = NS > 0 ? NS : kMaxStreams;
  const int64_t n = NS > 0 ? NS : n_rt;
  Vec gv[kMax];
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes) {
    for (int64_t i = 0; i < n; ++i) gv[i] = L::load(g + i * C + c);
    for (int64_t j = 0; j < n; ++j) {
      Vec a = {};
      for (int64_t i = 0; i < n; ++i) a += r[i * n + j] * gv[i];
      L::store(dx + j * C + c, L::load(dx + j * C + c) + a);
    }
  }
  for (; c < C; ++c)
    for (int64_t j = 0; j < n; ++j) {
      T a = 0;
      for (int64_t i = 0; i < n; ++i) a += r[i * n + j] * g[i * C + c];
      dx[j * C + c] += a;
    }
}

// Calls fn.template operator()<NS>() with NS = n for 2 and 4 streams, else NS = 0 (n at run time).
template <typename F>
void with_stream_count_sr(int64_t n, F&& fn) {
  if (n == 4) return fn.template operator()<4>();
  if (n == 2) return fn.template operator()<2>();
  return fn.template operator()<0>();
}

constexpr int64_t kSiteChunk = 64;  // tokens per chunk of the linked backward: their g and x stay in L2 between passes

// The inputs of the site read's backward as pointers. Unlinked: dres is the gradient of the Sinkhorn logits and acc
// (may be null) the write's gradient of the streams. Linked (g not null): g is the write's output gradient; the
// write's gradient of H_res (g x^T, plus dres_h, the other consumers' gradient of H_res, when not null) goes through
// the Sinkhorn backward here, chunk by chunk, and res^T g joins dx in the pass that adds acc in the unlinked form.
template <typename T>
struct SiteGrads {
  const T *x, *phi, *alpha_e, *scale, *inv, *raw, *sig, *gates, *dh, *dpost;
  const T* dres;                // unlinked: dL/d(res logits) [N, n, n]
  const T* acc;                 // unlinked: the streams' other gradient [N, n, C], or null
  const T *g, *dres_h, *res, *soft;  // linked: the write's output gradient [N, n, C] ...
  int64_t iters;
  T eps;
};

// One token's logit gradients: the gates' (l < 2n) through their sigmoids from dh . x_l or dpost, the res logits'
// (l >= 2n) from drp; dbias and dalpha accumulate, dr [L] receives dz_l r. Returns sum_l dz_l raw_l, the RMS norm's
// term of dx. Both backward forms call it, so they sum in the same order.
template <typename T>
inline T token_logit_grads(const SiteGrads<T>& a, int64_t t, int64_t n, int64_t C, const T* drp, T* __restrict dbias,
                           T* __restrict dalpha, T* __restrict dr) {
  const int64_t nC = n * C, L = n * n + 2 * n, nn = n * n;
  const T* xt = a.x + t * nC;
  const T* dht = a.dh + t * C;
  const T r = a.inv[t];
  T dz_raw = 0;
  for (int64_t l = 0; l < L; ++l) {
    T dlogit;
    if (l < 2 * n) {
      const T dg = l < n ? dot(dht, xt + l * C, C) : a.dpost[t * n + l - n];
      const T s = a.sig[t * 2 * n + l];
      dlogit = dg * a.scale[l] * (s - s * s);
    } else {
      dlogit = drp[t * nn + l - 2 * n];
    }
    const T rw = a.raw[t * L + l];
    dbias[l] += dlogit;
    dalpha[l] += dlogit * rw * r;
    const T dz = dlogit * a.alpha_e[l];
    dz_raw += dz * rw;
    dr[l] = dz * r;
  }
  return dz_raw;
}

// A linked read's gradient of the res logits for tokens [u0, u1) of a chunk (at most kSiteChunk): the write's gradient
// of H_res (g x^T, plus dres_h, the other consumers', when given) into buf [kSiteChunk, n, n], then through the
// Sinkhorn backward into buf's second half; returned indexed by the global token, as SiteGrads::dres is.
template <typename T, int NS>
inline const T* linked_res_grads(const SiteGrads<T>& a, int64_t u0, int64_t u1, int64_t n, int64_t C, T* buf) {
  const int64_t nC = n * C, nn = n * n;
  T *gres = buf, *dlog = buf + kSiteChunk * nn;
  for (int64_t t = u0; t < u1; ++t) {
    T* gr = gres + (t - u0) * nn;
    write_res_grad<T, NS>(a.g + t * nC, a.x + t * nC, gr, n, C);
    if (a.dres_h != nullptr)
      for (int64_t k = 0; k < nn; ++k) gr[k] += a.dres_h[t * nn + k];
  }
  glm_lightning_ops::sinkhorn_backward_tokens<T>(gres, nn, a.soft + u0 * nn, nn, u1 - u0, n, a.iters, a.eps, dlog);
  return dlog - u0 * nn;
}

template <typename T, int NS>
void backward_core(const SiteGrads<T>& a, int64_t N, int64_t n, int64_t C, T* dxp, T* dphi_all, T* dsum_all) {
  const int64_t nC = n * C, L = n * n + 2 * n, nn = n * n;
  const bool linked = a.g != nullptr;
  at::parallel_for(0, (N + kSiteChunk - 1) / kSiteChunk, 1, [&](int64_t c0, int64_t c1) {
    const int tid = at::get_thread_num();
    T* dphi = dphi_all + tid * L * nC;
    T* dbias = dsum_all + tid * 2 * L;
    T* dalpha = dbias + L;
    T draw[kSiteBlock * 64];  // [TB, L], L <= 64 (n <= 7)
    std::vector<T> dres_buf(linked ? 2 * kSiteChunk * nn : 0);
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t u0 = chunk * kSiteChunk, u1 = std::min(N, u0 + kSiteChunk);
      // the logits' gradient, indexed by the global token
      const T* drp = linked ? linked_res_grads<T, NS>(a, u0, u1, n, C, dres_buf.data()) : a.dres;
      for (int64_t t0 = u0; t0 < u1; t0 += kSiteBlock) {
        const int64_t t1 = std::min(u1, t0 + kSiteBlock), nt = t1 - t0;
        for (int64_t t = t0; t < t1; ++t) {
          const T* xt = a.x + t * nC;
          const T* dht = a.dh + t * C;
          if (t + kSiteBlock < N) prefetch(xt + kSiteBlock * nC, nC), prefetch(dht + kSiteBlock * C, C);
          const T r = a.inv[t];
          const T dz_raw = token_logit_grads(a, t, n, C, drp, dbias, dalpha, draw + (t - t0) * L);
          const T coef = dz_raw * r * r * r / static_cast<T>(nC);
          T* dxt = dxp + t * nC;
          for (int64_t i = 0; i < n; ++i) {  // H_pre[i] dh - coef x_i
            const T w = a.gates[t * 2 * n + i];
            for (int64_t c = 0; c < C; ++c) dxt[i * C + c] = w * dht[c] - coef * xt[i * C + c];
          }
        }
        // dx += draw phi and dphi += draw^T x over the block, kLanes channels at a time; a full block has a
        // compile-time token count, so its kSiteBlock x kLanes accumulators stay in registers
        if (nt == kSiteBlock)
          draw_products<T, kSiteBlock>(draw, a.phi, a.x + t0 * nC, dxp + t0 * nC, dphi, L, nC);
        else
          draw_products<T, 0>(draw, a.phi, a.x + t0 * nC, dxp + t0 * nC, dphi, L, nC, nt);
        if (linked)  // the block's dx and g are still in cache
          for (int64_t t = t0; t < t1; ++t)
            add_write_streams_grad<T, NS>(a.g + t * nC, a.res + t * nn, dxp + t * nC, n, C);
        else if (a.acc != nullptr)
          for (int64_t k = t0 * nC; k < t1 * nC; ++k) dxp[k] += a.acc[k];
      }
    }
  });
}

// dphi [L, nC] += draw [nt, L]^T x [nt, nC] over a chunk of nt tokens, in register tiles of 4 rows x 4 vectors of
// channels: each dphi vector is loaded and stored once per chunk (draw_products did it once per block of kSiteBlock
// tokens, 2 loads per 2 FMAs), 8 loads per 16 FMAs. Each entry sums the tokens in order, from its old value, as
// draw_products did: the same values bit for bit. nC is a multiple of kLanes here.
template <typename T>
inline void dphi_chunk(const T* __restrict draw, const T* __restrict x, T* __restrict dphi, int64_t nt, int64_t L,
                       int64_t nC) {
  using Vec = typename Lanes<T>::Vec;
  constexpr auto load = Lanes<T>::load;
  constexpr auto store = Lanes<T>::store;
  constexpr int R = 4, V = 4;
  int64_t l = 0;
  for (; l + R <= L; l += R) {
    int64_t c = 0;
    for (; c + V * kLanes <= nC; c += V * kLanes) {
      Vec a[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) a[r][v] = load(dphi + (l + r) * nC + c + v * kLanes);
      for (int64_t t = 0; t < nt; ++t) {
        Vec xv[V];
        for (int v = 0; v < V; ++v) xv[v] = load(x + t * nC + c + v * kLanes);
        for (int r = 0; r < R; ++r) {
          const T s = draw[t * L + l + r];
          for (int v = 0; v < V; ++v) a[r][v] += s * xv[v];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) store(dphi + (l + r) * nC + c + v * kLanes, a[r][v]);
    }
    for (; c < nC; c += kLanes)
      for (int r = 0; r < R; ++r) {
        Vec g = load(dphi + (l + r) * nC + c);
        for (int64_t t = 0; t < nt; ++t) g += draw[t * L + l + r] * load(x + t * nC + c);
        store(dphi + (l + r) * nC + c, g);
      }
  }
  for (; l < L; ++l)
    for (int64_t c = 0; c < nC; c += kLanes) {
      Vec g = load(dphi + l * nC + c);
      for (int64_t t = 0; t < nt; ++t) g += draw[t * L + l] * load(x + t * nC + c);
      store(dphi + l * nC + c, g);
    }
}

// dx of a block of tokens (NT > 0: exactly NT, else nt <= kSiteBlock), each kLanes channels formed in registers and
// stored once (past the cache where `streaming`: 12.6 MB per flash-25m site that the previous block's backward reads
// much later; 1.16x the linked backward, Intel Xeon, 1 thread): H_pre[i] dh - coef x_i, + draw phi (rows in order),
// then + res^T g (linked) or + acc (the streams' other gradient), in backward_core's order (its dx passes: the init,
// draw_products, the write's add), so the same values.
// C is a multiple of kLanes here, so a vector of channels lies in one stream.
// dx_block's tile: the block's tokens x V vectors of channels from c (in stream i), V phi loads and NT broadcasts per
// NT x V FMAs (V = 2: 10 loads per 16 FMAs; one vector was 9 per 8, bound by the loads).
template <typename T, int NT, int NS, int V>
[[gnu::always_inline]] inline void dx_tile(const SiteGrads<T>& a, const T* __restrict draw, const T* __restrict coef,
                                           int64_t t0, int64_t nt_rt, int64_t n_rt, int64_t C, int64_t i, int64_t c,
                                           T* __restrict dxp, bool streaming) {
  using Lv = Lanes<T>;
  using Vec = typename Lv::Vec;
  constexpr int kMax = NT > 0 ? NT : kSiteBlock;
  const int64_t nt = NT > 0 ? NT : nt_rt, n = NS > 0 ? NS : n_rt, nC = n * C, L = n * n + 2 * n, nn = n * n;
  if (nt > kMax) __builtin_unreachable();  // (a partial block: GCC warned of stores past acc otherwise)
  Vec acc[kMax][V];
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t tok = t0 + t;
    const T w = a.gates[tok * 2 * n + i], k = coef[t];
    for (int v = 0; v < V; ++v)
      acc[t][v] = w * Lv::load(a.dh + tok * C + c - i * C + v * kLanes) -
                  k * Lv::load(a.x + tok * nC + c + v * kLanes);
  }
  for (int64_t l = 0; l < L; ++l) {
    Vec p[V];
    for (int v = 0; v < V; ++v) p[v] = Lv::load(a.phi + l * nC + c + v * kLanes);
    for (int64_t t = 0; t < nt; ++t) {
      const T d = draw[t * L + l];
      for (int v = 0; v < V; ++v) acc[t][v] += d * p[v];
    }
  }
  if (a.g != nullptr) {
#pragma GCC unroll 8
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t tok = t0 + t;
      const T* r = a.res + tok * nn;
      for (int v = 0; v < V; ++v) {
        Vec s = {};
        for (int64_t j = 0; j < n; ++j) s += r[j * n + i] * Lv::load(a.g + tok * nC + j * C + c - i * C + v * kLanes);
        acc[t][v] = acc[t][v] + s;
      }
    }
  } else if (a.acc != nullptr) {
#pragma GCC unroll 8
    for (int64_t t = 0; t < nt; ++t)
      for (int v = 0; v < V; ++v) acc[t][v] = acc[t][v] + Lv::load(a.acc + (t0 + t) * nC + c + v * kLanes);
  }
#pragma GCC unroll 8
  for (int64_t t = 0; t < nt; ++t)
    for (int v = 0; v < V; ++v) {
      T* out = dxp + (t0 + t) * nC + c + v * kLanes;
      if (streaming)
        glm_lightning_ops::store_streaming<T>(out, acc[t][v]);
      else
        Lv::store(out, acc[t][v]);
    }
}

template <typename T, int NT, int NS>
inline void dx_block(const SiteGrads<T>& a, const T* __restrict draw, const T* __restrict coef, int64_t t0, int64_t nt_rt,
                     int64_t n_rt, int64_t C, T* __restrict dxp, bool streaming) {
  const int64_t n = NS > 0 ? NS : n_rt;
  constexpr int64_t kPair = 2 * kLanes;
  for (int64_t i = 0; i < n; ++i) {
    int64_t c = i * C;
    for (; c + kPair <= (i + 1) * C; c += kPair)
      dx_tile<T, NT, NS, 2>(a, draw, coef, t0, nt_rt, n, C, i, c, dxp, streaming);
    for (; c < (i + 1) * C; c += kLanes) dx_tile<T, NT, NS, 1>(a, draw, coef, t0, nt_rt, n, C, i, c, dxp, streaming);
  }
}

// backward_core in phases over each chunk of kSiteChunk tokens (their x, g, dh and dx stay in L2): the write's H_res
// gradient and the gate dots (one pass over x and g), the Sinkhorn backward, the per-token scalars (draw, coef, the
// bias and alpha sums), then dphi (dphi_chunk) and dx (dx_block, written once). backward_core passed over each block's
// dx three times and loaded each dphi vector per block of kSiteBlock tokens. The same arithmetic in the same order.
template <typename T, int NS>
void backward_chunked(const SiteGrads<T>& a, int64_t N, int64_t n_rt, int64_t C, T* dxp, T* dphi_all, T* dsum_all) {
  const int64_t n = NS > 0 ? NS : n_rt, nC = n * C, L = n * n + 2 * n, nn = n * n;
  const bool linked = a.g != nullptr, streaming = glm_lightning_ops::streaming_output(dxp, N * nC);
  at::parallel_for(0, (N + kSiteChunk - 1) / kSiteChunk, 1, [&](int64_t c0, int64_t c1) {
    const int tid = at::get_thread_num();
    T* dphi = dphi_all + tid * L * nC;
    T* dbias = dsum_all + tid * 2 * L;
    T* dalpha = dbias + L;
    std::vector<T> buf(kSiteChunk * (64 + 1) + (linked ? 2 * kSiteChunk * nn : 0));  // L <= 64
    T *draw = buf.data(), *coef = draw + kSiteChunk * 64;
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t u0 = chunk * kSiteChunk, u1 = std::min(N, u0 + kSiteChunk), nt = u1 - u0;
      const T* drp = linked ? linked_res_grads<T, NS>(a, u0, u1, n, C, coef + kSiteChunk) : a.dres;
      for (int64_t t = u0; t < u1; ++t) {
        const T* xt = a.x + t * nC;
        const T* dht = a.dh + t * C;
        if (!linked && t + kSiteBlock < N) prefetch(xt + kSiteBlock * nC, nC);
        if (t + kSiteBlock < N) prefetch(dht + kSiteBlock * C, C);
        const T r = a.inv[t];
        const T dz_raw = token_logit_grads(a, t, n, C, drp, dbias, dalpha, draw + (t - u0) * L);
        coef[t - u0] = dz_raw * r * r * r / static_cast<T>(nC);
      }
      dphi_chunk<T>(draw, a.x + u0 * nC, dphi, nt, L, nC);
      for (int64_t t0 = u0; t0 < u1; t0 += kSiteBlock) {
        const int64_t bt = std::min(u1, t0 + kSiteBlock) - t0;
        if (bt == kSiteBlock)
          dx_block<T, kSiteBlock, NS>(a, draw + (t0 - u0) * L, coef + (t0 - u0), t0, bt, n, C, dxp, streaming);
        else
          dx_block<T, 0, NS>(a, draw + (t0 - u0) * L, coef + (t0 - u0), t0, bt, n, C, dxp, streaming);
      }
    }
    glm_lightning_ops::streaming_done();
  });
}

// The checks and outputs shared by both backward ops; fn(SiteGrads<T>&) fills in the mode's pointers.
template <typename Fill>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_backward(
    const at::Tensor& dh_in, const at::Tensor& dpost_in, const at::Tensor& x, const at::Tensor& phi,
    const at::Tensor& alpha_e_in, const at::Tensor& scale_in, const at::Tensor& inv, const at::Tensor& raw,
    const at::Tensor& sig, const at::Tensor& gates, Fill&& fill) {
  check_site(x, phi);
  const int64_t N = x.size(0), n = x.size(1), C = x.size(2), nC = n * C, L = n * n + 2 * n;
  const auto dt = x.scalar_type();
  const at::Tensor dh = dh_in.to(dt).contiguous(), dpost = dpost_in.to(dt).contiguous(),
                   alpha_e = alpha_e_in.to(dt).contiguous(), scale = scale_in.to(dt).contiguous();
  TORCH_CHECK(dh.numel() == N * C && dpost.numel() == N * n, "gradient shapes");
  TORCH_CHECK(inv.numel() == N && raw.numel() == N * L && sig.numel() == N * 2 * n && gates.numel() == N * 2 * n &&
                  inv.is_contiguous() && raw.is_contiguous() && sig.is_contiguous() && gates.is_contiguous(),
              "saved tensors of site_read");
  const int threads = at::get_num_threads();
  at::Tensor dx = at::empty({N, n, C}, x.options());
  at::Tensor dphi_t = at::zeros({threads, L, nC}, x.options()), dsum_t = at::zeros({threads, 2, L}, x.options());
  AT_DISPATCH_FLOATING_TYPES(dt, "site_read_backward", [&] {
    using T = scalar_t;
    SiteGrads<T> a{x.data_ptr<T>(), phi.data_ptr<T>(), alpha_e.data_ptr<T>(), scale.data_ptr<T>(), inv.data_ptr<T>(),
                   raw.data_ptr<T>(), sig.data_ptr<T>(), gates.data_ptr<T>(), dh.data_ptr<T>(), dpost.data_ptr<T>(),
                   nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, T(0)};
    std::vector<at::Tensor> keep;  // converted inputs, alive through the call
    fill(a, keep, N, n, C);
    with_stream_count_sr(n, [&]<int NS>() {
      if (C % kLanes == 0)
        backward_chunked<T, NS>(a, N, n, C, dx.data_ptr<T>(), dphi_t.data_ptr<T>(), dsum_t.data_ptr<T>());
      else
        backward_core<T, NS>(a, N, n, C, dx.data_ptr<T>(), dphi_t.data_ptr<T>(), dsum_t.data_ptr<T>());
    });
  });
  at::Tensor sums = dsum_t.sum(0);
  return {dx, dphi_t.sum(0), sums[0], sums[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_read_backward(
    const at::Tensor& dh, const at::Tensor& dpost, const at::Tensor& dres_in, const at::Tensor& x,
    const at::Tensor& phi, const at::Tensor& alpha_e, const at::Tensor& scale, const at::Tensor& inv,
    const at::Tensor& raw, const at::Tensor& sig, const at::Tensor& gates, const std::optional<at::Tensor>& acc_in) {
  return site_backward(dh, dpost, x, phi, alpha_e, scale, inv, raw, sig, gates,
                       [&]<typename T>(SiteGrads<T>& a, std::vector<at::Tensor>& keep, int64_t N, int64_t n,
                                       int64_t C) {
    const at::Tensor dres = dres_in.to(x.scalar_type()).contiguous();
    TORCH_CHECK(dres.numel() == N * n * n, "gradient shapes");
    keep.push_back(dres);
    a.dres = dres.data_ptr<T>();
    if (acc_in.has_value()) {
      const at::Tensor acc = acc_in->to(x.scalar_type()).contiguous();
      TORCH_CHECK(acc.numel() == N * n * C, "dx_acc must be shaped as x");
      keep.push_back(acc);
      a.acc = acc.data_ptr<T>();
    }
  });
}

// The linked form (glm_lightning/model/ops/mhc.py, _StreamWriteLinked): g the write's output gradient (None: the
// write's output took none), res / soft the Sinkhorn output and row softmax of the forward, dres_h the gradient of
// H_res from consumers other than the linked write (None when there are none).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_read_backward_linked(
    const at::Tensor& dh, const at::Tensor& dpost, const std::optional<at::Tensor>& dres_h,
    const std::optional<at::Tensor>& g, const at::Tensor& res, const at::Tensor& soft, int64_t iters, double eps,
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha_e, const at::Tensor& scale,
    const at::Tensor& inv, const at::Tensor& raw, const at::Tensor& sig, const at::Tensor& gates) {
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  return site_backward(dh, dpost, x, phi, alpha_e, scale, inv, raw, sig, gates,
                       [&]<typename T>(SiteGrads<T>& a, std::vector<at::Tensor>& keep, int64_t N, int64_t n,
                                       int64_t C) {
    const auto dt = x.scalar_type();
    const auto dense = [&](const at::Tensor& t, int64_t numel, const char* name) -> const T* {
      const at::Tensor c = t.to(dt).contiguous();
      TORCH_CHECK(c.numel() == numel, name, ": wrong size");
      keep.push_back(c);
      return c.data_ptr<T>();
    };
    a.res = dense(res, N * n * n, "res");
    a.soft = dense(soft, N * n * n, "soft");
    a.iters = iters;
    a.eps = static_cast<T>(eps);
    if (dres_h.has_value()) a.dres_h = dense(*dres_h, N * n * n, "dres");
    if (g.has_value()) {
      a.g = dense(*g, N * n * C, "g");
    } else {  // no write gradient: H_res's gradient is the other consumers' alone, through the Sinkhorn backward
      at::Tensor d = at::empty({N, n, n}, x.options());
      if (dres_h.has_value())
        glm_lightning_ops::sinkhorn_backward_tokens<T>(a.dres_h, n * n, a.soft, n * n, N, n, iters, a.eps,
                                                       d.data_ptr<T>());
      else
        d.zero_();
      keep.push_back(d);
      a.dres = d.data_ptr<T>();
    }
  });
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
  m.def("site_read_backward_linked(Tensor dh, Tensor dpost, Tensor? dres, Tensor? g, Tensor res, Tensor softmax, "
        "int iters, float eps, Tensor x, Tensor phi, Tensor alpha_e, Tensor scale, Tensor inv_rms, Tensor raw, "
        "Tensor sig, Tensor gates) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("site_read_decode(Tensor x, Tensor phi, Tensor alpha, Tensor alpha_index, Tensor bias, Tensor scale, "
        "Tensor shift, float norm_eps, int iters, float eps) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("site_read", &site_read);
  m.impl("site_read_backward", &site_read_backward);
  m.impl("site_read_backward_linked", &site_read_backward_linked);
  m.impl("site_read_decode", &site_read_decode);
}
