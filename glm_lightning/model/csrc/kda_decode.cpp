// One KDA decode step (glm_lightning/model/kda.py, decoding without autograd) as two CPU ops, each one pass over its
// cache written in place, and the step's core from the projections to the gated head norm as one op that runs them.
//
// Why: with many rows (RL: every prompt x G samples in one decode batch) the eager step streams the whole cache
// several times: the short conv's cat, product, sum, SiLU and buffer shift (5 passes over [B, ks, 3HK]) and the
// delta rule's decay, S^T k, rank-1 update and S^T q (6 passes over the fp32 state [B, H, K, V], 38 MB per layer at
// 1,536 rows). Here each (row, head) state is loaded once, updated while it sits in L1, and written back once.
//
//   conv_step_(conv_state [B, ks-1, C], raw [B, C], weight [C, ks]) -> y [B, C]
//       y = SiLU(sum_t xp[t] * weight[:, t]) with xp = [conv_state; raw]; conv_state <- xp[1:]
//   delta_step_(q [B, H, K], k [B, H, K], v [B, H, V], g [B, H, K], beta [B, H], S [B, H, K, V]) -> o [B, H, V]
//       S <- Diag(exp g) S;  e = beta (v - S^T k);  S <- S + k e^T;  o = S^T q
//   kda_decode_core(raw [B, (1,) 3HK], f [B, (1,) HK], b [B, (1,) H], A_log [H], rescale [2H], lb, conv_state,
//                   conv_weight [C, ks], S [B, H, K, K], gate [B, (1,) HK], norm_weight [K], eps) -> [B, HK]
//       conv_step_, then glm_lightning::kda_features (with a = exp(A_log)), delta_step_ on its q, k, v, g, beta and
//       glm_lightning::gated_head_norm: the same ops on the same views as the layer's eager sequence of them, so the
//       same values bit for bit. Why: that sequence is ~20 top-level ops from Python (the views, two autograd
//       Functions' wrappers) at ~3-5 us each, ~50 us of a layer's ~230 us decode step at 2 threads; called from here the
//       two ops of other files cost ~1 us each through the dispatcher.
//
// q, k, v, g may be strided views (slices of one fused projection): only their last dimension must be contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "kernel_helpers.h"

namespace kda_decode_ops {
// The KDA features and gated head-norm ops (their kernels live in other sources), found in the dispatcher once (also
// called by block_decode.cpp).
using FeaturesOp = c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;
using HeadNormOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;
const FeaturesOp& features_op();
const HeadNormOp& head_norm_op();
}  // namespace kda_decode_ops

namespace {

// One row: y = SiLU(sum_t s[t] wt[t] + r wt[P]) per channel (the taps in order), over the weight transposed to
// [ks, C] so that the channel loop reads everything contiguously and vectorises. The SiLU uses exp_, as the training
// and prefill conv does (csrc/short_conv.cpp); the strided weight, the inner tap loop and glibc's scalar exp had kept
// the old loop scalar: flash-25m's 16 rows x 576 channels, warm, 1 thread, 43-57 -> ~8 us a call.
inline void conv_row(const float* __restrict s, const float* __restrict r, const float* __restrict wt,
                     float* __restrict y, int64_t P, int64_t C) {
  for (int64_t c = 0; c < C; ++c) y[c] = 0.f;
  for (int64_t t = 0; t < P; ++t)  // taps outermost: an inner loop over them had kept the channel loop scalar
    _Pragma("omp simd") for (int64_t c = 0; c < C; ++c) y[c] += s[t * C + c] * wt[t * C + c];
  _Pragma("omp simd") for (int64_t c = 0; c < C; ++c) {
    const float acc = y[c] + r[c] * wt[P * C + c];
    y[c] = acc / (1.f + glm_lightning_ops::exp_(-acc));  // SiLU
  }
}

at::Tensor conv_step_(at::Tensor conv_state, const at::Tensor& raw_in, const at::Tensor& weight_in) {
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous(), "conv_state must be a contiguous [B, ks-1, C]");
  TORCH_CHECK(conv_state.scalar_type() == at::kFloat && raw_in.scalar_type() == at::kFloat &&
                  weight_in.scalar_type() == at::kFloat, "fp32 only");
  const at::Tensor raw = raw_in.contiguous(), weight = weight_in.contiguous();
  const int64_t B = conv_state.size(0), P = conv_state.size(1), C = conv_state.size(2), ks = P + 1;
  TORCH_CHECK(raw.numel() == B * C, "raw must hold [B, C]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) == ks, "weight must be [C, ks]");
  at::Tensor y = at::empty({B, C}, raw.options());
  float* st = conv_state.data_ptr<float>();
  const float *r = raw.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* out = y.data_ptr<float>();
  std::vector<float> wt(ks * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t t = 0; t < ks; ++t) wt[t * C + c] = w[c * ks + t];
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* s = st + b * P * C;
      const float* rb = r + b * C;
      conv_row(s, rb, wt.data(), out + b * C, P, C);
      for (int64_t t = 0; t + 1 < P; ++t) std::copy(s + (t + 1) * C, s + (t + 2) * C, s + t * C);
      if (P > 0) std::copy(rb, rb + C, s + (P - 1) * C);
    }
  });
  return y;
}

