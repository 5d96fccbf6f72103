// KDA's core for training as the per-token recurrence (glm_lightning/model/kda.py, kda_recurrent), one CPU op per
// direction: each (row, head) keeps its [K, V] state in registers / L1 and walks its tokens.
//
// Why: for the small heads of this lab the recurrence does fewer FLOPs than the chunked (WY / UT) form: 4 K V
// multiply-adds per token (decay, S^T k, rank-1 update, S^T q) against ~8 K V for the chunked form at C = 32 (the
// [C, C] products, the triangular solve, the hand-off). The chunked form pays that to turn the recurrence into
// matmuls for GPU tensor cores; on a CPU the B * H independent sequences already fill the cores, and a head's state
// is 16-64 vector registers.
//
// Forward, per token t (S_{-1} = S0, a_t = exp(g_t), rows d < K of S are the key channels):
//   S'_t = Diag(a_t) S_{t-1},  e_t = v_t - S'_t^T k_t,  u_t = beta_t e_t,  S_t = S'_t + k_t u_t^T,  o_t = S_t^T q_t.
// Backward, walking back with dS = dL/dS_t (the final state's gradient first):
//   dS += q_t do_t^T,  dq_t = S_t do_t = S'_t do_t + k_t (u_t . do_t),  du = dS^T k_t,  dk_t = dS u_t - S'_t de,
//   dbeta_t = du . e_t,  de = beta_t du,  dv_t = de,  dS' = dS - k_t de^T,  dg_t = rowsum(dS' * S'_t),
//   dS_{t-1} = Diag(a_t) dS'.
// The forward saves the state every `seg` tokens (S_ckpt [B*H, N+1, K, V], N = ceil(T / seg), the last entry the
// final state); the backward recomputes a segment's states from its checkpoint, then walks it back.
//
//   kda_recurrent_fwd(q, k, v, g, beta [B, T, H(, K)], S0 [B, H, K, V], seg) -> (o [B, T, H, V], S_ckpt)
//   kda_recurrent_bwd(dO, dS_last, q, k, v, g, beta, S_ckpt, seg) -> (dq, dk, dv, dg, dbeta, dS0)
// q, k, v, g, beta, dO may be strided in their first three dimensions; the last one is contiguous. fp32 and fp64 (for
// gradcheck, K == V == 16 only); K == V in {16, 32, 64}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
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

// A head's [K, V] state as K rows of NV vectors.
template <typename T, int K, int V>
struct State {
  static constexpr int NV = V / kLanes;
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  Vec r[K][NV];

  void load(const T* p) {
    for (int d = 0; d < K; ++d)
      for (int j = 0; j < NV; ++j) r[d][j] = L::load(p + d * V + j * kLanes);
  }
  void store(T* p) const {
    for (int d = 0; d < K; ++d)
      for (int j = 0; j < NV; ++j) L::store(p + d * V + j * kLanes, r[d][j]);
  }
};

// One forward step on S in place (S_{t-1} -> S_t); returns e_t and u_t = beta e_t through e / u.
template <typename T, int K, int V>
inline void step(State<T, K, V>& S, const T* k, const T* v, const T* a, T beta, typename State<T, K, V>::Vec* e,
                 typename State<T, K, V>::Vec* u) {
  using L = Lanes<T>;
  constexpr int NV = State<T, K, V>::NV;
  typename L::Vec acc[4][NV];
  for (int j = 0; j < NV; ++j) acc[0][j] = acc[1][j] = acc[2][j] = acc[3][j] = typename L::Vec{};
  #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
  for (int d = 0; d < K; ++d)
    for (int j = 0; j < NV; ++j) {
      S.r[d][j] *= a[d];
      acc[d & 3][j] += k[d] * S.r[d][j];  // four partial sums: independent FMA chains
    }
  for (int j = 0; j < NV; ++j) {
    e[j] = L::load(v + j * kLanes) - ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
    u[j] = beta * e[j];
  }
  #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
  for (int d = 0; d < K; ++d)
    for (int j = 0; j < NV; ++j) S.r[d][j] += k[d] * u[j];
}

