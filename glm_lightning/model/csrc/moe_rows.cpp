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
//   rows_scatter_dot(dy [N, d], y [R, d], slot, K, scale) -> (rows_scatter(dy, slot, K, scale, R),
//                                                             rows_dot(dy, y, slot, K))    (the backward's first pass)
// fp32, fp64 and bf16 (bf16-mixed training: fp32 math, each output rounded to bf16 once); src / a / b contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

// No multiply-add contraction here: a token's sum is then round(w0 y0) + round(w1 y1), bit for bit what the eager
// index_add_ of the products gives (GCC contracts into FMAs by default, which moved outputs by ~2e-7).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace moe_rows {  // named: the unity build puts every source in one translation unit

using glm_lightning_ops::Acc;
using glm_lightning_ops::widen;
using glm_lightning_ops::narrow;

void check(const at::Tensor& x, const at::Tensor& slot, int64_t K, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": rows must be a contiguous [rows, d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kBFloat16,
              name, ": fp32, fp64 or bf16 only");
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

// Zeros the rows of out [R, d] that no slot names (the padding), where at::zeros wrote all R rows and the scatter then
// wrote the named ones again; a slot out of range is left for the scatter's check.
void zero_unnamed_rows(at::Tensor& out, const at::Tensor& slot) {
  const int64_t R = out.size(0), F = slot.numel();
  const int64_t row_bytes = out.size(1) * out.element_size();
  std::vector<uint8_t> named(R, 0);
  const int64_t* sl = slot.data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f)
    if (sl[f] >= 0 && sl[f] < R) named[sl[f]] = 1;
  char* base = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < R; ++r)
    if (!named[r]) std::memset(base + r * row_bytes, 0, row_bytes);
}

at::Tensor rows_scatter(const at::Tensor& src, const at::Tensor& slot, int64_t K, const std::optional<at::Tensor>& scale,
                        int64_t R) {
  check(src, slot, K, "rows_scatter");
  const int64_t F = slot.numel(), d = src.size(1);
  TORCH_CHECK(F == src.size(0) * K, "rows_scatter: slot must be [N * K] for src [N, d]");
  const at::Tensor* sc = weights(scale, src, F, "rows_scatter");
  at::Tensor out = at::empty({R, d}, src.options());
  zero_unnamed_rows(out, slot);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, src.scalar_type(), "rows_scatter", [&] {
    using S = scalar_t;
    using T = Acc<S>;
    const S* s = src.data_ptr<S>();
    const S* w = sc ? sc->data_ptr<S>() : nullptr;
    const int64_t* sl = slot.data_ptr<int64_t>();
    S* o = out.data_ptr<S>();
    at::parallel_for(0, F, 64, [&](int64_t b, int64_t e) {
      for (int64_t f = b; f < e; ++f) {
        const int64_t r = sl[f];
        TORCH_CHECK(r >= 0 && r < R, "rows_scatter: slot out of range");
        const S* x = s + (f / K) * d;
        S* y = o + r * d;
        if (!w) {
          std::copy(x, x + d, y);
          continue;
        }
        const T g = widen(w[f]);
        for (int64_t c = 0; c < d; ++c) y[c] = narrow<S>(g * widen(x[c]));
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, src.scalar_type(), "rows_gather_sum", [&] {
    using S = scalar_t;
    using T = Acc<S>;
    const S* s = src.data_ptr<S>();
    const S* w = wt ? wt->data_ptr<S>() : nullptr;
    const int64_t* sl = slot.data_ptr<int64_t>();
    S* o = out.data_ptr<S>();
    at::parallel_for(0, N, 32, [&](int64_t b, int64_t e) {
      std::vector<T> acc(d);  // the row's sum in T (fp32 for bf16 rows), stored once
      for (int64_t n = b; n < e; ++n) {
        T* y = acc.data();
        for (int64_t k = 0; k < K; ++k) {  // k in order: the first term is written, the others added
          const int64_t f = n * K + k, r = sl[f];
          TORCH_CHECK(r >= 0 && r < R, "rows_gather_sum: slot out of range");
          const S* x = s + r * d;
          const T g = w ? widen(w[f]) : T(1);
          if (k == 0)
            for (int64_t c = 0; c < d; ++c) y[c] = g * widen(x[c]);
          else
            for (int64_t c = 0; c < d; ++c) y[c] += g * widen(x[c]);
        }
        S* out_row = o + n * d;
        for (int64_t c = 0; c < d; ++c) out_row[c] = narrow<S>(y[c]);
      }
    });
  });
  return out;
}

// <x, y> over d elements in Acc<S>: eight partial sums (the loop vectorises without reassociating one chain), summed
// as a fixed tree, then the tail.
template <typename S>
inline Acc<S> row_dot(const S* x, const S* y, int64_t d) {
  using T = Acc<S>;
  T acc[8] = {};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8)
    for (int u = 0; u < 8; ++u) acc[u] += widen(x[c + u]) * widen(y[c + u]);
  T sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; c < d; ++c) sum += widen(x[c]) * widen(y[c]);
  return sum;
}

at::Tensor rows_dot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot, int64_t K) {
  check(a, slot, K, "rows_dot");
  check(b, slot, K, "rows_dot");
  const int64_t F = slot.numel(), d = a.size(1), R = b.size(0);
  TORCH_CHECK(F == a.size(0) * K && b.size(1) == d && b.scalar_type() == a.scalar_type(),
              "rows_dot: a [N, d], b [R, d] of one dtype, slot [N * K]");
  at::Tensor out = at::empty({F}, a.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, a.scalar_type(), "rows_dot", [&] {
    using S = scalar_t;
    using T = Acc<S>;
    const S *pa = a.data_ptr<S>(), *pb = b.data_ptr<S>();
    const int64_t* sl = slot.data_ptr<int64_t>();
    S* o = out.data_ptr<S>();
    at::parallel_for(0, F, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t f = lo; f < hi; ++f) {
        const int64_t r = sl[f];
        TORCH_CHECK(r >= 0 && r < R, "rows_dot: slot out of range");
        o[f] = narrow<S>(row_dot(pa + (f / K) * d, pb + r * d, d));
      }
    });
  });
  return out;
}

