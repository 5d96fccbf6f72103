// The chunked (WY / UT) KDA core of glm_lightning/model/kda_chunk.py as two CPU ops, forward and backward, each one
// pass over the sequence: a (row, head) walks its chunks in order (backward: in reverse) and keeps every chunk-local
// matrix ([C, C], [C, K], [K, V]) in L1.
//
// Why: the eager form materialises ~20 chunk-major [chunks * B * H, C, K] tensors per direction (3 MB each for
// flash-25m at 32 x 128) and runs its products as batched 32 x 32 GEMMs that reach ~45% of the GEMM peak; half of
// its time was elementwise passes over memory. Here nothing but q, k, v, g, beta, dO and the chunk-start states
// (saved by the forward, [B*H, N+1, K, V]) touches memory; the backward recomputes the chunk's forward values.
//
// Math (same names as kda_chunk.py; per chunk, rows i, j < C; G = cumsum(g), ns row blocks of s rows, ref_a = G at
// block a's first row; e_row = exp(G_i - ref_a(i)), e_col[a] = exp(ref_a - G_j) for j before block a's end):
//   M = kr kcol^T (j < i),  Aqk = qr kcol^T (j <= i),  L = I + diag(beta) M,  UW = L^-1 diag(beta) [V | Gam K],
//   RP = (K dec)^T UW,  P = diag(Gam_C) - RP_K,  R = RP_V,  OQ = Aqk UW,  Q_eff = Gam Q - OQ_K,
//   O = OQ_V + Q_eff S_in,  S_out = P S_in + R.
// The backward is kda_chunk.py's, written per chunk (the triangular inverse as forward / back substitution).
//
//   kda_chunk_fwd(q, k, v, g, beta [B, T, H(, K)], S0 [B, H, K, V], C, ns) -> (o [B, T, H, V], S_all [B*H, N+1, K, V])
//   kda_chunk_bwd(dO, dS_last, q, k, v, g, beta, S_all, C, ns) -> (dq, dk, dv, dg, dbeta, dS0)
// q, k, v, g, beta, dO may be strided in their first three dimensions (views of fused projections); the last one is
// contiguous. fp32 and fp64 (for gradcheck); (K, V) in {16, 32, 64}^2 (same) and C in {16, 32, 64}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kernel_helpers.h"

namespace {

// out[:NC] (= or +=) sum_{p in [p0, p1)} a[p] * B[p, :NC] (row stride ldb). Four partial sums, so that 4 * NC / lanes
// independent FMA chains hide the FMA latency (one chain per vector register was latency-bound); they stay in
// registers (NC is a compile-time size).
template <typename T, int NC>
inline void row_gemm(T* __restrict out, const T* __restrict a, int p0, int p1, const T* __restrict B, int ldb,
                     bool accumulate) {
  T acc[4][NC];
  for (int u = 0; u < 4; ++u)
    for (int c = 0; c < NC; ++c) acc[u][c] = T(0);
  int p = p0;
  for (; p + 4 <= p1; p += 4)
    for (int u = 0; u < 4; ++u) {
      const T ap = a[p + u];
      const T* __restrict b = B + static_cast<int64_t>(p + u) * ldb;
      for (int c = 0; c < NC; ++c) acc[u][c] += ap * b[c];
    }
  for (; p < p1; ++p) {
    const T ap = a[p];
    const T* __restrict b = B + static_cast<int64_t>(p) * ldb;
    for (int c = 0; c < NC; ++c) acc[0][c] += ap * b[c];
  }
  for (int c = 0; c < NC; ++c) {
    const T sum = (acc[0][c] + acc[1][c]) + (acc[2][c] + acc[3][c]);
    out[c] = accumulate ? out[c] + sum : sum;
  }
}

using glm_lightning_ops::exp_;

// out [m, NC] (= or +=) A [m, kd] (row stride lda) @ B [kd, NC] (row stride ldb); out row stride ldo.
template <typename T, int NC>
inline void gemm(T* out, int ldo, const T* A, int lda, int m, int kd, const T* B, int ldb, bool accumulate) {
  for (int i = 0; i < m; ++i) row_gemm<T, NC>(out + i * ldo, A + i * lda, 0, kd, B, ldb, accumulate);
}

// dst [cols, rows] = src [rows, cols]^T (src row stride lds).
template <typename T>
inline void transpose(T* __restrict dst, const T* __restrict src, int rows, int cols, int lds) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * rows + r] = src[r * lds + c];
}

