// The Sinkhorn forward of csrc/sinkhorn.cpp as a plain function, for the ops that run it inside their own pass (the
// decode step's site read, csrc/site_read.cpp): the same code as the op, so the same values bit for bit.
#pragma once

#include <cstdint>

namespace glm_lightning_ops {

// x: N logits matrices n x n (row-major, token stride ts) -> y [N, n, n] the doubly stochastic result and, when sm is
// not null, sm [N, n, n] the row softmax (what the backward starts from). Instantiated for float and double.
template <typename T>
void sinkhorn_forward(const T* x, int64_t ts, int64_t N, int64_t n, int64_t iters, T eps, T* y, T* sm);

// The backward of sinkhorn_forward: grad (token stride gs) = dL/dy and sm (token stride ss) the saved row softmax of N
// tokens -> out [N, n, n] = dL/dx. The op glm_lightning::sinkhorn_backward runs it; so does the mHC site read's
// backward (csrc/site_read.cpp) on the H_res gradient it forms itself. Instantiated for float and double.
template <typename T>
void sinkhorn_backward_tokens(const T* grad, int64_t gs, const T* sm, int64_t ss, int64_t N, int64_t n, int64_t iters,
                              T eps, T* out);

}  // namespace glm_lightning_ops
