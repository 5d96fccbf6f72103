// The MoE's routing after the router's sigmoid (glm_lightning/model/moe.py: MoE.route, _balance_loss and the
// assignment rows of _dispatch) as two CPU ops, one pass over the tokens each way.
//
// moe_route(s [N, E], bias [E], K, scale, B, alpha) -> (w [N, K], aux [], idx [N, K], counts [E], pos [N K],
//                                                       slot [N K], coef [B, E])
//   idx[n]  = the K experts of largest s[n] + bias (selection only), in descending order
//   w[n, k] = scale * s[n, idx_k] / sum_k' s[n, idx_k']   (K > 1; scale * s[n, idx_0] for K = 1)
//   counts  = assignments per expert; pos[n K + k] = the row of token n's k-th choice among the assignments sorted
//             stably by expert; slot = its row in the zero-padded [E, cap] batch (e cap + its rank in expert e),
//             cap = max(counts)
//   aux     = sum_{n, e} s[n, e] / S_n * coef[b(n), e],  S_n = sum_e s[n, e],  coef[b, e] = alpha / (B T) *
//             E / (K T) * #{t : e in idx of token (b, t)}   (DeepSeek-V3's sequence-wise balance loss; alpha = 0: none)
// moe_route_backward(dw [N, K], daux [], s, idx, coef, scale) -> ds [N, E]:
//   ds[n, e]      = daux (coef[b(n), e] / S_n - <s[n], coef[b(n)]> / S_n^2)
//   ds[n, idx_j] += scale (dw_j / U - sum_k dw_k u_k / U^2),  u_k = s[n, idx_k], U = sum_k u_k   (K > 1)
//
// Why: as ATen ops the routing, the balance loss and the assignment rows were ~45 dispatched ops per MoE layer forward
// and ~20 backward, each over a few thousand numbers. The gates are the same arithmetic as the eager route (for
// K = 2, where the order of the two chosen experts cannot change a sum, bit for bit); the selection compares the same
// sums s + bias. Ties between experts are broken toward the lower index.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// (S_n, <s[n], coef[b(n)]>) of one token's scores: the balance loss's two sums, forward and backward alike.
template <typename T>
std::pair<T, T> balance_sums(const T* sn, const T* cb, int64_t E) {
  T S = 0, dot = 0;
  for (int64_t e = 0; e < E; ++e) {
    S += sn[e];
    dot += sn[e] * cb[e];
  }
  return {S, dot};
}

}  // namespace

namespace moe_route_ops {  // named: moe_decode.cpp calls it as a C++ function (no dispatch per call)

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(
    const at::Tensor& s_in, const at::Tensor& bias_in, int64_t K, double scale, int64_t B, double alpha) {
  TORCH_CHECK(s_in.dim() == 2, "s must be [N, E]");
  TORCH_CHECK(s_in.scalar_type() == at::kFloat || s_in.scalar_type() == at::kDouble, "fp32 or fp64 only");
  const at::Tensor s = s_in.contiguous(), bias = bias_in.to(s.scalar_type()).contiguous();
  const int64_t N = s.size(0), E = s.size(1);
  TORCH_CHECK(bias.numel() == E, "bias must be [E]");
  TORCH_CHECK(K >= 1 && K <= E, "need 1 <= K <= E");
  TORCH_CHECK(B >= 1 && N % B == 0, "N must be B sequences of T tokens");
  const int64_t T_ = N / B;
  const auto lopt = s.options().dtype(at::kLong);
  at::Tensor w = at::empty({N, K}, s.options()), idx = at::empty({N, K}, lopt), counts = at::zeros({E}, lopt),
             pos = at::empty({N * K}, lopt), slot = at::empty({N * K}, lopt);
  at::Tensor coef = alpha > 0 ? at::zeros({B, E}, s.options()) : at::empty({0, E}, s.options());
  at::Tensor aux = at::zeros({}, s.options());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "moe_route", [&] {
    using T = scalar_t;
    const T *sp = s.data_ptr<T>(), *bp = bias.data_ptr<T>();
    T *wp = w.data_ptr<T>(), *cp = coef.data_ptr<T>();
    int64_t *ip = idx.data_ptr<int64_t>(), *np = counts.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>(),
            *slp = slot.data_ptr<int64_t>();
    std::vector<T> choice(E);
    std::vector<int64_t> order(E);
    for (int64_t n = 0; n < N; ++n) {
      const T* sn = sp + n * E;
      for (int64_t e = 0; e < E; ++e) choice[e] = sn[e] + bp[e];
      for (int64_t e = 0; e < E; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t a, int64_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      int64_t* in = ip + n * K;
      T* wn = wp + n * K;
      T total = 0;
      for (int64_t k = 0; k < K; ++k) {
        in[k] = order[k];
        wn[k] = sn[order[k]];
        total += wn[k];
        ++np[order[k]];
      }
      if (K > 1)
        for (int64_t k = 0; k < K; ++k) wn[k] = wn[k] / total;
      for (int64_t k = 0; k < K; ++k) wn[k] = wn[k] * static_cast<T>(scale);
      if (alpha > 0)
        for (int64_t k = 0; k < K; ++k) cp[(n / T_) * E + in[k]] += T(1);
    }
    // assignment rows: expert e's assignments, in token order, start at the sum of the earlier experts' counts
    std::vector<int64_t> start(E, 0), seen(E, 0);
    int64_t cap = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (e > 0) start[e] = start[e - 1] + np[e - 1];
      cap = std::max(cap, np[e]);
    }
    for (int64_t f = 0; f < N * K; ++f) {
      const int64_t e = ip[f], j = seen[e]++;
      pp[f] = start[e] + j;
      slp[f] = e * cap + j;
    }
    if (alpha > 0) {
      const T c = static_cast<T>(alpha / (B * T_) * E / (K * T_));
      for (int64_t i = 0; i < B * E; ++i) cp[i] *= c;
      T acc = 0;
      for (int64_t n = 0; n < N; ++n) {
        const auto [S, dot] = balance_sums(sp + n * E, cp + (n / T_) * E, E);
        acc += dot / S;
      }
      aux.fill_(acc);
    }
  });
  return {w, aux, idx, counts, pos, slot, coef};
}

}  // namespace moe_route_ops