struct Strides {
  int64_t b, t, h;
};

inline Strides strides_of(const at::Tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

// Per-thread scratch of one chunk: every chunk-local matrix of the forward (and the backward's own).
template <typename T, int K, int V, int C>
struct Chunk {
  static constexpr int W = V + K;
  T q[C * K], k[C * K], v[C * V], G[C * K], beta[C];
  T e_row[C * K], kr[C * K], qr[C * K];
  std::vector<T> e_col, kcol, kcolT;  // [ns, C, K], [ns, C, K], [ns, K, C]
  T M[C * C], Aqk[C * C], Gam[C * K], VK[C * W], UW[C * W], dec[C * K], kdec[C * K], kdecT[K * C];
  T RP[K * W], P[K * K], OQ[C * W], Qeff[C * K];
  int ns, s;

  explicit Chunk(int ns_) : e_col(ns_ * C * K), kcol(ns_ * C * K), kcolT(ns_ * K * C), ns(ns_), s(C / ns_) {}

  // Loads chunk n of (row b, head h) (zeros past T) and computes every forward value but O and S_out.
  void compute(const T* q_, const T* k_, const T* v_, const T* g_, const T* b_, Strides sq, Strides sk, Strides sv,
               Strides sg, Strides sb, int64_t bi, int64_t h, int64_t n, int64_t T_) {
    for (int i = 0; i < C; ++i) {
      const int64_t t = n * C + i;
      if (t < T_) {
        const T* qi = q_ + bi * sq.b + t * sq.t + h * sq.h;
        const T* ki = k_ + bi * sk.b + t * sk.t + h * sk.h;
        const T* vi = v_ + bi * sv.b + t * sv.t + h * sv.h;
        const T* gi = g_ + bi * sg.b + t * sg.t + h * sg.h;
        for (int d = 0; d < K; ++d) q[i * K + d] = qi[d], k[i * K + d] = ki[d];
        for (int d = 0; d < V; ++d) v[i * V + d] = vi[d];
        for (int d = 0; d < K; ++d) G[i * K + d] = gi[d] + (i ? G[(i - 1) * K + d] : T(0));
        beta[i] = b_[bi * sb.b + t * sb.t + h * sb.h];
      } else {  // identity steps: g = 0, beta = 0, k = q = v = 0
        for (int d = 0; d < K; ++d) q[i * K + d] = k[i * K + d] = T(0);
        for (int d = 0; d < V; ++d) v[i * V + d] = T(0);
        for (int d = 0; d < K; ++d) G[i * K + d] = i ? G[(i - 1) * K + d] : T(0);
        beta[i] = T(0);
      }
    }
    for (int a = 0; a < ns; ++a) {
      const T* ref = G + a * s * K;
      const int end = (a + 1) * s;  // columns j < end: the block's own rows and those before
      T* ec = e_col.data() + a * C * K;
      T* kc = kcol.data() + a * C * K;
      T* kcT = kcolT.data() + a * K * C;
      for (int j = 0; j < end; ++j)
        for (int d = 0; d < K; ++d) {
          const T e = exp_(ref[d] - G[j * K + d]);
          ec[j * K + d] = e;
          kc[j * K + d] = k[j * K + d] * e;
        }
      std::fill(ec + end * K, ec + C * K, T(0));
      std::fill(kc + end * K, kc + C * K, T(0));
      transpose(kcT, kc, C, K, K);
      for (int i = a * s; i < end; ++i)
        for (int d = 0; d < K; ++d) {
          const T e = exp_(G[i * K + d] - ref[d]);
          e_row[i * K + d] = e;
          kr[i * K + d] = k[i * K + d] * e;
          qr[i * K + d] = q[i * K + d] * e;
        }
      // M and Aqk rows of this block: kr / qr against the block's columns, then the causal mask
      gemm<T, C>(M + a * s * C, C, kr + a * s * K, K, s, K, kcT, C, false);
      gemm<T, C>(Aqk + a * s * C, C, qr + a * s * K, K, s, K, kcT, C, false);
    }
    for (int i = 0; i < C; ++i)
      for (int j = 0; j < C; ++j) {
        if (j >= i) M[i * C + j] = T(0);
        if (j > i) Aqk[i * C + j] = T(0);
      }
    const T* Gc = G + (C - 1) * K;
    for (int i = 0; i < C; ++i) {
      for (int d = 0; d < V; ++d) VK[i * W + d] = v[i * V + d];
      for (int d = 0; d < K; ++d) {
        Gam[i * K + d] = exp_(G[i * K + d]);
        VK[i * W + V + d] = Gam[i * K + d] * k[i * K + d];
        dec[i * K + d] = exp_(Gc[d] - G[i * K + d]);
        kdec[i * K + d] = k[i * K + d] * dec[i * K + d];
      }
    }
    // UW = L^-1 diag(beta) VK by forward substitution: UW_i = beta_i (VK_i - sum_{j<i} M_ij UW_j)
    for (int i = 0; i < C; ++i) {
      T* u = UW + i * W;
      for (int c = 0; c < W; ++c) u[c] = VK[i * W + c];
      T neg[C];
      for (int j = 0; j < i; ++j) neg[j] = -M[i * C + j];
      row_gemm<T, W>(u, neg, 0, i, UW, W, true);
      for (int c = 0; c < W; ++c) u[c] *= beta[i];
    }
    transpose(kdecT, kdec, C, K, K);
    gemm<T, W>(RP, W, kdecT, C, K, C, UW, W, false);  // (K dec)^T UW
    for (int d = 0; d < K; ++d)
      for (int e = 0; e < K; ++e) P[d * K + e] = (d == e ? Gam[(C - 1) * K + d] : T(0)) - RP[d * W + V + e];
    for (int i = 0; i < C; ++i) row_gemm<T, W>(OQ + i * W, Aqk + i * C, 0, i + 1, UW, W, false);
    for (int i = 0; i < C; ++i)
      for (int d = 0; d < K; ++d) Qeff[i * K + d] = Gam[i * K + d] * q[i * K + d] - OQ[i * W + V + d];
  }
};

template <typename T, int K, int V, int C>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& S0, int64_t ns, at::Tensor& o, at::Tensor& S_all) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), N = S_all.size(1) - 1;
  constexpr int W = V + K;
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v), sg = strides_of(g),
                sb = strides_of(beta), so = strides_of(o);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>(),
          *bp = beta.data_ptr<T>(), *s0 = S0.data_ptr<T>();
  T *op = o.data_ptr<T>(), *sa = S_all.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    auto ch = std::make_unique<Chunk<T, K, V, C>>(static_cast<int>(ns));
    T Snew[K * V];
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / H, h = m % H;
      T* S = sa + m * (N + 1) * K * V;
      std::copy(s0 + m * K * V, s0 + (m + 1) * K * V, S);
      for (int64_t n = 0; n < N; ++n, S += K * V) {
        ch->compute(qp, kp, vp, gp, bp, sq, sk, sv, sg, sb, bi, h, n, T_);
        for (int i = 0; i < C && n * C + i < T_; ++i) {  // O = OQ_V + Q_eff S_in
          T* oi = op + bi * so.b + (n * C + i) * so.t + h * so.h;
          for (int c = 0; c < V; ++c) oi[c] = ch->OQ[i * W + c];
          row_gemm<T, V>(oi, ch->Qeff + i * K, 0, K, S, V, true);
        }
        for (int d = 0; d < K; ++d) {  // S_out = P S_in + R
          for (int c = 0; c < V; ++c) Snew[d * V + c] = ch->RP[d * W + c];
          row_gemm<T, V>(Snew + d * V, ch->P + d * K, 0, K, S, V, true);
        }
        std::copy(Snew, Snew + K * V, S + K * V);
      }
    }
  });
}