template <typename T, int K>
inline void decays(T* a, const T* g) {
  for (int d = 0; d < K; ++d) a[d] = exp_(g[d]);
}

template <typename T, int K, int V>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& S0, int64_t seg, at::Tensor& o, at::Tensor& S_ckpt) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int NV = V / kLanes;
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), N = S_ckpt.size(1) - 1;
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v), sg = strides_of(g),
                sb = strides_of(beta), so = strides_of(o);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>(),
          *bp = beta.data_ptr<T>(), *s0 = S0.data_ptr<T>();
  T *op = o.data_ptr<T>(), *ck = S_ckpt.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    State<T, K, V> S;
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / H, h = m % H;
      T* ckm = ck + m * (N + 1) * K * V;
      S.load(s0 + m * K * V);
      for (int64_t t = 0; t < T_; ++t) {
        if (t % seg == 0) S.store(ckm + (t / seg) * K * V);
        const T* qt = qp + bi * sq.b + t * sq.t + h * sq.h;
        const T* kt = kp + bi * sk.b + t * sk.t + h * sk.h;
        T a[K];
        decays<T, K>(a, gp + bi * sg.b + t * sg.t + h * sg.h);
        Vec e[NV], u[NV];
        step<T, K, V>(S, kt, vp + bi * sv.b + t * sv.t + h * sv.h, a, bp[bi * sb.b + t * sb.t + h * sb.h], e, u);
        Vec acc[4][NV];  // o = S^T q
        for (int j = 0; j < NV; ++j) acc[0][j] = acc[1][j] = acc[2][j] = acc[3][j] = Vec{};
        #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < NV; ++j) acc[d & 3][j] += qt[d] * S.r[d][j];
        T* ot = op + bi * so.b + t * so.t + h * so.h;
        for (int j = 0; j < NV; ++j) L::store(ot + j * kLanes, (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
      }
      S.store(ckm + N * K * V);
    }
  });
}