namespace {

at::Tensor moe_route_backward(const at::Tensor& dw_in, const at::Tensor& daux, const at::Tensor& s_in,
                              const at::Tensor& idx_in, const at::Tensor& coef_in, double scale) {
  const at::Tensor s = s_in.contiguous(), idx = idx_in.contiguous(), dw = dw_in.contiguous(),
                   coef = coef_in.contiguous();
  const int64_t N = s.size(0), E = s.size(1), K = idx.size(1);
  TORCH_CHECK(dw.sizes() == idx.sizes() && idx.size(0) == N, "dw and idx must be [N, K]");
  TORCH_CHECK(dw.scalar_type() == s.scalar_type(), "dw must have s's dtype");
  at::Tensor ds = at::zeros({N, E}, s.options());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "moe_route_backward", [&] {
    using T = scalar_t;
    const T *sp = s.data_ptr<T>(), *dwp = dw.data_ptr<T>(), *cp = coef.data_ptr<T>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    T* dsp = ds.data_ptr<T>();
    const T sc = static_cast<T>(scale);
    if (coef.size(0) > 0) {  // the balance loss
      const int64_t B = coef.size(0), T_ = N / B;
      const T da = daux.item<T>();
      for (int64_t n = 0; n < N; ++n) {
        const T* cb = cp + (n / T_) * E;
        const auto [S, dot] = balance_sums(sp + n * E, cb, E);
        for (int64_t e = 0; e < E; ++e) dsp[n * E + e] = da * (cb[e] / S - dot / (S * S));
      }
    }
    for (int64_t n = 0; n < N; ++n) {  // the gates
      const int64_t* in = ip + n * K;
      const T* dwn = dwp + n * K;
      T* dsn = dsp + n * E;
      if (K == 1) {
        dsn[in[0]] += sc * dwn[0];
        continue;
      }
      T U = 0, g = 0;
      for (int64_t k = 0; k < K; ++k) {
        U += sp[n * E + in[k]];
        g += dwn[k] * sp[n * E + in[k]];
      }
      for (int64_t k = 0; k < K; ++k) dsn[in[k]] += sc * (dwn[k] / U - g / (U * U));
    }
  });
  return ds;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("moe_route(Tensor s, Tensor bias, int K, float scale, int B, float alpha) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_route_backward(Tensor dw, Tensor daux, Tensor s, Tensor idx, Tensor coef, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("moe_route", &moe_route_ops::moe_route);
  m.impl("moe_route_backward", &moe_route_backward);
}
