// The row moves of the MoE's padded grouped GEMM (glm_lightning/model/moe.py, _GroupedExperts) as three CPU ops, one
// pass each, addressed by `slot` [N * K]: the padded row of token n's k-th choice at index n * K + k (token order, so
// no sort permutation is needed to find a token's rows).
//
// Why: eager, each move was three or four passes (index_select, index_copy_ into zeros, a gate product, index_add_
// into zeros, a product and a row sum), each over [N * K, d].
//
//   rows_scatter(src [N, d], slot [N*K], K, scale [N*K] or None, R) -> out [R, d]
//       out[slot[f]] = scale[f] * src[f / K]; rows no slot names are zero      (the experts' input; dy * gate)
//   rows_gather_sum(src [R, d], slot [N*K], K, weight [N*K] or None) -> out [N, d]
//       out[n] = sum_k weight[n K + k] * src[slot[n K + k]]                      (the gated combine; dx)
//   rows_dot(a [N, d], b [R, d], slot [N*K], K) -> out [N*K]
//       out[f] = <a[f / K], b[slot[f]]>                                           (the gates' gradient)
// fp32 and fp64; src / a / b contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

// No multiply-add contraction here: a token's sum is then round(w0 y0) + round(w1 y1), bit for bit what the eager
// index_add_ of the products gives (GCC contracts into FMAs by default, which moved outputs by ~2e-7).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace moe_rows {  // named: the unity build puts every source in one translation unit

void check(const at::Tensor& x, const at::Tensor& slot, int64_t K, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": rows must be a contiguous [rows, d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, name, ": fp32 or fp64 only");
  TORCH_CHECK(slot.dim() == 1 && slot.scalar_type() == at::kLong && slot.is_contiguous(),
              name, ": slot must be a contiguous int64 [N * K]");
  TORCH_CHECK(K >= 1 && slot.numel() % K == 0, name, ": slot must hold K entries per token");
}

const at::Tensor* weights(const std::optional<at::Tensor>& w, const at::Tensor& x, int64_t n, const char* name) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->numel() == n && w->is_contiguous() && w->scalar_type() == x.scalar_type(),
              name, ": the weights must be contiguous, one per slot, of the rows' dtype");
  return &*w;
}

at::Tensor rows_scatter(const at::Tensor& src, const at::Tensor& slot, int64_t K, const std::optional<at::Tensor>& scale,
                        int64_t R) {
  check(src, slot, K, "rows_scatter");
  const int64_t F = slot.numel(), d = src.size(1);
  TORCH_CHECK(F == src.size(0) * K, "rows_scatter: slot must be [N * K] for src [N, d]");
  const at::Tensor* sc = weights(scale, src, F, "rows_scatter");
  at::Tensor out = at::zeros({R, d}, src.options());
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "rows_scatter", [&] {
    using T = scalar_t;
    const T* s = src.data_ptr<T>();
    const T* w = sc ? sc->data_ptr<T>() : nullptr;
    const int64_t* sl = slot.data_ptr<int64_t>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, F, 64, [&](int64_t b, int64_t e) {
      for (int64_t f = b; f < e; ++f) {
        const int64_t r = sl[f];
        TORCH_CHECK(r >= 0 && r < R, "rows_scatter: slot out of range");
        const T* x = s + (f / K) * d;
        T* y = o + r * d;
        const T g = w ? w[f] : T(1);
        for (int64_t c = 0; c < d; ++c) y[c] = g * x[c];
      }
    });
  });
  return out;
}

at::Tensor rows_gather_sum(const at::Tensor& src, const at::Tensor& slot, int64_t K,
                           const std::optional<at::Tensor>& weight) {
  check(src, slot, K, "rows_gather_sum");
  const int64_t F = slot.numel(), N = F / K, d = src.size(1), R = src.size(0);
  const at::Tensor* wt = weights(weight, src, F, "rows_gather_sum");
  at::Tensor out = at::empty({N, d}, src.options());
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "rows_gather_sum", [&] {
    using T = scalar_t;
    const T* s = src.data_ptr<T>();
    const T* w = wt ? wt->data_ptr<T>() : nullptr;
    const int64_t* sl = slot.data_ptr<int64_t>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, N, 32, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        T* y = o + n * d;
        for (int64_t k = 0; k < K; ++k) {  // k in order: the first term is written, the others added
          const int64_t f = n * K + k, r = sl[f];
          TORCH_CHECK(r >= 0 && r < R, "rows_gather_sum: slot out of range");
          const T* x = s + r * d;
          const T g = w ? w[f] : T(1);
          if (k == 0)
            for (int64_t c = 0; c < d; ++c) y[c] = g * x[c];
          else
            for (int64_t c = 0; c < d; ++c) y[c] += g * x[c];
        }
      }
    });
  });
  return out;
}

at::Tensor rows_dot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot, int64_t K) {
  check(a, slot, K, "rows_dot");
  check(b, slot, K, "rows_dot");
  const int64_t F = slot.numel(), d = a.size(1), R = b.size(0);
  TORCH_CHECK(F == a.size(0) * K && b.size(1) == d && b.scalar_type() == a.scalar_type(),
              "rows_dot: a [N, d], b [R, d] of one dtype, slot [N * K]");
  at::Tensor out = at::empty({F}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "rows_dot", [&] {
    using T = scalar_t;
    const T *pa = a.data_ptr<T>(), *pb = b.data_ptr<T>();
    const int64_t* sl = slot.data_ptr<int64_t>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, F, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t f = lo; f < hi; ++f) {
        const int64_t r = sl[f];
        TORCH_CHECK(r >= 0 && r < R, "rows_dot: slot out of range");
        const T *x = pa + (f / K) * d, *y = pb + r * d;
        T acc[8] = {};  // eight partial sums: the loop vectorises without reassociating one chain
        int64_t c = 0;
        for (; c + 8 <= d; c += 8)
          for (int u = 0; u < 8; ++u) acc[u] += x[c + u] * y[c + u];
        T sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; c < d; ++c) sum += x[c] * y[c];
        o[f] = sum;
      }
    });
  });
  return out;
}

}  // namespace moe_rows

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("rows_scatter(Tensor src, Tensor slot, int K, Tensor? scale, int R) -> Tensor");
  m.def("rows_gather_sum(Tensor src, Tensor slot, int K, Tensor? weight) -> Tensor");
  m.def("rows_dot(Tensor a, Tensor b, Tensor slot, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("rows_scatter", &moe_rows::rows_scatter);
  m.impl("rows_gather_sum", &moe_rows::rows_gather_sum);
  m.impl("rows_dot", &moe_rows::rows_dot);
}
