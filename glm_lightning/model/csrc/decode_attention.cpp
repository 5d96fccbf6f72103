// A DSA layer's decode step (one new query per row, glm_lightning/model/dsa.py) as three small CPU ops, fp32, no
// autograd: the lightning indexer's scores of the query against the cached indexer keys, the top-k selection of keys
// from them, and the attention of the query over its selected cached keys.
//
// Why: each was a batched matmul of [rows x heads] tiny products (e.g. 16 rows x 4 x 32 against ~100 keys), which
// BLAS runs as one small GEMM per row at ~47 us a call (1 thread), plus 4-5 elementwise passes; a decode step of
// flash-25m runs 3 of them per DSA layer. Here each (row, head) is a few dot products in L1.
//
//   index_scores_one(q [B, HI, DI], w [B, HI], k [B, S, DI]) -> I [B, S]
//       I[b, s] = sum_j w[b, j] ReLU(q[b, j] . k[b, s])                    (heads summed in order)
//   topk_mask_one(scores [B, S], allowed [B, S] bool, top_k) -> mask [B, S] bool
//       dsa.topk_mask then dsa._fill_empty_rows for one query at position S - 1, exactly: the keys above the k-th
//       largest allowed score, then the earliest keys tied with it, allowed and finite; a NaN among the allowed scores
//       selects nothing (as torch.topk ranks NaN first and amin propagates it); a row left empty keeps key S - 1.
//       Why: ~14 tiny ATen ops and ~8 more for the fill, ~135 us a DSA layer's step (2 threads).
//   single_query_attention(q [B, H, D], k [B, Hkv, S, D], v [B, Hkv, S, D], mask [B, S] bool, scale) -> [B, H, D]
//       softmax over the keys with mask[b, s] of scale q[b, h] . k[b, h / (H / Hkv), s], times v; a row without keys
//       gives zeros (the caller always leaves one)
//
// k and v may be strided slices of the cache buffers (only their last dim must be contiguous).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "kernel_helpers.h"

namespace {

using glm_lightning_ops::dot_;
using glm_lightning_ops::exp_;
using glm_lightning_ops::Lanes;
using Vec = Lanes<float>::Vec;

void check_keys(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be fp32 on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dim must be contiguous");
}

// Keys per `dots` call: one lane sum each, reduced together by one Lanes::sums16 (16 on AVX-512, 8 on AVX2, 4 on
// SSE / NEON).
constexpr int64_t kKeys = glm_lightning_ops::kLanes;

// out[i] = q . key_i for the n (<= kKeys) rows key_i = k + i * stride, each D floats: their lane sums reduced
// together (Lanes::sums16) when D is a multiple of kLanes, else one dot_ per key. No software prefetch of the keys
// the next call reads: see single_query_attention.
inline void dots(const float* __restrict q, const float* __restrict k, int64_t stride, int64_t D, int64_t n,
                 float* __restrict out) {
  using L = Lanes<float>;
  if (D % L::N != 0) {
    for (int64_t i = 0; i < n; ++i) out[i] = dot_(q, k + i * stride, D);
    return;
  }
  Vec acc[kKeys];
  for (int i = 0; i < kKeys; ++i) acc[i] = Vec{};
  for (int64_t d = 0; d < D; d += L::N) {
    const Vec qv = L::load(q + d);
    for (int64_t i = 0; i < n; ++i) acc[i] += qv * L::load(k + i * stride + d);
  }
  float all[kKeys];
  L::store(all, L::sums16(acc));
  for (int64_t i = 0; i < n; ++i) out[i] = all[i];
}

at::Tensor index_scores_one(const at::Tensor& q_in, const at::Tensor& w_in, const at::Tensor& k) {
  TORCH_CHECK(q_in.dim() == 3 && w_in.dim() == 2 && k.dim() == 3, "expected q [B, HI, DI], w [B, HI], k [B, S, DI]");
  const int64_t B = q_in.size(0), HI = q_in.size(1), DI = q_in.size(2), S = k.size(1);
  TORCH_CHECK(w_in.size(0) == B && w_in.size(1) == HI && k.size(0) == B && k.size(2) == DI, "shapes disagree");
  check_keys(q_in, "q");
  check_keys(w_in, "w");
  check_keys(k, "k");
  const at::Tensor q = q_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::zeros({B, S}, q.options());
  const float *qp = q.data_ptr<float>(), *wp = w.data_ptr<float>(), *kp = k.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), ks = k.stride(1);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    float d[kKeys];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t s0 = 0; s0 < S; s0 += kKeys) {
        const int64_t n = std::min<int64_t>(kKeys, S - s0);
        float* o = op + b * S + s0;
        for (int64_t j = 0; j < HI; ++j) {  // heads summed in order (no software prefetch: single_query_attention)
          dots(qp + (b * HI + j) * DI, kp + b * kb + s0 * ks, ks, DI, n, d);
          const float wj = wp[b * HI + j];
          for (int64_t i = 0; i < n; ++i) o[i] += wj * std::max(0.f, d[i]);
        }
      }
  });
  return out;
}

