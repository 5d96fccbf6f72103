// KDA's core for training as the per-token recurrence (glm_lightning/model/kda.py, kda_recurrent), one CPU op per
// direction: each (row, head) keeps its [K, V] state in L1 and walks its tokens, one pass over the state's rows per token
// (the next token's decay and S'^T k folded into the pass that updates the state; the backward fuses token t's second
// half with token t-1's first half).
//
// Why: for the small heads of this lab the recurrence does fewer FLOPs than the chunked (WY / UT) form: 4 K V
// multiply-adds per token (decay, S^T k, rank-1 update, S^T q) against ~8 K V for the chunked form at C = 32 (the
// [C, C] products, the triangular solve, the hand-off). The chunked form pays that to turn the recurrence into
// matmuls for GPU tensor cores; on a CPU the B * H independent sequences already fill the cores, and a head's state
// stays in L1 (4 KB at K = V = 32).
//
// Forward, per token t (S_{-1} = S0, a_t = exp(g_t), rows d < K of S are the key channels):
//   S'_t = Diag(a_t) S_{t-1},  e_t = v_t - S'_t^T k_t,  u_t = beta_t e_t,  S_t = S'_t + k_t u_t^T,  o_t = S_t^T q_t.
// Backward, walking back with dS = dL/dS_t (the final state's gradient first):
//   dS += q_t do_t^T,  dq_t = S_t do_t = S'_t do_t + k_t (u_t . do_t),  du = dS^T k_t,  dk_t = dS u_t - S'_t de,
//   dbeta_t = du . e_t,  de = beta_t du,  dv_t = de,  dS' = dS - k_t de^T,  dg_t = rowsum(dS' * S'_t),
//   dS_{t-1} = Diag(a_t) dS'.
// The forward saves the state every `seg` tokens (S_ckpt [B*H, N+1, K, V], N = ceil(T / seg), the last entry the
// final state); the backward recomputes a segment's S'_t and e_t from its checkpoint, then walks it back.
//
//   kda_recurrent_fwd(q, k, v, g, beta [B, T, H(, K)], S0 [B, H, K, V], seg) -> (o [B, T, H, V], S_ckpt)
//   kda_recurrent_bwd(dO, dS_last, q, k, v, g, beta, S_ckpt, seg) -> (dq, dk, dv, dg, dbeta, dS0)
// q, k, v, g, beta, dO may be strided in their first three dimensions; the last one is contiguous. fp32 and fp64 (for
// gradcheck, K == V == 16 only); K == V in {16, 32, 64}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernel_helpers.h"