// One (row, head): S [K, V] row-major; q, k, g [K]; v [V]; kS, e, o scratch/out [V]. `next` (nullable): the next
// head's state, prefetched row for row (for writing) during the first pass. Why: a [32 x 32] fp32 state is one 4 KB
// page, and the hardware's streaming prefetch stops at page ends, so every head began with its rows' misses (the
// states are cold: a decode step streams the model's weights between a layer's two uses). Intel Xeon (AVX-512), 1
// thread, 16 rows x 6 heads, states cold, CPU time, the forms in turns (benchmarks/bench_kda_delta_step.py): 77 ->
// 47-56 us a layer (two runs). Same arithmetic: bit for bit.
template <int64_t KK, int64_t VV>
inline void delta_head(float* __restrict S, const float* __restrict q, const float* __restrict k,
                       const float* __restrict v, const float* __restrict g, float beta, float* __restrict o,
                       float* __restrict e, int64_t K_, int64_t V_, const float* next) {
  const int64_t K = KK > 0 ? KK : K_, V = VV > 0 ? VV : V_;
  for (int64_t j = 0; j < V; ++j) e[j] = 0.f;
  for (int64_t i = 0; i < K; ++i) {  // S <- Diag(exp g) S and S^T k, row by row
    float* __restrict row = S + i * V;
    for (int64_t j = 0; next != nullptr && j < V; j += 16) __builtin_prefetch(next + i * V + j, 1, 3);
    const float d = std::exp(g[i]), ki = k[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= d;
      e[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    e[j] = (v[j] - e[j]) * beta;
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < K; ++i) {  // S += k e^T and o = S^T q
    float* __restrict row = S + i * V;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] += ki * e[j];
      o[j] += qi * row[j];
    }
  }
}

void check_heads(const at::Tensor& t, int64_t B, int64_t H, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == H && t.size(2) == n && t.stride(2) == 1,
              name, " must be [B, H, ", n, "] with a contiguous last dimension");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be fp32");
}

