// The KDA chunk hand-off S_{n+1} = P_n S_n + R_n (glm_lightning/model/kda.py, StateScan) as two CPU ops.
//
// The eager form is a Python loop of N baddbmm calls forward and N more backward, each with its select/as_strided
// views (~10 dispatched ops per chunk and direction). Here one op runs the whole scan: the M = B * H independent
// sequences in parallel, each step a K x K by K x V product written as rank-1 row updates over V (contiguous, so
// the compiler vectorises it). The tensors are small (K, V <= 64), so this is not slower than BLAS per call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernel_helpers.h"

namespace {

// c[K, V] += a[K, K] @ b[K, V] (a_t: a transposed, i.e. c += a^T b); all row-major and contiguous. KK and VV > 0 fix
// K and V at compile time (the common head sizes): each output row then stays in registers across the k loop.
template <typename T, int64_t KK, int64_t VV>
inline void matmul_acc(const T* __restrict a, const T* __restrict b, T* __restrict c, int64_t K_, int64_t V_,
                       bool a_t) {
  const int64_t K = KK > 0 ? KK : K_, V = VV > 0 ? VV : V_;
  for (int64_t i = 0; i < K; ++i) {
    T* __restrict ci = c + i * V;
    for (int64_t k = 0; k < K; ++k) {
      const T aik = a_t ? a[k * K + i] : a[i * K + k];
      const T* __restrict bk = b + k * V;
      for (int64_t v = 0; v < V; ++v) ci[v] += aik * bk[v];
    }
  }
}

using glm_lightning_ops::FlushDenormals;  // P holds decays as small as exp(lb * C): see kernel_helpers.h
using glm_lightning_ops::with_sizes;

void check(const at::Tensor& P, const at::Tensor& X) {
  TORCH_CHECK(P.dim() == 4 && X.dim() == 4, "expected P [N, M, K, K] and [N(+1), M, K, V]");
  TORCH_CHECK(P.size(2) == P.size(3) && P.size(1) == X.size(1) && P.size(2) == X.size(2), "shape mismatch");
  TORCH_CHECK(P.scalar_type() == X.scalar_type(), "dtype mismatch");
  TORCH_CHECK(P.scalar_type() == at::kFloat || P.scalar_type() == at::kDouble, "fp32 or fp64 only");
  TORCH_CHECK(P.device().is_cpu() && X.device().is_cpu(), "CPU only");
}

// P [N, M, K, K], R [N, M, K, V], S0 [M, K, V] -> all states [N + 1, M, K, V] (S0 first).
at::Tensor state_scan(const at::Tensor& P_in, const at::Tensor& R_in, const at::Tensor& S0_in) {
  check(P_in, R_in);
  const at::Tensor P = P_in.contiguous(), R = R_in.contiguous(), S0 = S0_in.contiguous();
  const int64_t N = P.size(0), M = P.size(1), K = P.size(2), V = R.size(3);
  TORCH_CHECK(R.size(0) == N && S0.dim() == 3 && S0.size(0) == M && S0.size(1) == K && S0.size(2) == V,
              "shape mismatch");
  at::Tensor S = at::empty({N + 1, M, K, V}, R.options());
  AT_DISPATCH_FLOATING_TYPES(P.scalar_type(), "state_scan", [&] {
    const scalar_t *p = P.data_ptr<scalar_t>(), *r = R.data_ptr<scalar_t>(), *s0 = S0.data_ptr<scalar_t>();
    scalar_t* s = S.data_ptr<scalar_t>();
    const int64_t kk = K * K, kv = K * V;
    with_sizes(K, V, [&]<int64_t KK, int64_t VV>() {
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        FlushDenormals ftz;
        for (int64_t m = begin; m < end; ++m) {
          std::copy(s0 + m * kv, s0 + (m + 1) * kv, s + m * kv);
          for (int64_t n = 0; n < N; ++n) {
            scalar_t* next = s + ((n + 1) * M + m) * kv;
            std::copy(r + (n * M + m) * kv, r + (n * M + m + 1) * kv, next);
            matmul_acc<scalar_t, KK, VV>(p + (n * M + m) * kk, s + (n * M + m) * kv, next, K, V, false);
          }
        }
      });
    });
  });
  return S;
}

// grad [N + 1, M, K, V] (dL/dS_n, direct) -> the total dL/dS_n: g_n = grad_n + P_n^T g_{n+1}, walked backward.
at::Tensor state_scan_backward(const at::Tensor& grad_in, const at::Tensor& P_in) {
  check(P_in, grad_in);
  const at::Tensor P = P_in.contiguous();
  at::Tensor g = grad_in.contiguous().clone();
  const int64_t N = P.size(0), M = P.size(1), K = P.size(2), V = g.size(3);
  TORCH_CHECK(g.size(0) == N + 1, "grad must hold N + 1 states");
  AT_DISPATCH_FLOATING_TYPES(P.scalar_type(), "state_scan_backward", [&] {
    const scalar_t* p = P.data_ptr<scalar_t>();
    scalar_t* gs = g.data_ptr<scalar_t>();
    const int64_t kk = K * K, kv = K * V;
    with_sizes(K, V, [&]<int64_t KK, int64_t VV>() {
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        FlushDenormals ftz;
        for (int64_t m = begin; m < end; ++m)
          for (int64_t n = N - 1; n >= 0; --n)
            matmul_acc<scalar_t, KK, VV>(p + (n * M + m) * kk, gs + ((n + 1) * M + m) * kv, gs + (n * M + m) * kv,
                                         K, V, true);
      });
    });
  });
  return g;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("state_scan(Tensor P, Tensor R, Tensor S0) -> Tensor");
  m.def("state_scan_backward(Tensor grad, Tensor P) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("state_scan", &state_scan);
  m.impl("state_scan_backward", &state_scan_backward);
}
