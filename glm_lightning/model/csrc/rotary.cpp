// RoPE (half-split layout, partial: the first d_rot channels) at one position for every row, as one CPU op: a decode
// step's rotation (glm_lightning/model/rope.py, apply_rotary). Why: the eager form is ~14 dispatched ops per call from
// Python (slices, chunk, neg, cat, two products, a sum, the cat of the pass-through channels); a DSA layer's decode
// step rotates the indexer's query and key (flash-25m: 204 ops per step for 3 layers).
//
//   rotary_one(x [..., D] contiguous, cos [d_rot], sin [d_rot]) -> [..., D]
//       out[i] = x[i] cos[i] + r[i] sin[i] for i < d_rot, r = [-x[h:d_rot], x[:h]] (h = d_rot / 2); out[i] = x[i]
//       after. The two products are rounded before their sum, as the eager form's separate ops round them: no
//       contraction into an fma, so the values are the eager form's bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_rows(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                 float* __restrict out, int64_t rows, int64_t D, int64_t d_rot) {
  const int64_t h = d_rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    for (int64_t i = 0; i < h; ++i) {
      const float a = xr[i] * c[i], b = -xr[i + h] * s[i];
      o[i] = a + b;
    }
    for (int64_t i = h; i < d_rot; ++i) {
      const float a = xr[i] * c[i], b = xr[i - h] * s[i];
      o[i] = a + b;
    }
    for (int64_t i = d_rot; i < D; ++i) o[i] = xr[i];
  }
}
#pragma GCC pop_options

at::Tensor rotary_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_one: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous(), "x must be a contiguous CPU [..., D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel(),
              "cos and sin: contiguous, one position's [d_rot]");
  const int64_t D = x.size(-1), d_rot = cos.numel();
  TORCH_CHECK(d_rot % 2 == 0 && d_rot <= D, "d_rot must be even and at most D");
  at::Tensor out = at::empty(x.sizes(), x.options());
  rotate_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(),
              D ? x.numel() / D : 0, D, d_rot);
  return out;
}

}  // namespace

namespace rotary_ops {  // block_decode.cpp calls it as a C++ function (no dispatch per call)
at::Tensor rotary_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return ::rotary_one(x, cos, sin);
}
}  // namespace rotary_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("rotary_one(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("rotary_one", &rotary_one);
}