template <typename T, int K, int V, int C>
void backward_impl(const at::Tensor& dO, const at::Tensor& dS_last, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S_all,
                   int64_t ns_, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, at::Tensor& dbeta,
                   at::Tensor& dS0) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), N = S_all.size(1) - 1;
  constexpr int W = V + K;
  const int ns = static_cast<int>(ns_), s = C / ns;
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v), sg = strides_of(g),
                sb = strides_of(beta), sdo = strides_of(dO);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>(),
          *bp = beta.data_ptr<T>(), *sa = S_all.data_ptr<T>(), *dop = dO.data_ptr<T>(),
          *dsl = dS_last.data_ptr<T>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>(), *dgp = dg.data_ptr<T>(),
    *dbp = dbeta.data_ptr<T>(), *ds0 = dS0.data_ptr<T>();
  // dq, dk, dg: contiguous [B, T, H, K]; dv [B, T, H, V]; dbeta [B, T, H]
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    auto ch = std::make_unique<Chunk<T, K, V, C>>(ns);
    struct Grad {
      T dO[C * V], ST[V * K], dQeff[C * K], dS[K * V], dSn[K * V], PT[K * K], QeffT[K * C], dP[K * K];
      T dOQ[C * W], UWT[W * C], dAqk[C * C], dRP[K * W], dRPT[W * K], dkdec[C * K], AqkT[C * C], dUW[C * W];
      T LT[C * C], dBr[C * W], dLm[C * C], dM[C * C], dbeta[C], dMT[C * C], dAT[C * C];
      T d_kr[C * K], d_qr[C * K], d_kcol_e[C * K], dG[C * K], dkc[C * K];
    };
    auto gr = std::make_unique<Grad>();
    Grad& r = *gr;
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / H, h = m % H;
      std::copy(dsl + m * K * V, dsl + (m + 1) * K * V, r.dS);  // dL/dS_{n+1}, carried backwards
      for (int64_t n = N - 1; n >= 0; --n) {
        Chunk<T, K, V, C>& c = *ch;
        c.compute(qp, kp, vp, gp, bp, sq, sk, sv, sg, sb, bi, h, n, T_);
        const T* S = sa + (m * (N + 1) + n) * K * V;  // S_in
        for (int i = 0; i < C; ++i) {
          const int64_t t = n * C + i;
          const T* src = dop + bi * sdo.b + t * sdo.t + h * sdo.h;
          for (int d = 0; d < V; ++d) r.dO[i * V + d] = t < T_ ? src[d] : T(0);
        }
        transpose(r.ST, S, K, V, V);
        gemm<T, K>(r.dQeff, K, r.dO, V, C, V, r.ST, K, false);           // dQ_eff = dO S_in^T
        transpose(r.QeffT, c.Qeff, C, K, K);
        transpose(r.PT, c.P, K, K, K);
        gemm<T, V>(r.dSn, V, r.QeffT, C, K, C, r.dO, V, false);          // dS_n = Q_eff^T dO + P^T dS_{n+1}
        gemm<T, V>(r.dSn, V, r.PT, K, K, K, r.dS, V, true);
        gemm<T, K>(r.dP, K, r.dS, V, K, V, r.ST, K, false);              // dP = dS_{n+1} S_in^T
        for (int i = 0; i < C; ++i) {                                    // dOQ = [dO | -dQ_eff]
          for (int d = 0; d < V; ++d) r.dOQ[i * W + d] = r.dO[i * V + d];
          for (int d = 0; d < K; ++d) r.dOQ[i * W + V + d] = -r.dQeff[i * K + d];
        }
        for (int d = 0; d < K; ++d) {                                    // dRP = [dR | -dP], dR = dS_{n+1}
          for (int e = 0; e < V; ++e) r.dRP[d * W + e] = r.dS[d * V + e];
          for (int e = 0; e < K; ++e) r.dRP[d * W + V + e] = -r.dP[d * K + e];
        }
        transpose(r.UWT, c.UW, C, W, W);
        gemm<T, C>(r.dAqk, C, r.dOQ, W, C, W, r.UWT, C, false);          // dAqk = dOQ UW^T (j <= i)
        for (int i = 0; i < C; ++i)
          for (int j = i + 1; j < C; ++j) r.dAqk[i * C + j] = T(0);
        transpose(r.dRPT, r.dRP, K, W, W);
        gemm<T, K>(r.dkdec, K, c.UW, W, C, W, r.dRPT, K, false);         // dK_dec = UW dRP^T
        transpose(r.AqkT, c.Aqk, C, C, C);
        for (int j = 0; j < C; ++j) {                                    // dUW = Aqk^T dOQ + K_dec dRP
          row_gemm<T, W>(r.dUW + j * W, r.AqkT + j * C, j, C, r.dOQ, W, false);
          row_gemm<T, W>(r.dUW + j * W, c.kdec + j * K, 0, K, r.dRP, W, true);
        }
        // dBr = L^-T dUW by back substitution: dBr_j = dUW_j - sum_{i>j} beta_i M_ij dBr_i
        for (int j = 0; j < C; ++j)
          for (int i = 0; i < C; ++i) r.LT[j * C + i] = i > j ? -c.beta[i] * c.M[i * C + j] : T(0);
        for (int j = C - 1; j >= 0; --j) {
          for (int e = 0; e < W; ++e) r.dBr[j * W + e] = r.dUW[j * W + e];
          row_gemm<T, W>(r.dBr + j * W, r.LT + j * C, j + 1, C, r.dBr, W, true);
        }
        gemm<T, C>(r.dLm, C, r.dBr, W, C, W, r.UWT, C, false);           // dBr UW^T (j < i): -dL
        for (int i = 0; i < C; ++i) {
          T acc = T(0), accm = T(0);
          for (int e = 0; e < W; ++e) acc += r.dBr[i * W + e] * c.VK[i * W + e];
          for (int j = 0; j < C; ++j) {
            const T dl = j < i ? r.dLm[i * C + j] : T(0);
            accm += dl * c.M[i * C + j];
            r.dM[i * C + j] = -c.beta[i] * dl;
          }
          r.dbeta[i] = acc - accm;
          for (int e = 0; e < W; ++e) r.dBr[i * W + e] *= c.beta[i];  // now dVK
        }
        // the factor products of M = kr kcol^T and Aqk = qr kcol^T, per row block
        for (int i = 0; i < C * K; ++i) r.d_kcol_e[i] = T(0), r.dG[i] = T(0);
        transpose(r.dMT, r.dM, C, C, C);
        transpose(r.dAT, r.dAqk, C, C, C);
        for (int a = 0; a < ns; ++a) {
          const T* kc = c.kcol.data() + a * C * K;
          const T* ec = c.e_col.data() + a * C * K;
          const int r0 = a * s, r1 = (a + 1) * s;
          gemm<T, K>(r.d_kr + r0 * K, K, r.dM + r0 * C, C, s, r1, kc, K, false);
          gemm<T, K>(r.d_qr + r0 * K, K, r.dAqk + r0 * C, C, s, r1, kc, K, false);
          for (int j = 0; j < r1; ++j) {  // d_kcol[a]_j = sum_{i in a} dM_ij kr_i + dAqk_ij qr_i
            row_gemm<T, K>(r.dkc + j * K, r.dMT + j * C, r0, r1, c.kr, K, false);
            row_gemm<T, K>(r.dkc + j * K, r.dAT + j * C, r0, r1, c.qr, K, true);
            for (int d = 0; d < K; ++d) {
              r.d_kcol_e[j * K + d] += r.dkc[j * K + d] * ec[j * K + d];
              r.dG[j * K + d] -= r.dkc[j * K + d] * kc[j * K + d];
            }
          }
        }
        const T* Gam = c.Gam;
        T dkd_sum[K];
        for (int d = 0; d < K; ++d) dkd_sum[d] = T(0);
        for (int i = 0; i < C; ++i)
          for (int d = 0; d < K; ++d) {
            const int x = i * K + d;
            const T dGk = r.dBr[i * W + V + d];
            const T dkd = r.dkdec[x] * c.kdec[x];
            r.dG[x] += r.d_kr[x] * c.kr[x] + r.d_qr[x] * c.qr[x] +
                       (r.dQeff[x] * c.q[x] + dGk * c.k[x]) * Gam[x] - dkd;
            dkd_sum[d] += dkd;
            r.dkc[x] = r.d_qr[x] * c.e_row[x] + r.dQeff[x] * Gam[x];  // dq, kept in dkc (free now)
            r.d_kr[x] = r.d_kr[x] * c.e_row[x] + r.d_kcol_e[x] + r.dkdec[x] * c.dec[x] + dGk * Gam[x];  // dk
          }
        for (int d = 0; d < K; ++d)
          r.dG[(C - 1) * K + d] += dkd_sum[d] + r.dP[d * K + d] * Gam[(C - 1) * K + d];
        for (int i = C - 2; i >= 0; --i)  // dg = reverse cumsum of dG (G = cumsum g)
          for (int d = 0; d < K; ++d) r.dG[i * K + d] += r.dG[(i + 1) * K + d];
        for (int i = 0; i < C && n * C + i < T_; ++i) {
          const int64_t t = n * C + i, rowk = ((bi * T_ + t) * H + h) * K, rowv = ((bi * T_ + t) * H + h) * V;
          for (int d = 0; d < K; ++d) {
            dqp[rowk + d] = r.dkc[i * K + d];
            dkp[rowk + d] = r.d_kr[i * K + d];
            dgp[rowk + d] = r.dG[i * K + d];
          }
          for (int d = 0; d < V; ++d) dvp[rowv + d] = r.dBr[i * W + d];
          dbp[(bi * T_ + t) * H + h] = r.dbeta[i];
        }
        std::copy(r.dSn, r.dSn + K * V, r.dS);
      }
      std::copy(r.dS, r.dS + K * V, ds0 + m * K * V);
    }
  });
}