namespace kda_recurrent {  // named: the unity build puts every source in one translation unit

using glm_lightning_ops::exp_;
using glm_lightning_ops::kLanes;
using glm_lightning_ops::Lanes;

struct Strides {
  int64_t b, t, h;
};

inline Strides strides_of(const at::Tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

// One (row, head)'s tokens of a [B, T, H(, ...)] input: token t's row at p + t * st.
template <typename T>
struct Tokens {
  const T* p;
  int64_t st;
  const T* at(int64_t t) const { return p + t * st; }
};

template <typename T>
inline Tokens<T> tokens_of(const at::Tensor& x, int64_t bi, int64_t h) {
  const Strides s = strides_of(x);
  return {x.data_ptr<T>() + bi * s.b + h * s.h, s.t};
}

// A head's [K, V] matrices (states, their gradients) live in memory as K rows of NV vectors, read and written once per
// pass of a token: 64 vectors at K = V = 32 are twice the registers there are, and the register-resident form spilled
// and reloaded each of them several times per token (~450 cycles per token forward against ~130 of FMAs).
template <typename T, int K, int V>
struct Head {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  static constexpr int NV = V / kLanes;
  // Partial sums of a reduction over the K rows (row d into d % P): independent FMA chains, P * NV registers.
  static constexpr int P = NV >= 4 ? 2 : 4;
  static Vec get(const T* m, int d, int j) { return L::load(m + d * V + j * kLanes); }
  static void put(T* m, int d, int j, const Vec& x) { L::store(m + d * V + j * kLanes, x); }
  static void zero(Vec (&acc)[P][NV]) {
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < NV; ++j) acc[p][j] = Vec{};
  }
  static Vec total(const Vec (&acc)[P][NV], int j) {
    if constexpr (P == 4)
      return (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
    else
      return acc[0][j] + acc[1][j];
  }
};

// Tokens ahead whose input rows a walk asks the cache for (software prefetch). A (row, head)'s tokens lie H K or 3 H K
// floats apart in the step's tensors (v is a slice of the short conv's [B, T, 3 H K] output: 2,304 bytes at
// flash-25m), a stride the hardware prefetchers do not follow (csrc/short_conv.cpp met the same).
constexpr int64_t kAhead = 8;

template <typename T>
inline void prefetch_row(const T* p, int64_t len) {
  for (int64_t k = 0; k < len; k += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(p + k);
  __builtin_prefetch(p + len - 1);  // a row that straddles a line boundary
}

template <typename T, int K>
inline void decays(T* a, const T* g) {
  for (int d = 0; d < K; ++d) a[d] = exp_(g[d]);
}

// The forward's one pass per token t over the rows of S (holding S'_t = Diag(a_t) S_{t-1}): S_t = S'_t + k_t u_t^T,
// o += q_t-weighted rows (o_t = S_t^T q_t), S_t to `ckpt` (kCkpt), and for the next token (kNext) S'_{t+1} =
// Diag(a_{t+1}) S_t back into S with its S'^T k_{t+1} into nk.
template <typename T, int K, int V, bool kCkpt, bool kNext>
__attribute__((always_inline)) inline void forward_pass(T* __restrict S, const T* __restrict kt,
                                                        const typename Head<T, K, V>::Vec* u, const T* __restrict qt,
                                                        T* __restrict ckpt, const T* __restrict an,
                                                        const T* __restrict kn,
                                                        typename Head<T, K, V>::Vec (&o)[Head<T, K, V>::P][Head<T, K, V>::NV],
                                                        typename Head<T, K, V>::Vec (&nk)[Head<T, K, V>::P][Head<T, K, V>::NV]) {
  using H = Head<T, K, V>;
  #pragma GCC unroll 64
  for (int d = 0; d < K; ++d)
    for (int j = 0; j < H::NV; ++j) {
      typename H::Vec s = H::get(S, d, j) + kt[d] * u[j];
      o[d % H::P][j] += qt[d] * s;
      if constexpr (kCkpt) H::put(ckpt, d, j, s);
      if constexpr (kNext) {
        s *= an[d];
        nk[d % H::P][j] += kn[d] * s;
        H::put(S, d, j, s);
      }
    }
}

template <typename T, int K, int V>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& S0, int64_t seg, at::Tensor& o, at::Tensor& S_ckpt) {
  using H = Head<T, K, V>;
  using L = typename H::L;
  using Vec = typename H::Vec;
  constexpr int NV = H::NV, P = H::P;
  const int64_t B = q.size(0), T_ = q.size(1), NH = q.size(2), N = S_ckpt.size(1) - 1;
  const T* s0 = S0.data_ptr<T>();
  T* ck = S_ckpt.data_ptr<T>();
  at::parallel_for(0, B * NH, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    // S'_t and the decays in heap buffers: as local arrays GCC replaced the state by 64 vector variables, spilled and
    // copied between the pass variants (no faster than the register-resident form), and permuted the decays into 32
    // broadcast vectors per token (1.1x slower than broadcasting them from memory)
    std::vector<T> S_buf(K * V), a_buf(K);
    T* S = S_buf.data();
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / NH, h = m % NH;
      const Tokens<T> qs = tokens_of<T>(q, bi, h), ks = tokens_of<T>(k, bi, h), vs = tokens_of<T>(v, bi, h),
                      gs = tokens_of<T>(g, bi, h), bs = tokens_of<T>(beta, bi, h), os = tokens_of<T>(o, bi, h);
      T* ckm = ck + m * (N + 1) * K * V;
      const T* s0m = s0 + m * K * V;
      if (T_ == 0) {  // no tokens: the final state is S0
        std::memcpy(ckm, s0m, K * V * sizeof(T));
        continue;
      }
      T* a = a_buf.data();
      decays<T, K>(a, gs.at(0));
      Vec acc[P][NV];  // S'^T k for the token at hand
      H::zero(acc);
      for (int d = 0; d < K; ++d)
        for (int j = 0; j < NV; ++j) {
          const Vec x = H::get(s0m, d, j);
          H::put(ckm, d, j, x);  // checkpoint 0: S_{-1}
          const Vec s = a[d] * x;
          acc[d % P][j] += ks.at(0)[d] * s;
          H::put(S, d, j, s);
        }
      int64_t ckpt_in = seg;  // tokens until the next checkpoint (no division per token)
      for (int64_t t = 0; t < T_; ++t) {
        if (t + kAhead < T_) {
          const int64_t f = t + kAhead;
          prefetch_row(qs.at(f), K), prefetch_row(ks.at(f), K), prefetch_row(vs.at(f), V), prefetch_row(gs.at(f), K);
          __builtin_prefetch(bs.at(f));
          __builtin_prefetch(os.at(f), 1), __builtin_prefetch(os.at(f) + V - 1, 1);  // the output row, for writing
        }
        Vec u[NV];
        const T bt = *bs.at(t);
        for (int j = 0; j < NV; ++j) u[j] = bt * (L::load(vs.at(t) + j * kLanes) - H::total(acc, j));
        Vec out[P][NV];
        H::zero(out);
        H::zero(acc);
        const bool next = t + 1 < T_;
        if (next) decays<T, K>(a, gs.at(t + 1));
        const T* kn = next ? ks.at(t + 1) : nullptr;
        if (!next)
          forward_pass<T, K, V, true, false>(S, ks.at(t), u, qs.at(t), ckm + N * K * V, a, kn, out, acc);
        else if (--ckpt_in == 0) {
          forward_pass<T, K, V, true, true>(S, ks.at(t), u, qs.at(t), ckm + (t + 1) / seg * K * V, a, kn, out, acc);
          ckpt_in = seg;
        } else
          forward_pass<T, K, V, false, true>(S, ks.at(t), u, qs.at(t), nullptr, a, kn, out, acc);
        T* ot = const_cast<T*>(os.at(t));
        for (int j = 0; j < NV; ++j) L::store(ot + j * kLanes, H::total(out, j));
      }
    }
  });
}