// o[d] += sum_s p[s] v_s[d] over the keys with p[s] != 0, in key order (rows v_s = v + s * vs), with NV vectors of o
// in registers across the keys: D = NV lanes.
template <int NV>
inline void weighted_values_in_registers(const float* __restrict p, const float* __restrict v, int64_t vs, int64_t S,
                                         float* __restrict o) {
  using L = Lanes<float>;
  Vec acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = L::load(o + j * L::N);
  for (int64_t s = 0; s < S; ++s)
    if (p[s] != 0.f)
      for (int j = 0; j < NV; ++j) acc[j] += p[s] * L::load(v + s * vs + j * L::N);
  for (int j = 0; j < NV; ++j) L::store(o + j * L::N, acc[j]);
}

// The attention's weighted sum of values. Why registers: summed in place in o, each key's multiply-add waited on the
// previous key's store to o (a store-to-load chain per key); the same multiply-adds in the same order on registers
// are the same values.
inline void weighted_values(const float* p, const float* v, int64_t vs, int64_t S, int64_t D, float* o) {
  constexpr int64_t N = Lanes<float>::N;
  if (D == N) return weighted_values_in_registers<1>(p, v, vs, S, o);
  if (D == 2 * N) return weighted_values_in_registers<2>(p, v, vs, S, o);
  if (D == 4 * N) return weighted_values_in_registers<4>(p, v, vs, S, o);
  for (int64_t s = 0; s < S; ++s)
    if (p[s] != 0.f) {
      const float e = p[s];
      const float* __restrict val = v + s * vs;
      _Pragma("omp simd") for (int64_t d = 0; d < D; ++d) o[d] += e * val[d];
    }
}

