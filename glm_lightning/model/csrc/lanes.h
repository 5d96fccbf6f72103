// Explicit SIMD vectors for the kernels of csrc/ (kernel_helpers.h includes this): their width follows the compiler's
// target. No torch headers, so that tests/test_cext_widths.py can compile and run its checks at every width in a
// second.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace glm_lightning_ops {

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
  // The N x N block of N vectors r[0..N-1] (r[i] lane j = element (i, j)) transposed in place: log2 N rounds, each
  // swapping the off-diagonal b x b sub-blocks of every 2b x 2b block (b = N/2, ..., 1) with two-source shuffles.
  static void transpose(Vec* r) { transpose_round<N / 2>(r); }
  // One step of sums16's tree: x's and y's groups of 2g partial sums halved, x's groups first. A kernel that makes its
  // N vectors one at a time can reduce them depth first (pairs of vectors with g = N/2, pairs of those with N/4, ...,
  // the last with 1): the same adds as sums16, bit for bit, with a few vectors live instead of N.
  template <int g>
  static Vec half_step(const Vec& x, const Vec& y) {
    return half_pick<g, 0>(x, y, std::make_integer_sequence<int, N>{}) +
           half_pick<g, 1>(x, y, std::make_integer_sequence<int, N>{});
  }

 private:
  template <int b>
  static void transpose_round(Vec* r) {
    for (int i = 0; i < N; ++i)
      if ((i / b) % 2 == 0) swap_blocks<b>(r[i], r[i + b], std::make_integer_sequence<int, N>{});
    if constexpr (b > 1) transpose_round<b / 2>(r);
  }
  // x keeps its even b-lane blocks and takes y's even blocks into its odd ones; y takes x's odd blocks into its even
  // ones and keeps its odd blocks.
  template <int b, int... I>
  static void swap_blocks(Vec& x, Vec& y, std::integer_sequence<int, I...>) {
    const Vec lo = __builtin_shufflevector(x, y, ((I / b) % 2 == 0 ? I : N + I - b)...);
    const Vec hi = __builtin_shufflevector(x, y, ((I / b) % 2 == 0 ? I + b : N + I)...);
    x = lo;
    y = hi;
  }
  // Lane i (< 2g) plus lane i + g, for g = N/2, ..., 1: lane 0 ends as the sum.
  template <int g, int... I>
  static Vec fold(const Vec& v, std::integer_sequence<int, I...> lanes) {
    const Vec s = v + __builtin_shufflevector(v, v, ((I + g) % N)...);
    if constexpr (g == 1)
      return s;
    else
      return fold<g / 2>(s, lanes);
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

// kLanes bf16 values (their bits, as stored by a bf16 tensor) widened to fp32 lanes. A bf16 is the upper half of an
// fp32, so each lane is zero-extended and shifted up by 16 bits: exact, two integer instructions per vector on any
// target (the compiler picks them for the vector width; a scalar target gets the same shifts per lane).
inline Lanes<float>::Vec load_bf16(const uint16_t* p) {
  typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Word __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Half h;
  std::memcpy(&h, p, sizeof(h));
  const Word w = __builtin_convertvector(h, Word) << 16;
  Lanes<float>::Vec v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// kLanes fp32 lanes rounded to bf16 (their bits) as c10::BFloat16 rounds: to nearest, ties to even; a NaN becomes the
// quiet NaN 0x7FC0. Integer vector instructions on any target.
inline void store_bf16(uint16_t* p, const Lanes<float>::Vec& v) {
  typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Word __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Word w;
  std::memcpy(&w, &v, sizeof(w));
  const Word rounded = (w + (0x7FFFu + ((w >> 16) & 1u))) >> 16;
  const Word nan = (Word)((w & 0x7FFFFFFFu) > 0x7F800000u);  // all ones where NaN
  const Half h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), Half);
  std::memcpy(p, &h, sizeof(h));
}

}  // namespace glm_lightning_ops