at::Tensor delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta_in, at::Tensor S) {
  TORCH_CHECK(S.dim() == 4 && S.is_contiguous() && S.scalar_type() == at::kFloat,
              "S must be a contiguous fp32 [B, H, K, V]");
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), V = S.size(3);
  check_heads(q, B, H, K, "q");
  check_heads(k, B, H, K, "k");
  check_heads(v, B, H, V, "v");
  check_heads(g, B, H, K, "g");
  const at::Tensor beta = beta_in.contiguous();
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.numel() == B * H, "beta must be fp32 [B, H]");
  at::Tensor o = at::empty({B, H, V}, S.options());
  float* s = S.data_ptr<float>();
  float* out = o.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
              *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  glm_lightning_ops::with_sizes(K, V, [&]<int64_t KK, int64_t VV>() {
    at::parallel_for(0, B * H, 8, [&](int64_t begin, int64_t end) {
      glm_lightning_ops::FlushDenormals ftz;  // repeated decays push state entries toward exp(-5 t)
      std::vector<float> e(V);
      for (int64_t m = begin; m < end; ++m) {
        const int64_t b = m / H, h = m % H;
        delta_head<KK, VV>(s + m * K * V, qp + b * q.stride(0) + h * q.stride(1),
                           kp + b * k.stride(0) + h * k.stride(1), vp + b * v.stride(0) + h * v.stride(1),
                           gp + b * g.stride(0) + h * g.stride(1), bp[m], out + m * V, e.data(), K, V,
                           m + 1 < end ? s + (m + 1) * K * V : nullptr);
      }
    });
  });
  return o;
}

at::Tensor kda_decode_core(const at::Tensor& raw, const at::Tensor& f, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& rescale, double lb, at::Tensor conv_state, const at::Tensor& conv_weight,
                           at::Tensor S, const at::Tensor& gate, const at::Tensor& norm_weight, double eps) {
  const auto& features = kda_decode_ops::features_op();
  const auto& head_norm = kda_decode_ops::head_norm_op();
  TORCH_CHECK(S.dim() == 4 && S.size(2) == S.size(3), "S must be [B, H, K, K]");
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2);
  TORCH_CHECK(raw.numel() == B * 3 * H * K, "raw must hold [B, 3HK] for S [B, H, K, K]");
  const at::Tensor y = conv_step_(conv_state, raw, conv_weight);  // [B, 3HK]
  auto [qk, g, beta] = features.call(y, f, b, A_log.exp(), rescale, lb);
  const at::Tensor qk3 = qk.view({B, 2 * H, K});
  const at::Tensor o = delta_step_(qk3.slice(1, 0, H), qk3.slice(1, H, 2 * H), y.view({B, 3 * H, K}).slice(1, 2 * H),
                                   g.view({B, H, K}), beta, S);  // [B, H, K]
  return head_norm.call(o, gate, norm_weight, eps).view({B, H * K});
}

}  // namespace

namespace kda_decode_ops {  // block_decode.cpp calls it as a C++ function (no dispatch per call)
const FeaturesOp& features_op() {
  static const FeaturesOp op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("glm_lightning::kda_features", "")
                                   .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double)>();
  return op;
}
const HeadNormOp& head_norm_op() {
  static const HeadNormOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("glm_lightning::gated_head_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op;
}
at::Tensor kda_decode_core(const at::Tensor& raw, const at::Tensor& f, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& rescale, double lb, at::Tensor conv_state, const at::Tensor& conv_weight,
                           at::Tensor S, const at::Tensor& gate, const at::Tensor& norm_weight, double eps) {
  return ::kda_decode_core(raw, f, b, A_log, rescale, lb, conv_state, conv_weight, S, gate, norm_weight, eps);
}
at::Tensor conv_step_(at::Tensor conv_state, const at::Tensor& raw, const at::Tensor& weight) {
  return ::conv_step_(conv_state, raw, weight);
}
at::Tensor delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, at::Tensor S) {
  return ::delta_step_(q, k, v, g, beta, S);
}
}  // namespace kda_decode_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("kda_decode_core(Tensor raw, Tensor f, Tensor b, Tensor A_log, Tensor rescale, float lb, "
        "Tensor(a!) conv_state, Tensor conv_weight, Tensor(b!) S, Tensor gate, Tensor norm_weight, float eps) -> Tensor");
  m.def("conv_step_(Tensor(a!) conv_state, Tensor raw, Tensor weight) -> Tensor");
  m.def("delta_step_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) S) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("conv_step_", &conv_step_);
  m.impl("delta_step_", &delta_step_);
  m.impl("kda_decode_core", &kda_decode_core);
}