at::Tensor single_query_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && mask_in.dim() == 2,
              "expected q [B, H, D], k and v [B, Hkv, S, D], mask [B, S]");
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(2), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0, "shapes disagree");
  TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.size(0) == B && mask_in.size(1) == S,
              "mask must be bool [B, S]");
  check_keys(q_in, "q");
  check_keys(k, "k");
  check_keys(v, "v");
  const at::Tensor q = q_in.contiguous(), mask = mask_in.contiguous();
  at::Tensor out = at::zeros({B, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv, kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  const float sc = static_cast<float>(scale), ninf = -std::numeric_limits<float>::infinity();
  // No software prefetch of the next query's keys and values: a (row, head)'s keys are one contiguous run of S x D
  // floats, which the hardware prefetchers follow, and the prefetch instructions (two per key, nontemporal) were
  // where the kernel waited. With them gone and the values' sum in registers (weighted_values), Intel Xeon (AVX-512),
  // 1 thread, 16 rows x 6 heads of 32, strided cache slices, CPU time, the forms in turns
  // (benchmarks/bench_decode_attention.py): 48 keys 122 -> 69 us, 80 keys 292 -> 122 us, 160 keys 593 -> 186 us;
  // the PyTorch form (two bmm, masked softmax) 152, 227, 331 us.
  at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(S);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, g = (r % H) / G;
      const bool* m = mp + b * S;
      for (int64_t s0 = 0; s0 < S; s0 += kKeys)  // logits of every key, then the masked ones set to -inf
        dots(qp + r * D, kp + b * kb + g * kh + s0 * ks, ks, D, std::min<int64_t>(kKeys, S - s0), p.data() + s0);
      float top = ninf;
      for (int64_t s = 0; s < S; ++s) {
        p[s] = m[s] ? sc * p[s] : ninf;
        top = std::max(top, p[s]);
      }
      if (top == ninf) continue;  // no key: zeros
      float total = 0.f;
      float* __restrict pp = p.data();
      _Pragma("omp simd reduction(+ : total)") for (int64_t s = 0; s < S; ++s) {
        pp[s] = exp_(pp[s] - top);  // exp_(-inf) = 0
        total += pp[s];
      }
      float* __restrict o = op + r * D;
      weighted_values(pp, vp + b * vb + g * vh, vs, S, D, o);
      const float inv = 1.f / total;
      _Pragma("omp simd") for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

at::Tensor topk_mask_one(const at::Tensor& scores_in, const at::Tensor& allowed, int64_t top_k) {
  TORCH_CHECK(scores_in.dim() == 2, "scores must be [B, S]");
  check_keys(scores_in, "scores");
  TORCH_CHECK(allowed.dim() == 2 && allowed.scalar_type() == at::kBool && allowed.size(0) == scores_in.size(0) &&
                  allowed.size(1) == scores_in.size(1) && allowed.stride(1) == 1,
              "allowed must be bool [B, S] with contiguous rows");
  TORCH_CHECK(top_k >= 1, "top_k must be >= 1");
  const at::Tensor scores = scores_in.contiguous();
  const int64_t B = scores.size(0), S = scores.size(1), k = std::min(top_k, S), as = allowed.stride(0);
  at::Tensor out = at::zeros({B, S}, allowed.options());
  if (S == 0) return out;
  const float* sp = scores.data_ptr<float>();
  const bool* ap = allowed.data_ptr<bool>();
  bool* op = out.data_ptr<bool>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> vals(S), sorted(S);
    for (int64_t b = begin; b < end; ++b) {
      const float* sc = sp + b * S;
      const bool* al = ap + b * as;
      bool* o = op + b * S;
      bool nan = false;
      for (int64_t s = 0; s < S; ++s) {
        vals[s] = al[s] ? sc[s] : ninf;
        nan = nan || std::isnan(vals[s]);
      }
      bool any = false;
      if (!nan) {  // with a NaN the k-th value is NaN: nothing compares above or equal to it
        sorted = vals;
        std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
        const float kth = sorted[k - 1];
        int64_t n_free = k;
        for (int64_t s = 0; s < S; ++s) n_free -= vals[s] > kth;
        int64_t ties = 0;
        for (int64_t s = 0; s < S; ++s) {
          ties += vals[s] == kth;
          const bool keep = vals[s] > kth || (vals[s] == kth && ties <= n_free);
          o[s] = keep && al[s] && std::isfinite(vals[s]);
          any = any || o[s];
        }
      }
      if (!any) o[S - 1] = true;  // _fill_empty_rows: the query's own slot
    }
  });
  return out;
}

}  // namespace

namespace decode_attention_ops {  // block_decode.cpp calls them as C++ functions (no dispatch per call)
at::Tensor index_scores_one(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k) {
  return ::index_scores_one(q, w, k);
}
at::Tensor topk_mask_one(const at::Tensor& scores, const at::Tensor& allowed, int64_t top_k) {
  return ::topk_mask_one(scores, allowed, top_k);
}
at::Tensor single_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask, double scale) {
  return ::single_query_attention(q, k, v, mask, scale);
}
}  // namespace decode_attention_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("index_scores_one(Tensor q, Tensor w, Tensor k) -> Tensor");
  m.def("topk_mask_one(Tensor scores, Tensor allowed, int top_k) -> Tensor");
  m.def("single_query_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("index_scores_one", &index_scores_one);
  m.impl("topk_mask_one", &topk_mask_one);
  m.impl("single_query_attention", &single_query_attention);
}