template <typename T, int K, int V>
void backward_impl(const at::Tensor& dO, const at::Tensor& dS_last, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& S_ckpt,
                   int64_t seg, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, at::Tensor& dbeta,
                   at::Tensor& dS0) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  constexpr int NV = V / kLanes;
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), N = S_ckpt.size(1) - 1;
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v), sg = strides_of(g),
                sb = strides_of(beta), sdo = strides_of(dO);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>(),
          *bp = beta.data_ptr<T>(), *ck = S_ckpt.data_ptr<T>(), *dop = dO.data_ptr<T>(),
          *dsl = dS_last.data_ptr<T>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>(), *dgp = dg.data_ptr<T>(),
    *dbp = dbeta.data_ptr<T>(), *ds0 = dS0.data_ptr<T>();
  // dq, dk, dg: contiguous [B, T, H, K]; dv [B, T, H, V]; dbeta [B, T, H]
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    glm_lightning_ops::FlushDenormals ftz;
    std::vector<State<T, K, V>> prev(seg);  // S_{t-1} for each token of the segment
    State<T, K, V> S, dS;
    for (int64_t m = begin; m < end; ++m) {
      const int64_t bi = m / H, h = m % H;
      dS.load(dsl + m * K * V);
      for (int64_t n = N - 1; n >= 0; --n) {
        const int64_t t0 = n * seg, t1 = std::min(T_, t0 + seg);
        S.load(ck + (m * (N + 1) + n) * K * V);
        for (int64_t t = t0; t < t1; ++t) {  // the segment's states, recomputed from its checkpoint
          prev[t - t0] = S;
          if (t + 1 == t1) break;
          T a[K];
          decays<T, K>(a, gp + bi * sg.b + t * sg.t + h * sg.h);
          Vec e[NV], u[NV];
          step<T, K, V>(S, kp + bi * sk.b + t * sk.t + h * sk.h, vp + bi * sv.b + t * sv.t + h * sv.h, a,
                        bp[bi * sb.b + t * sb.t + h * sb.h], e, u);
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const T* qt = qp + bi * sq.b + t * sq.t + h * sq.h;
          const T* kt = kp + bi * sk.b + t * sk.t + h * sk.h;
          const T* vt = vp + bi * sv.b + t * sv.t + h * sv.h;
          const T bt = bp[bi * sb.b + t * sb.t + h * sb.h];
          const T* dot = dop + bi * sdo.b + t * sdo.t + h * sdo.h;
          T a[K];
          decays<T, K>(a, gp + bi * sg.b + t * sg.t + h * sg.h);
          State<T, K, V>& Sp = prev[t - t0];  // S'_t = Diag(a) S_{t-1}, in place
          Vec acc[4][NV];
          for (int j = 0; j < NV; ++j) acc[0][j] = acc[1][j] = acc[2][j] = acc[3][j] = Vec{};
          #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < NV; ++j) {
              Sp.r[d][j] *= a[d];
              acc[d & 3][j] += kt[d] * Sp.r[d][j];
            }
          Vec e[NV], u[NV], dov[NV];
          T udo = T(0);
          for (int j = 0; j < NV; ++j) {
            e[j] = L::load(vt + j * kLanes) - ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
            u[j] = bt * e[j];
            dov[j] = L::load(dot + j * kLanes);
          }
          {
            Vec p{};
            for (int j = 0; j < NV; ++j) p += u[j] * dov[j];
            udo = L::sum(p);
          }
          // pass 1: dS += q do^T; du = dS^T k; dq = S'_t do + k (u . do). The K row dot products (and pass 2's) are
          // reduced 16 at a time (Lanes::sums16, the same sums as Lanes::sum bit for bit): one 16-lane tree per row
          // had cost about as many instructions as the state updates.
          const int64_t rowk = ((bi * T_ + t) * H + h) * K, rowv = ((bi * T_ + t) * H + h) * V;
          Vec pq[K];
          for (int j = 0; j < NV; ++j) acc[0][j] = acc[1][j] = acc[2][j] = acc[3][j] = Vec{};
          #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
          for (int d = 0; d < K; ++d) {
            Vec p{};
            for (int j = 0; j < NV; ++j) {
              dS.r[d][j] += qt[d] * dov[j];
              acc[d & 3][j] += kt[d] * dS.r[d][j];
              p += Sp.r[d][j] * dov[j];
            }
            pq[d] = p;
          }
          for (int d0 = 0; d0 < K; d0 += kLanes)
            L::store(dqp + rowk + d0, L::sums16(pq + d0) + L::load(kt + d0) * udo);
          Vec de[NV];
          Vec pb{};
          for (int j = 0; j < NV; ++j) {
            const Vec du = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
            pb += du * e[j];
            de[j] = bt * du;
            L::store(dvp + rowv + j * kLanes, de[j]);
          }
          dbp[(bi * T_ + t) * H + h] = L::sum(pb);
          // pass 2: dk = dS u - S' de; dS' = dS - k de^T; dg = rowsum(dS' * S'); dS_{t-1} = Diag(a) dS'
          Vec pkd[K], pgd[K];
          #pragma GCC unroll 64  // d & 3 must be a constant: the partial sums stay in registers
          for (int d = 0; d < K; ++d) {
            Vec pk{}, pg{};
            for (int j = 0; j < NV; ++j) {
              pk += dS.r[d][j] * u[j] - Sp.r[d][j] * de[j];
              dS.r[d][j] -= kt[d] * de[j];
              pg += dS.r[d][j] * Sp.r[d][j];
              dS.r[d][j] *= a[d];
            }
            pkd[d] = pk;
            pgd[d] = pg;
          }
          for (int d0 = 0; d0 < K; d0 += kLanes) {
            L::store(dkp + rowk + d0, L::sums16(pkd + d0));
            L::store(dgp + rowk + d0, L::sums16(pgd + d0));
          }
        }
      }
      dS.store(ds0 + m * K * V);
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
