// Helpers shared by the C++ ops of csrc/ (one translation unit includes them all, so each lives here once).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace glm_lightning_ops {

// Flush fp32 denormals to zero while alive (this thread only), for the ops that multiply long decay chains: KDA's
// decays reach exp(lb * C) within a chunk (e.g. exp(-160)) and state entries decay by exp(-5) per decoded token:
// fp32 denormals, which cost ~100 cycles per multiply on x86 unless flushed (MKL's GEMMs flush them too).
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Calls fn.template operator()<KK, VV>() with the compile-time sizes for (K, V) in {16, 32, 64}^2 (same), else <0, 0>:
// the common head sizes, so that a head's rows stay in registers.
template <typename F>
void with_sizes(int64_t K, int64_t V, F&& fn) {
  if (K == 16 && V == 16) return fn.template operator()<16, 16>();
  if (K == 32 && V == 32) return fn.template operator()<32, 32>();
  if (K == 64 && V == 64) return fn.template operator()<64, 64>();
  return fn.template operator()<0, 0>();
}

}  // namespace glm_lightning_ops