// rows_dot(dy, y, slot, K) and rows_scatter(dy, slot, K, scale, R) of the experts' backward in one pass: both walk
// the slots in token order reading dy's rows, the first also reading row slot[f] of y, the second writing row slot[f]
// of its output; fused, dy is read once and each slot's two rows are touched together (values bit for bit the two
// ops': the same products and sums per element).
std::tuple<at::Tensor, at::Tensor> rows_scatter_dot(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& slot,
                                                    int64_t K, const at::Tensor& scale) {
  check(dy, slot, K, "rows_scatter_dot");
  check(y, slot, K, "rows_scatter_dot");
  const int64_t F = slot.numel(), d = dy.size(1), R = y.size(0);
  TORCH_CHECK(F == dy.size(0) * K && y.size(1) == d && y.scalar_type() == dy.scalar_type(),
              "rows_scatter_dot: dy [N, d], y [R, d] of one dtype, slot [N * K]");
  TORCH_CHECK(scale.numel() == F && scale.is_contiguous() && scale.scalar_type() == dy.scalar_type(),
              "rows_scatter_dot: the scales must be contiguous, one per slot, of the rows' dtype");
  at::Tensor out = at::empty({R, d}, dy.options()), dots = at::empty({F}, dy.options());
  zero_unnamed_rows(out, slot);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dy.scalar_type(), "rows_scatter_dot", [&] {
    using S = scalar_t;
    using T = Acc<S>;
    const S *pd = dy.data_ptr<S>(), *py = y.data_ptr<S>(), *w = scale.data_ptr<S>();
    const int64_t* sl = slot.data_ptr<int64_t>();
    S *o = out.data_ptr<S>(), *dt = dots.data_ptr<S>();
    at::parallel_for(0, F, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t f = lo; f < hi; ++f) {
        const int64_t r = sl[f];
        TORCH_CHECK(r >= 0 && r < R, "rows_scatter_dot: slot out of range");
        const S* x = pd + (f / K) * d;
        dt[f] = narrow<S>(row_dot(x, py + r * d, d));
        const T g = widen(w[f]);
        S* z = o + r * d;
        for (int64_t c = 0; c < d; ++c) z[c] = narrow<S>(g * widen(x[c]));
      }
    });
  });
  return {out, dots};
}

}  // namespace moe_rows

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("rows_scatter(Tensor src, Tensor slot, int K, Tensor? scale, int R) -> Tensor");
  m.def("rows_gather_sum(Tensor src, Tensor slot, int K, Tensor? weight) -> Tensor");
  m.def("rows_dot(Tensor a, Tensor b, Tensor slot, int K) -> Tensor");
  m.def("rows_scatter_dot(Tensor dy, Tensor y, Tensor slot, int K, Tensor scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("rows_scatter", &moe_rows::rows_scatter);
  m.impl("rows_gather_sum", &moe_rows::rows_gather_sum);
  m.impl("rows_dot", &moe_rows::rows_dot);
  m.impl("rows_scatter_dot", &moe_rows::rows_scatter_dot);
}
