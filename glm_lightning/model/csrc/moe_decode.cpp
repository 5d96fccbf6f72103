// A cached fp32 decode step's MoE layer (glm_lightning/model/moe.py) as one op.
//
// Why: a decode step is bound by Python and dispatch. Its MoE layer was ~10 dispatched ops with Python between them
// (router linear, sigmoid, routing, counts to a list, row scatter, two expert matmuls, SwiGLU, gated sum, the shared
// expert's two linears and SwiGLU, the sum), each a few microseconds of work. Here the same kernels run in the same
// order as C++ function calls (panel_matmul.cpp, moe_route.cpp, moe_rows.cpp), so the values are those of the
// general path bit for bit (tests/test_moe_decode.py).
//
//   moe_decode(x [N, d], router [E panels], E, bias [E], K, scale, gate_up [E, 2h panels], h2, down [E, d panels],
//              shared_gate_up [2hs panels] or None, hs2, shared_down [d panels] or None) -> y [N, d]
//   s = sigmoid(x Wr^T); (w, idx, counts, slot) = route(s, bias, K, scale);
//   y = sum_k w_k W_down[e] SwiGLU(W_gate_up[e] x) + W_sd SwiGLU(W_sgu x)
// The weights are panel_pack's panels (fp32 or bf16); x fp32.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_helpers.h"

// The kernels this op calls, defined in their own sources (one library, several translation units).
namespace panel_ops {
at::Tensor panel_matmul(const at::Tensor& x_in, const at::Tensor& P_in, int64_t out,
                        const std::optional<at::Tensor>& counts_in, const std::optional<at::Tensor>& bias_in);
}
namespace moe_route_ops {
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(
    const at::Tensor& s_in, const at::Tensor& bias_in, int64_t K, double scale, int64_t B, double alpha);
}
namespace moe_rows {
at::Tensor rows_scatter(const at::Tensor& src, const at::Tensor& slot, int64_t K, const std::optional<at::Tensor>& scale,
                        int64_t R);
at::Tensor rows_gather_sum(const at::Tensor& src, const at::Tensor& slot, int64_t K,
                           const std::optional<at::Tensor>& weight);
}  // namespace moe_rows

namespace moe_decode_ops {

// a = SiLU(gate) * up over rows of hgu [.., 2h] = [gate | up]: swiglu.cpp's fp32 forward, the same expression (so the
// same values; a decode step's few rows need no parallel loop). counts (nullable, with hgu [E, cap, 2h]): only each
// expert's first counts[e] rows, the real ones: the padding rows of a are left unwritten, as the down projection
// (panel_matmul over the same counts) and the gathered sum (the real rows' slots) never read them (16 rows x top-2
// over 8 experts fill about half of E x cap).
at::Tensor swiglu_rows(const at::Tensor& hgu, const int64_t* counts) {
  const int64_t h = hgu.size(-1) / 2, rows = hgu.numel() / (2 * h);
  const int64_t E = counts == nullptr ? 1 : hgu.size(0), cap = rows / E;
  std::vector<int64_t> shape(hgu.sizes().begin(), hgu.sizes().end());
  shape.back() = h;
  at::Tensor a = at::empty(shape, hgu.options());
  const float* hp = hgu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = e * cap; r < e * cap + (counts == nullptr ? cap : counts[e]); ++r) {
      const float *g = hp + r * 2 * h, *u = g + h;
      float* ar = ap + r * h;
      for (int64_t c = 0; c < h; ++c) ar[c] = g[c] / (1.f + glm_lightning_ops::exp_(-g[c])) * u[c];
    }
  return a;
}

at::Tensor moe_decode(const at::Tensor& x_in, const at::Tensor& router, int64_t E, const at::Tensor& bias, int64_t K,
                      double scale, const at::Tensor& gate_up, int64_t h2, const at::Tensor& down,
                      const std::optional<at::Tensor>& shared_gate_up, int64_t hs2,
                      const std::optional<at::Tensor>& shared_down) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) > 0 && x_in.scalar_type() == at::kFloat, "x must be fp32 [N > 0, d]");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "both shared expert weights or neither");
  const at::Tensor x = x_in.contiguous();
  const int64_t d = x.size(1);
  at::Tensor s = panel_ops::panel_matmul(x, router, E, std::nullopt, std::nullopt);
  s.sigmoid_();  // torch.sigmoid's kernel (in place: the same values)
  const auto [w, aux, idx, counts, pos, slot, coef] = moe_route_ops::moe_route(s, bias, K, scale, 1, 0.0);
  const int64_t* np = counts.data_ptr<int64_t>();
  int64_t cap = 0;
  for (int64_t e = 0; e < E; ++e) cap = std::max(cap, np[e]);
  const at::Tensor xs = moe_rows::rows_scatter(x, slot, K, std::nullopt, E * cap).view({E, cap, d});
  const at::Tensor a = swiglu_rows(panel_ops::panel_matmul(xs, gate_up, h2, counts, std::nullopt), np);
  const at::Tensor y_pad = panel_ops::panel_matmul(a, down, d, counts, std::nullopt).view({E * cap, d});
  at::Tensor y = moe_rows::rows_gather_sum(y_pad, slot, K, w);
  if (shared_gate_up.has_value()) {
    const at::Tensor a_s =
        swiglu_rows(panel_ops::panel_matmul(x, *shared_gate_up, hs2, std::nullopt, std::nullopt), nullptr);
    const at::Tensor ys = panel_ops::panel_matmul(a_s, *shared_down, d, std::nullopt, std::nullopt);
    float* yp = y.data_ptr<float>();
    const float* sp = ys.data_ptr<float>();
    for (int64_t i = 0; i < y.numel(); ++i) yp[i] = yp[i] + sp[i];
  }
  return y;
}

}  // namespace moe_decode_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("moe_decode(Tensor x, Tensor router, int E, Tensor bias, int K, float scale, Tensor gate_up, int h2, "
        "Tensor down, Tensor? shared_gate_up, int hs2, Tensor? shared_down) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) { m.impl("moe_decode", &moe_decode_ops::moe_decode); }
