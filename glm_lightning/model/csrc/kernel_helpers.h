// Helpers shared by the C++ ops of csrc/ (one translation unit includes them all, so each lives here once).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

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

// Explicit SIMD vectors of kLanes elements (GCC vector extensions) for the loops the compiler will not vectorise on its
// own: dot products (a scalar `s += a * b` reduction stays scalar without -ffast-math) and register tiles over a few
// tokens (left alone it vectorised over the tokens, with gathers). The width follows the compiler's target, so that a
// Vec is one register: 16 fp32 lanes with AVX-512, 8 with AVX / AVX2, 4 with SSE or NEON (a 16-lane vector on AVX2 is
// two registers, and a kernel's 16-accumulator register tile then needs 32 of its 16). The kernels take their block
// sizes from kLanes; their sums run in a fixed order for a given width, so results are reproducible per CPU kind.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

namespace lanes_detail {
// Lane indices of one step of the pairwise reduction below: from two vectors x and y (y's lanes numbered N..2N-1),
// whose lanes form groups of 2g partial sums each, the lower (hi = 0) or upper (hi = 1) g lanes of every group, x's
// groups first. Summing the two picks halves every group: g partial sums per group, twice the groups.
constexpr int pick(int i, int N, int g, int hi) {
  const int groups = N / (2 * g);  // groups per input vector
  const int from_y = i / (groups * g), j = (i % (groups * g)) / g, lane = i % g;
  return from_y * N + j * 2 * g + hi * g + lane;
}
}  // namespace lanes_detail

template <typename T>
struct Lanes {
  static constexpr int N = kLanes;
  typedef T Vec __attribute__((vector_size(N * sizeof(T))));
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(Vec));
    return v;
  }
  static void store(T* p, const Vec& v) { std::memcpy(p, &v, sizeof(Vec)); }
  // The lanes summed as a tree of halves (log2 N shuffle + add steps instead of N - 1 dependent scalar adds): lanes
  // N/2 apart first, then N/4, ..., then 1.
  static T sum(const Vec& v) { return fold<N / 2>(v, std::make_integer_sequence<int, N>{})[0]; }
  // The sums of N vectors a[0..N-1] as one vector (lane i = sum(a[i]), bit for bit: lanes added in sum's order), N - 1
  // adds and 2 (N - 1) shuffles instead of N trees. (The name is from the 16-lane AVX-512 form: N vectors in general.)
  static Vec sums16(const Vec* a) { return reduce<N>(a); }

 private:
  // Lane i (< 2g) plus lane i + g, for g = N/2, ..., 1: lane 0 ends as the sum.
  template <int g, int... I>
  static Vec fold(const Vec& v, std::integer_sequence<int, I...> lanes) {
    const Vec s = v + __builtin_shufflevector(v, v, ((I + g) % N)...);
    if constexpr (g == 1)
      return s;
    else
      return fold<g / 2>(s, lanes);
  }
  template <int g>
  static Vec half_step(const Vec& x, const Vec& y) {
    return half_pick<g, 0>(x, y, std::make_integer_sequence<int, N>{}) +
           half_pick<g, 1>(x, y, std::make_integer_sequence<int, N>{});
  }
  template <int g, int hi, int... I>
  static Vec half_pick(const Vec& x, const Vec& y, std::integer_sequence<int, I...>) {
    return __builtin_shufflevector(x, y, lanes_detail::pick(I, N, g, hi)...);
  }
  // `count` vectors, each of N / count groups of `count` partial sums (one group per input vector) -> count / 2 vectors
  // of groups half as wide.
  template <int count>
  static Vec reduce(const Vec* a) {
    if constexpr (count == 1) {
      return a[0];
    } else {
      Vec next[count / 2];
      for (int p = 0; p < count / 2; ++p) next[p] = half_step<count / 2>(a[2 * p], a[2 * p + 1]);
      return reduce<count / 2>(next);
    }
  }
};


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