// A segment of the backward: its tokens' S'_t, e_t and a_t, recomputed from the segment's checkpoint.
template <typename T, int K, int V>
struct Segment {
  std::vector<T> Sp, e, a;  // [seg, K, V], [seg, V], [seg, K]
  explicit Segment(int64_t seg) : Sp(seg * K * V), e(seg * V), a(seg * K) {}
  T* Sp_at(int64_t i) { return Sp.data() + i * K * V; }
  T* e_at(int64_t i) { return e.data() + i * V; }
  T* a_at(int64_t i) { return a.data() + i * K; }
};

// Tokens t0 .. t0 + len - 1 from ckpt = S_{t0-1}: S'_t = Diag(a_t) S_{t-1}, e_t = v_t - S'_t^T k_t, S_t = S'_t + k_t
// (beta_t e_t)^T, in the forward's order of operations.
// The walk also prefetches the rows of k, v, g, beta kAhead tokens on, the segment's own q and dO rows, which the
// walk back reads next (qs, dos: the backward's), and the first kAhead tokens' rows of the segment before (seg tokens
// long), which is recomputed next.
template <typename T, int K, int V>
void recompute(Segment<T, K, V>& sg, const T* ckpt, int64_t t0, int64_t len, const Tokens<T>& ks,
               const Tokens<T>& vs, const Tokens<T>& gs, const Tokens<T>& bs, const Tokens<T>& qs,
               const Tokens<T>& dos, int64_t seg) {
  using H = Head<T, K, V>;
  using L = typename H::L;
  using Vec = typename H::Vec;
  constexpr int NV = H::NV, P = H::P;
  Vec acc[P][NV];
  H::zero(acc);
  decays<T, K>(sg.a_at(0), gs.at(t0));
  const T *a0 = sg.a_at(0), *k0 = ks.at(t0);
  T* S0 = sg.Sp_at(0);
  for (int d = 0; d < K; ++d)
    for (int j = 0; j < NV; ++j) {
      const Vec s = a0[d] * H::get(ckpt, d, j);
      acc[d % P][j] += k0[d] * s;
      H::put(S0, d, j, s);
    }
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    if (i + kAhead < len) {
      const int64_t f = t + kAhead;
      prefetch_row(ks.at(f), K), prefetch_row(vs.at(f), V), prefetch_row(gs.at(f), K);
      __builtin_prefetch(bs.at(f));
    }
    prefetch_row(qs.at(t), K), prefetch_row(dos.at(t), V);
    if (i < kAhead && t0 >= seg) {  // the first rows of the segment recomputed next (the one before)
      const int64_t f = t - seg;
      prefetch_row(ks.at(f), K), prefetch_row(vs.at(f), V), prefetch_row(gs.at(f), K);
      __builtin_prefetch(bs.at(f));
    }
    Vec u[NV];
    const T bt = *bs.at(t);
    T* ei = sg.e_at(i);
    for (int j = 0; j < NV; ++j) {
      const Vec e = L::load(vs.at(t) + j * kLanes) - H::total(acc, j);
      L::store(ei + j * kLanes, e);
      u[j] = bt * e;
    }
    if (i + 1 == len) break;
    decays<T, K>(sg.a_at(i + 1), gs.at(t + 1));
    const T *kt = ks.at(t), *an = sg.a_at(i + 1), *kn = ks.at(t + 1);
    const T* Si = sg.Sp_at(i);
    T* Sn = sg.Sp_at(i + 1);
    H::zero(acc);
    #pragma GCC unroll 64
    for (int d = 0; d < K; ++d)
      for (int j = 0; j < NV; ++j) {
        Vec s = H::get(Si, d, j) + kt[d] * u[j];
        s *= an[d];
        acc[d % P][j] += kn[d] * s;
        H::put(Sn, d, j, s);
      }
  }
}