// Calls fn.template operator()<T, K, V, C>() for the supported sizes (see the header comment): the head sizes of
// glm_lightning_ops::with_sizes (which has no generic fallback here), then the chunk size.
template <typename F>
void dispatch(at::ScalarType dtype, int64_t K, int64_t V, int64_t C, F&& fn) {
  TORCH_CHECK(K == V && (K == 16 || K == 32 || K == 64), "kda_chunk: K == V in {16, 32, 64} only, got ", K, ", ", V);
  TORCH_CHECK(C == 16 || C == 32 || C == 64, "kda_chunk: chunk size in {16, 32, 64} only, got ", C);
  AT_DISPATCH_FLOATING_TYPES(dtype, "kda_chunk", [&] {
    glm_lightning_ops::with_sizes(K, V, [&]<int64_t KK, int64_t VV>() {
      if constexpr (KK > 0) {  // always, after the check above
        if (C == 16) return fn.template operator()<scalar_t, KK, VV, 16>();
        if (C == 32) return fn.template operator()<scalar_t, KK, VV, 32>();
        return fn.template operator()<scalar_t, KK, VV, 64>();
      }
    });
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, int64_t C, int64_t ns) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && g.sizes() == q.sizes(), "q, k, g must be [B, T, H, K]");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "v must be [B, T, H, V]");
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1) && beta.size(2) == q.size(2),
              "beta must be [B, T, H]");
  for (const at::Tensor* x : {&q, &k, &v, &g}) {
    TORCH_CHECK(x->stride(3) == 1, "kda_chunk: the last dimension must be contiguous");
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), "kda_chunk: one dtype for all inputs");
  }
  TORCH_CHECK(beta.scalar_type() == q.scalar_type(), "kda_chunk: one dtype for all inputs");
  TORCH_CHECK(ns >= 1 && C % ns == 0, "kda_chunk: ns must divide the chunk size");
}

