// Helpers shared by the C++ ops of csrc/ (one translation unit includes them all, so each lives here once).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
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

// Calls fn.template operator()<KK, VV>() with the compile-time sizes for (K, V) in {16, 32, 64}^2 (same), else <0, 0>:
// the common head sizes, so that a head's rows stay in registers.
template <typename F>
void with_sizes(int64_t K, int64_t V, F&& fn) {
  if (K == 16 && V == 16) return fn.template operator()<16, 16>();
  if (K == 32 && V == 32) return fn.template operator()<32, 32>();
  if (K == 64 && V == 64) return fn.template operator()<64, 64>();
  return fn.template operator()<0, 0>();
}

// Explicit SIMD vectors of kLanes elements (GCC vector extensions: one fp32 AVX-512 register, two of AVX2) for the
// loops the compiler will not vectorise on its own: dot products (a scalar `s += a * b` reduction stays scalar without
// -ffast-math) and register tiles over a few tokens (left alone it vectorised over the tokens, with gathers).
constexpr int kLanes = 16;

template <typename T>
struct Lanes {
  typedef T Vec __attribute__((vector_size(kLanes * sizeof(T))));
  typedef T Half __attribute__((vector_size(kLanes / 2 * sizeof(T))));
  typedef T Quarter __attribute__((vector_size(kLanes / 4 * sizeof(T))));
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(Vec));
    return v;
  }
  static void store(T* p, const Vec& v) { std::memcpy(p, &v, sizeof(Vec)); }
  // The lanes summed as a tree of halves (4 shuffle + add steps instead of 15 dependent scalar adds).
  static T sum(const Vec& v) {
    const Half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
  // The sums of 16 vectors a[0..15] as one vector (lane i = sum(a[i])), adding lanes in sum's order (halves 8, 4, 2,
  // 1 apart), so each is sum(a[i]) bit for bit: 15 adds and 30 shuffles instead of 16 trees of 4 + 4.
  static Vec sums16(const Vec* a) {
    Vec l1[8], l2[4], l3[2];
    for (int p = 0; p < 8; ++p) {
      const Vec x = a[2 * p], y = a[2 * p + 1];
      l1[p] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int p = 0; p < 4; ++p) {
      const Vec x = l1[2 * p], y = l1[2 * p + 1];
      l2[p] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
              __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int p = 0; p < 2; ++p) {
      const Vec x = l2[2 * p], y = l2[2 * p + 1];
      l3[p] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
              __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
};
static_assert(kLanes == 16, "Lanes<T>::sum is written for 16 lanes");

// exp for the kernels' elementwise loops (KDA's decay factors, SiLU). fp32: a branch-free form the compiler
// vectorises (2^n exp(r), |r| <= ln2 / 2, Cody-Waite split of ln2, degree-6 Taylor polynomial: within 3 ulp of expf
// over [-87, 88], measured; 0 below -87.3 as fp32 flushes anyway). std::exp called per element kept the KDA chunk
// op's loops scalar (with the op's partial sums this took its flash-25m forward from 15.5 to 7.7 ms, 1 thread).
// fp64 (gradcheck) keeps std::exp.
inline float exp_(float x) {
  const bool tiny = x < -87.3f;
  x = x > 88.3f ? 88.3f : (tiny ? 0.f : x);
  const float magic = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + magic) - magic;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? 0.f : p * scale;
}
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

// Token rows per parallel task in the row-wise ops, and per partial sum of their parameter gradients (fixed blocks,
// summed in order: the gradients do not depend on the thread count).
constexpr int64_t kRowBlock = 64;

// t as a contiguous [R, width] (a view when it already is one; else one copy).
inline at::Tensor as_rows(const at::Tensor& t, int64_t R, int64_t width, const char* name) {
  TORCH_CHECK(t.numel() == R * width, name, " must hold ", R, " rows of ", width, ", got ", t.sizes());
  return t.reshape({R, width}).contiguous();
}

}  // namespace glm_lightning_ops