// A row's vectors of the backward's K-row dot products (dk, dg of one token, dq of the one before), reduced depth
// first with Lanes::half_step (the sums of Lanes::sums16, bit for bit) as the rows come.
template <typename Vec>
struct RowSums {
  Vec k, g, q;
};

template <typename L, int n, typename Row>
__attribute__((always_inline)) inline RowSums<typename L::Vec> row_tree(int d0, Row& row) {
  if constexpr (n == 1) {
    return row(d0);
  } else {
    const RowSums<typename L::Vec> x = row_tree<L, n / 2>(d0, row);
    const RowSums<typename L::Vec> y = row_tree<L, n / 2>(d0 + n / 2, row);
    constexpr int g = kLanes / n;
    return {L::template half_step<g>(x.k, y.k), L::template half_step<g>(x.g, y.g),
            L::template half_step<g>(x.q, y.q)};
  }
}

// What the backward carries between its passes for one token: its u, de, do, e and scalars.
template <typename T, int K, int V>
struct TokenGrads {
  typename Head<T, K, V>::Vec u[Head<T, K, V>::NV], de[Head<T, K, V>::NV];
};

// The backward's one pass over the rows of dS: the second half of token t's step (kLate: dk_t, dg_t from dS_t, and
// dS_{t-1} = Diag(a_t)(dS_t - k_t de_t^T)) fused with the first half of token s = t - 1's (kEarly: dS_s += q_s do_s^T,
// du_s = dS_s^T k_s into du, the rows of S'_s do_s for dq_s). Returns through dk, dg (token t) and dq_rows (token s).
template <typename T, int K, int V, bool kLate, bool kEarly>
__attribute__((always_inline)) inline void backward_pass(
    T* __restrict dS, const T* __restrict Sp_t, const T* __restrict kt, const T* __restrict at,
    const TokenGrads<T, K, V>& late, const T* __restrict Sp_s, const T* __restrict qs, const T* __restrict ks, const typename Head<T, K, V>::Vec* dos, typename Head<T, K, V>::Vec (&du)[Head<T, K, V>::P][Head<T, K, V>::NV],
    T* dk, T* dg, T* dq_rows) {
  using H = Head<T, K, V>;
  using L = typename H::L;
  using Vec = typename H::Vec;
  constexpr int NV = H::NV, P = H::P;
  auto row = [&](int d) __attribute__((always_inline)) {
    RowSums<Vec> r{Vec{}, Vec{}, Vec{}};
    for (int j = 0; j < NV; ++j) {
      Vec ds = H::get(dS, d, j);
      if constexpr (kLate) {
        const Vec sp = H::get(Sp_t, d, j);
        r.k += ds * late.u[j] - sp * late.de[j];
        ds -= kt[d] * late.de[j];
        r.g += ds * sp;
        ds *= at[d];
      }
      if constexpr (kEarly) {
        ds += qs[d] * dos[j];
        du[d % P][j] += ks[d] * ds;
        r.q += H::get(Sp_s, d, j) * dos[j];
      }
      H::put(dS, d, j, ds);
    }
    return r;
  };
  for (int d0 = 0; d0 < K; d0 += kLanes) {
    const RowSums<Vec> s = row_tree<L, kLanes>(d0, row);
    if constexpr (kLate) {
      L::store(dk + d0, s.k);
      L::store(dg + d0, s.g);
    }
    if constexpr (kEarly) L::store(dq_rows + d0, s.q);
  }
}

