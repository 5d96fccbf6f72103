// Flush fp32 denormals to zero while alive (this thread only), shared by the ops that multiply long decay chains.
//
// Why: KDA's decays reach exp(lb * C) within a chunk (e.g. exp(-160)) and state entries decay by exp(-5) per decoded
// token: fp32 denormals, which cost ~100 cycles per multiply on x86 unless flushed (MKL's GEMMs flush them too).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace glm_lightning_ops {

struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

}  // namespace glm_lightning_ops
