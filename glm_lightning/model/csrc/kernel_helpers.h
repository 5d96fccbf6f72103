// Helpers shared by the C++ ops of csrc/ (one translation unit includes them all, so each lives here once).
#pragma once

#include <ATen/ATen.h>

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace glm_lightning_ops {

// The most mHC streams the stream and Sinkhorn ops take (glm_lightning/model/mhc.py keeps the eager paths beyond).
constexpr int64_t kMaxStreams = 8;

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

// One vector of lanes.h stored past the cache (a non-temporal store) where the target has one for fp32 at its width,
// else an ordinary store: for outputs of many MB that no one reads soon (an mHC gradient of the streams, 12.6 MB per
// flash-25m site), so the store does not first read the line from memory (an ordinary store's read-for-ownership is a
// third of such a kernel's traffic). p must be aligned to the vector (callers check with streaming_aligned); a kernel
// that stores this way calls streaming_done() before its output is read (the stores are weakly ordered).
template <typename T>
inline void store_streaming(T* p, const typename Lanes<T>::Vec& v) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && sizeof(v) == 64) {
    __m512 r;
    std::memcpy(&r, &v, 64);
    return _mm512_stream_ps(reinterpret_cast<float*>(p), r);
  }
#elif defined(__AVX__)
  if constexpr (std::is_same_v<T, float> && sizeof(v) == 32) {
    __m256 r;
    std::memcpy(&r, &v, 32);
    return _mm256_stream_ps(reinterpret_cast<float*>(p), r);
  }
#endif
  Lanes<T>::store(p, v);
}

// Whether an output of `count` elements at p should take store_streaming: aligned to one vector, and larger than a
// core's L2 cache (a smaller one, e.g. a decode step's, is better left in the cache for the op that reads it next).
template <typename T>
inline bool streaming_output(const T* p, int64_t count) {
  constexpr int64_t kLargeBytes = int64_t{4} << 20;
  return reinterpret_cast<std::uintptr_t>(p) % sizeof(typename Lanes<T>::Vec) == 0 &&
         count * static_cast<int64_t>(sizeof(T)) >= kLargeBytes;
}

// Orders the calling thread's streaming stores before its later stores (x86 sfence; elsewhere nothing to do).
inline void streaming_done() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();
#endif
}

// Calls fn.template operator()<KK, VV>() with the compile-time sizes for (K, V) in {16, 32, 64}^2 (same), else <0, 0>:
// the common head sizes, so that a head's rows stay in registers.
template <typename F>
void with_sizes(int64_t K, int64_t V, F&& fn) {
  if (K == 16 && V == 16) return fn.template operator()<16, 16>();
  if (K == 32 && V == 32) return fn.template operator()<32, 32>();
  if (K == 64 && V == 64) return fn.template operator()<64, 64>();
  return fn.template operator()<0, 0>();
}

// Lanes<T> and kLanes (the explicit SIMD vectors, as wide as the target's registers) live in lanes.h.


// exp for the kernels' elementwise loops (KDA's decay factors, SiLU). fp32: a branch-free form the compiler
// vectorises (2^n exp(r), |r| <= ln2 / 2, Cody-Waite split of ln2, degree-6 Taylor polynomial: within 3 ulp of expf
// over [-87, 88], measured; 0 below -87.3 as fp32 flushes anyway). std::exp called per element kept the KDA chunk
// op's loops scalar (with the op's partial sums this took its flash-25m forward from 15.5 to 7.7 ms, 1 thread).
// fp64 (gradcheck) keeps std::exp.
// One value or a vector of them (GCC vector extensions take the same expressions; I: the matching int32 type), so
// that a vectorised kernel's lanes (short_conv.cpp) get exp_'s value bit for bit.
template <typename F, typename I>
inline F exp_poly(F x) {
  const F zero{};
  const auto tiny = x < -87.3f;
  x = x > 88.3f ? zero + 88.3f : (tiny ? zero : x);
  const float magic = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const F n = (x * 1.44269504088896341f + magic) - magic;
  const F r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  F p = zero + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  I bits;
  if constexpr (std::is_same_v<F, float>)
    bits = (static_cast<int32_t>(n) + 127) << 23;
  else
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? zero : p * scale;
}
inline float exp_(float x) { return exp_poly<float, int32_t>(x); }
inline double exp_(double x) { return std::exp(x); }

template <typename T>
inline T sigmoid_(T z) {
  return T(1) / (T(1) + exp_(-z));
}

// Sums over a row's K values as `omp simd` reductions (vectorised; without it a scalar `s += ...` loop stays scalar).
template <typename T>
inline T sum_squares(const T* __restrict u, int64_t K) {
  T ss = 0;
  _Pragma("omp simd reduction(+ : ss)") for (int64_t k = 0; k < K; ++k) ss += u[k] * u[k];
  return ss;
}

template <typename T>
inline T dot_(const T* __restrict u, const T* __restrict v, int64_t K) {
  T s = 0;
  _Pragma("omp simd reduction(+ : s)") for (int64_t k = 0; k < K; ++k) s += u[k] * v[k];
  return s;
}

// bf16 storage with fp32 math, for the ops that take bf16 tensors (bf16-mixed training: the MoE's SwiGLU and row
// moves between its bf16 GEMMs). Acc<S> is the type an op computes in for storage S; widen is exact, narrow
// rounds to nearest even (NaN kept a NaN), both plain bit operations the compiler vectorises.
template <typename S>
struct AccOf { using type = S; };
template <>
struct AccOf<at::BFloat16> { using type = float; };
template <typename S>
using Acc = typename AccOf<S>::type;

inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename S>
inline S narrow(Acc<S> x) { return x; }
template <>
inline at::BFloat16 narrow<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t out = x != x ? ((bits >> 16) | 0x40u) : rounded;
  return at::BFloat16(static_cast<uint16_t>(out), at::BFloat16::from_bits());
}

// Token rows per parallel task in the row-wise ops, and per partial sum of their parameter gradients (fixed blocks,
// summed in order: the gradients do not depend on the thread count).
constexpr int64_t kRowBlock = 64;

// t as a contiguous [R, width] (a view when it already is one; else one copy).
inline at::Tensor as_rows(const at::Tensor& t, int64_t R, int64_t width, const char* name) {
  TORCH_CHECK(t.numel() == R * width, name, " must hold ", R, " rows of ", width, ", got ", t.sizes());
  return t.reshape({R, width}).contiguous();
}

// Zeroes the padding rows m >= counts[e] of every matrix e of y [E, M, out] (the grouped few-row matmuls,
// small_matmul.cpp and panel_matmul.cpp, compute only the real rows); checks that each count lies in [0, M].
inline void zero_padding_rows(float* y, const int64_t* counts, int64_t E, int64_t M, int64_t out) {
  for (int64_t e = 0; counts != nullptr && e < E; ++e) {
    TORCH_CHECK(counts[e] >= 0 && counts[e] <= M, "counts must lie in [0, M]");
    std::fill(y + (e * M + counts[e]) * out, y + (e + 1) * M * out, 0.f);
  }
}

}  // namespace glm_lightning_ops