template <typename T, int K, int V>
void backward_impl(const at::Tensor& dO, const at::Tensor& dS_last, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S_ckpt,
                   int64_t seg, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, at::Tensor& dbeta,
                   at::Tensor& dS0) {
  using H = Head<T, K, V>;
  using L = typename H::L;
  using Vec = typename H::Vec;
  constexpr int NV = H::NV, P = H::P;
  const int64_t B = q.size(0), T_ = q.size(1), NH = q.size(2), N = S_ckpt.size(1) - 1;
  const T *ck = S_ckpt.data_ptr<T>(), *dsl = dS_last.data_ptr<T>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>(), *dgp = dg.data_ptr<T>(),
    *dbp = dbeta.data_ptr<T>(), *ds0 = dS0.data_ptr<T>();
  // dq, dk, dg: contiguous [B, T, H, K]; dv [B, T, H, V]; dbeta [B, T, H]
  at::parallel_for(0, B * NH, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    Segment<T, K, V> sg(seg);
    std::vector<T> dS_buf(K * V), pq_buf(K);  // on the heap: see forward_impl
    T *dS = dS_buf.data(), *pq = pq_buf.data();
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / NH, h = m % NH;
      const Tokens<T> qs = tokens_of<T>(q, bi, h), ks = tokens_of<T>(k, bi, h), vs = tokens_of<T>(v, bi, h),
                      gs = tokens_of<T>(g, bi, h), bs = tokens_of<T>(beta, bi, h), dos = tokens_of<T>(dO, bi, h);
      const auto row = [&](int64_t t) { return (bi * T_ + t) * NH + h; };
      std::memcpy(dS, dsl + m * K * V, K * V * sizeof(T));
      // Token s's first half done (du accumulated, S'_s do_s rows in pq): its dq, dbeta, dv, and u, de for its second
      // half.
      const auto finish_early = [&](int64_t s, int64_t i, const Vec (&du)[P][NV], const Vec* dov,
                                    TokenGrads<T, K, V>& tg) {
        const T bt = *bs.at(s);
        const T* e = sg.e_at(i);
        Vec pu{}, pb{};
        for (int j = 0; j < NV; ++j) {
          tg.u[j] = bt * L::load(e + j * kLanes);
          pu += tg.u[j] * dov[j];
        }
        const T udo = L::sum(pu);
        const T* kt = ks.at(s);
        for (int d0 = 0; d0 < K; d0 += kLanes)
          L::store(dqp + row(s) * K + d0, L::load(pq + d0) + L::load(kt + d0) * udo);
        for (int j = 0; j < NV; ++j) {
          const Vec dui = H::total(du, j);
          pb += dui * L::load(e + j * kLanes);
          tg.de[j] = bt * dui;
          L::store(dvp + row(s) * V + j * kLanes, tg.de[j]);
        }
        dbp[row(s)] = L::sum(pb);
      };
      for (int64_t n = N - 1; n >= 0; --n) {
        const int64_t t0 = n * seg, len = std::min(T_, t0 + seg) - t0;
        recompute<T, K, V>(sg, ck + (m * (N + 1) + n) * K * V, t0, len, ks, vs, gs, bs, qs, dos, seg);
        TokenGrads<T, K, V> late;
        for (int64_t i = len; i >= 0; --i) {  // token t0 + i's second half with token t0 + i - 1's first half
          const int64_t t = t0 + i, s = t - 1;
          if (s - kAhead >= t0) {  // the output rows written kAhead tokens on (the walk goes back), for writing
            const int64_t f = s - kAhead;
            __builtin_prefetch(dqp + row(f) * K, 1), __builtin_prefetch(dqp + row(f) * K + K - 1, 1);
            __builtin_prefetch(dkp + row(f) * K, 1), __builtin_prefetch(dkp + row(f) * K + K - 1, 1);
            __builtin_prefetch(dgp + row(f) * K, 1), __builtin_prefetch(dgp + row(f) * K + K - 1, 1);
            __builtin_prefetch(dvp + row(f) * V, 1), __builtin_prefetch(dvp + row(f) * V + V - 1, 1);
          }
          Vec du[P][NV], dov[NV];
          H::zero(du);
          if (i > 0)
            for (int j = 0; j < NV; ++j) dov[j] = L::load(dos.at(s) + j * kLanes);
          T *dk_t = dkp + row(t) * K, *dg_t = dgp + row(t) * K;
          if (i == len)
            backward_pass<T, K, V, false, true>(dS, nullptr, nullptr, nullptr, late, sg.Sp_at(i - 1), qs.at(s),
                                                ks.at(s), dov, du, nullptr, nullptr, pq);
          else if (i == 0)
            backward_pass<T, K, V, true, false>(dS, sg.Sp_at(i), ks.at(t), sg.a_at(i), late, nullptr, nullptr,
                                                nullptr, dov, du, dk_t, dg_t, nullptr);
          else
            backward_pass<T, K, V, true, true>(dS, sg.Sp_at(i), ks.at(t), sg.a_at(i), late, sg.Sp_at(i - 1),
                                               qs.at(s), ks.at(s), dov, du, dk_t, dg_t, pq);
          if (i > 0) finish_early(s, i - 1, du, dov, late);
        }
      }
      std::memcpy(ds0 + m * K * V, dS, K * V * sizeof(T));
    }
  });
}