std::tuple<at::Tensor, at::Tensor> kda_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S0_in,
                                                 int64_t C, int64_t ns) {
  check_inputs(q, k, v, g, beta, C, ns);
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3), N = (T_ + C - 1) / C;
  const at::Tensor S0 = S0_in.to(q.scalar_type()).contiguous();
  TORCH_CHECK(S0.numel() == B * H * K * V, "S0 must be [B, H, K, V]");
  at::Tensor o = at::empty({B, T_, H, V}, q.options());
  at::Tensor S_all = at::empty({B * H, N + 1, K, V}, q.options());
  dispatch(q.scalar_type(), K, V, C, [&]<typename T, int KK, int VV, int CC>() {
    forward_impl<T, KK, VV, CC>(q, k, v, g, beta, S0, ns, o, S_all);
  });
  return {o, S_all};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_chunk_bwd(
    const at::Tensor& dO_in, const at::Tensor& dS_last_in, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S_all_in, int64_t C,
    int64_t ns) {
  check_inputs(q, k, v, g, beta, C, ns);
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  const at::Tensor dO = dO_in.stride(-1) == 1 ? dO_in : dO_in.contiguous();
  const at::Tensor dS_last = dS_last_in.to(q.scalar_type()).contiguous(), S_all = S_all_in.contiguous();
  TORCH_CHECK(dO.sizes() == v.sizes(), "dO must be [B, T, H, V]");
  TORCH_CHECK(dS_last.numel() == B * H * K * V, "dS_last must be [B, H, K, V]");
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(q.sizes(), q.options()),
             dg = at::empty(q.sizes(), q.options()), dv = at::empty(v.sizes(), q.options()),
             dbeta = at::empty(beta.sizes(), q.options()), dS0 = at::empty({B, H, K, V}, q.options());
  dispatch(q.scalar_type(), K, V, C, [&]<typename T, int KK, int VV, int CC>() {
    backward_impl<T, KK, VV, CC>(dO, dS_last, q, k, v, g, beta, S_all, ns, dq, dk, dv, dg, dbeta, dS0);
  });
  return {dq, dk, dv, dg, dbeta, dS0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("kda_chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor S0, int C, int ns) -> "
        "(Tensor, Tensor)");
  m.def("kda_chunk_bwd(Tensor dO, Tensor dS_last, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor S_all, int C, int ns) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("kda_chunk_fwd", &kda_chunk_fwd);
  m.impl("kda_chunk_bwd", &kda_chunk_bwd);
}
