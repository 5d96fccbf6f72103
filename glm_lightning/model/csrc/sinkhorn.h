// The Sinkhorn forward of csrc/sinkhorn.cpp as a plain function, for the ops that run it inside their own pass (the
// decode step's site read, csrc/site_read.cpp): the same code as the op, so the same values bit for bit.
#pragma once

#include <cstdint>

namespace glm_lightning_ops {

// x: N logits matrices n x n (row-major, token stride ts) -> y [N, n, n] the doubly stochastic result and, when sm is
// not null, sm [N, n, n] the row softmax (what the backward starts from). Instantiated for float and double.
template <typename T>
void sinkhorn_forward(const T* x, int64_t ts, int64_t N, int64_t n, int64_t iters, T eps, T* y, T* sm);

}  // namespace glm_lightning_ops