// Square heads only (K == V: the model's heads; glm_lightning/model/ops/kda_recurrent.py zero-pads other shapes up to
// one): each size is a fully unrolled state, and the six K != V instantiations took 36 of the file's 84 s of g++.
// fp64 (gradcheck only) at K == 16 only: a 16-lane fp64 vector is 1024 bits, and its 32 and 64 instantiations took
// 374 of the file's 474 s of g++ on an AVX2 machine (vectors wider than the machine's are split by the compiler);
// 100 s without them (fp32 16/32/64 + fp64 16). The ops layer sends other fp64 heads to the chunked form.
template <typename F>
void dispatch(at::ScalarType dtype, int64_t K, int64_t V, F&& fn) {
  TORCH_CHECK(K == V && (K == 16 || K == 32 || K == 64), "kda_recurrent: K == V in {16, 32, 64} only, got ", K, ", ",
              V);
  if (dtype == at::kDouble) {
    TORCH_CHECK(K == 16, "kda_recurrent: fp64 for K == V == 16 only (gradcheck), got ", K);
    return fn.template operator()<double, 16, 16>();
  }
  TORCH_CHECK(dtype == at::kFloat, "kda_recurrent: fp32 or fp64 only, got ", dtype);
  if (K == 16) return fn.template operator()<float, 16, 16>();
  if (K == 32) return fn.template operator()<float, 32, 32>();
  return fn.template operator()<float, 64, 64>();
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, int64_t seg) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && g.sizes() == q.sizes(), "q, k, g must be [B, T, H, K]");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "v must be [B, T, H, V]");
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == q.size(0) && beta.size(1) == q.size(1) && beta.size(2) == q.size(2),
              "beta must be [B, T, H]");
  for (const at::Tensor* x : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), "kda_recurrent: one dtype for all inputs");
  for (const at::Tensor* x : {&q, &k, &v, &g})
    TORCH_CHECK(x->stride(3) == 1, "kda_recurrent: the last dimension must be contiguous");
  TORCH_CHECK(seg >= 1, "kda_recurrent: seg must be positive");
}

std::tuple<at::Tensor, at::Tensor> kda_recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& g, const at::Tensor& beta,
                                                     const at::Tensor& S0_in, int64_t seg) {
  check_inputs(q, k, v, g, beta, seg);
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3), N = (T_ + seg - 1) / seg;
  const at::Tensor S0 = S0_in.to(q.scalar_type()).contiguous();
  TORCH_CHECK(S0.numel() == B * H * K * V, "S0 must be [B, H, K, V]");
  at::Tensor o = at::empty({B, T_, H, V}, q.options());
  at::Tensor S_ckpt = at::empty({B * H, N + 1, K, V}, q.options());
  dispatch(q.scalar_type(), K, V, [&]<typename T, int KK, int VV>() {
    forward_impl<T, KK, VV>(q, k, v, g, beta, S0, seg, o, S_ckpt);
  });
  return {o, S_ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_recurrent_bwd(
    const at::Tensor& dO_in, const at::Tensor& dS_last_in, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S_ckpt_in, int64_t seg) {
  check_inputs(q, k, v, g, beta, seg);
  const int64_t B = q.size(0), H = q.size(2), K = q.size(3), V = v.size(3);
  const at::Tensor dO = dO_in.stride(-1) == 1 ? dO_in : dO_in.contiguous();
  const at::Tensor dS_last = dS_last_in.to(q.scalar_type()).contiguous(), S_ckpt = S_ckpt_in.contiguous();
  TORCH_CHECK(dO.sizes() == v.sizes(), "dO must be [B, T, H, V]");
  TORCH_CHECK(dS_last.numel() == B * H * K * V, "dS_last must be [B, H, K, V]");
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(q.sizes(), q.options()),
             dg = at::empty(q.sizes(), q.options()), dv = at::empty(v.sizes(), q.options()),
             dbeta = at::empty(beta.sizes(), q.options()), dS0 = at::empty({B, H, K, V}, q.options());
  dispatch(q.scalar_type(), K, V, [&]<typename T, int KK, int VV>() {
    backward_impl<T, KK, VV>(dO, dS_last, q, k, v, g, beta, S_ckpt, seg, dq, dk, dv, dg, dbeta, dS0);
  });
  return {dq, dk, dv, dg, dbeta, dS0};
}

}  // namespace kda_recurrent

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("kda_recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor S0, int seg) -> "
        "(Tensor, Tensor)");
  m.def("kda_recurrent_bwd(Tensor dO, Tensor dS_last, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor S_ckpt, int seg) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("kda_recurrent_fwd", &kda_recurrent::kda_recurrent_fwd);
  m.impl("kda_recurrent_bwd", &kda_recurrent::kda_recurrent_bwd);
}
