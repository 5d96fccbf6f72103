// AMX tiles for bf16 panels (csrc/panel_matmul.cpp): y = round_bf16(x) W^T with tdpbf16ps, fp32 accumulators.
//
// Why: a 16-row decode linear on bf16 panels widened to fp32 is bound by fp32 multiply-adds (16 rows x 16 outputs per
// weight row: 16 FMAs per 32 bytes of weights), so bf16 weights cost what fp32 weights cost there. One tdpbf16ps
// multiplies a 16 x 32 bf16 tile of x by a 32 x 16 bf16 tile of weights (1 KB) into a 16 x 16 fp32 tile in ~16
// cycles: the weights stream at the memory's rate, not the FMA ports'.
//
// Layout (panel_pack's bf16 panels on every CPU): panel p holds rows k of W[pL .. pL+L-1, :] as pairs,
// [ceil(in / 2), L, 2]: element (k / 2, c, k % 2) = W[pL + c, k], `in` padded with a zero to even. That is the VNNI
// layout tdpbf16ps reads as its B tile (16 pair rows of 16 outputs = 32 k's, 64 bytes a row, contiguous in the
// panel), and the widened kernel reads one pair row as one vector of L 32-bit words (low half: row k, high: k + 1).
//
// Tiles (one configuration per `in`, loaded per thread and task range): tmm0-3 accumulate up to 4 panels' 16 x 16
// outputs; tmm4 / tmm5 are x's 16 x 32 block and a panel's 32 x 16 block; tmm6 / tmm7 the same for the last
// in_pad % 32 k's. x comes as bf16 rows padded to 16 (zero rows: their outputs are never stored) and to in_pad.
//
// Compiled where the target has AMX-TILE and AMX-BF16 (-march=native on such a CPU) and 16-lane panels; used where
// the CPU has them and the kernel grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM): amx_usable().
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define GLM_LIGHTNING_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define GLM_LIGHTNING_AMX 0
#endif

namespace glm_lightning_amx {

constexpr int64_t kTileRows = 16;  // x rows per tile (a decode's 16 rows: one tile height)
constexpr int64_t kTileK = 32;     // k's per tdpbf16ps (64 bytes of bf16 per x row)
constexpr int64_t kGroup = 4;      // panels per pass over x's k blocks: accumulator tiles tmm0-3

#if GLM_LIGHTNING_AMX

// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24, 22) and Linux lets this process use the tile
// data (asked once; the permission holds for the whole process, every thread).
inline bool amx_granted() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tile configuration for x rows of in_pad bf16 values (in_pad even).
inline void configure(int64_t in_pad) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {  // accumulators, x block, panel block
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  const int64_t tail = in_pad % kTileK;
  if (tail > 0) {
    cfg.rows[6] = kTileRows;  // x's last tail k's
    cfg.colsb[6] = static_cast<uint16_t>(tail * 2);
    cfg.rows[7] = static_cast<uint8_t>(tail / 2);  // the panel's last tail / 2 pair rows
    cfg.colsb[7] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline void release() { _tile_release(); }

// A panel's 32 x 16 block at b into tmm5 (tmm7: its tail rows) times x's block in tmm4 (tmm6), into accumulator C.
// Macros: GCC's tile intrinsics name their tile registers by stringizing the argument, so it must be a literal.
#define GLM_AMX_DOT_FULL(C, b) \
  do {                         \
    _tile_loadd(5, (b), 64);   \
    _tile_dpbf16ps(C, 4, 5);   \
  } while (0)
#define GLM_AMX_DOT_TAIL(C, b) \
  do {                         \
    _tile_loadd(7, (b), 64);   \
    _tile_dpbf16ps(C, 6, 7);   \
  } while (0)

// The next group's weights at the same offset, into L2 while this group's tiles multiply (16 lines a tile), each
// panel's lines after that panel's tile product. Measured on the Intel Xeon (AMX, 1 thread, process time, flash-25m's
// shapes, weights cycled cold through 90 MB, the forms in turns, median of 5, the widened kernel as each run's
// anchor), AMX / widened at 1 row and 16 rows for [576 x 192], [192 x 192], [768 x 192], [192 x 384]:
//   no prefetch:                          16 rows 1.02x, -, 1.04x, 1.24x;  4 rows 0.80x, -, 0.78x, -
//   all 4 next tiles into L1 per k block: 1 row 0.92-0.97x;  16 rows 1.06-1.36x
//   each after its panel's tile, L1:      1 row 0.93-0.98x;  16 rows 1.17-1.37x
//   each after its panel's tile, L2 (this): 1 row 0.97-1.03x;  16 rows 1.21-1.38x
// Two or three groups ahead did no better (one decode step's calls replayed: 1.21x one group ahead, 1.12x two).
inline void prefetch_tile(const uint16_t* b) {
  for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(b) + 64 * l, _MM_HINT_T1);
}

// V panels (V <= kGroup; panel stride `pstride` elements) against a 16-row block of x (bf16, row stride in_pad):
// c[v * 256 + i * 16 + j] = sum_k x[i, k] W_v[j, k], k in order of the 32-k blocks (each block's sum as the tile unit
// forms it). With `prefetch`, the V panels after these are prefetched as these stream.
template <int V>
inline void group(const uint16_t* x, const uint16_t* P, int64_t pstride, int64_t in_pad, float* c, bool prefetch) {
  static_assert(V >= 1 && V <= kGroup);
  _tile_zero(0);
  if constexpr (V > 1) _tile_zero(1);
  if constexpr (V > 2) _tile_zero(2);
  if constexpr (V > 3) _tile_zero(3);
  const int64_t full = in_pad / kTileK, xs = in_pad * 2;
  const uint16_t* next = P + V * pstride;
  for (int64_t kb = 0; kb < full; ++kb) {
    const int64_t o = kb * kTileK * 16;  // 16 pair rows of 16 outputs x 2
    _tile_loadd(4, x + kb * kTileK, xs);
    GLM_AMX_DOT_FULL(0, P + o);
    if (prefetch) prefetch_tile(next + o);
    if constexpr (V > 1) {
      GLM_AMX_DOT_FULL(1, P + pstride + o);
      if (prefetch) prefetch_tile(next + pstride + o);
    }
    if constexpr (V > 2) {
      GLM_AMX_DOT_FULL(2, P + 2 * pstride + o);
      if (prefetch) prefetch_tile(next + 2 * pstride + o);
    }
    if constexpr (V > 3) {
      GLM_AMX_DOT_FULL(3, P + 3 * pstride + o);
      if (prefetch) prefetch_tile(next + 3 * pstride + o);
    }
  }
  if (in_pad % kTileK > 0) {
    const int64_t o = full * kTileK * 16;
    _tile_loadd(6, x + full * kTileK, xs);
    GLM_AMX_DOT_TAIL(0, P + o);
    if constexpr (V > 1) GLM_AMX_DOT_TAIL(1, P + pstride + o);
    if constexpr (V > 2) GLM_AMX_DOT_TAIL(2, P + 2 * pstride + o);
    if constexpr (V > 3) GLM_AMX_DOT_TAIL(3, P + 3 * pstride + o);
  }
  _tile_stored(0, c, 64);
  if constexpr (V > 1) _tile_stored(1, c + 256, 64);
  if constexpr (V > 2) _tile_stored(2, c + 512, 64);
  if constexpr (V > 3) _tile_stored(3, c + 768, 64);
}

// Panels [p_begin, p_end) of one matrix (P: its first panel) against `rows` rows of x (bf16 [ceil(rows / 16) * 16,
// in_pad], zero padded), into y [rows, out] (row stride out) plus bias (nullable): groups of up to kGroup panels per
// 16-row block; the first row block streams the panels (prefetching the next group), the others find them in cache.
inline void matrix(const uint16_t* x, const uint16_t* P, float* y, int64_t rows, int64_t p_begin, int64_t p_end,
                   int64_t in_pad, int64_t out, const float* bias) {
  const int64_t pstride = in_pad * 16;
  alignas(64) float c[kGroup * 256];
  for (int64_t m = 0; m < rows; m += kTileRows) {
    const int64_t mb = std::min(kTileRows, rows - m);
    const uint16_t* xb = x + m * in_pad;
    for (int64_t p = p_begin; p < p_end; p += kGroup) {
      const int64_t v = std::min(kGroup, p_end - p);
      const uint16_t* Pp = P + p * pstride;
      const bool pre = m == 0;
      if (v == 4) group<4>(xb, Pp, pstride, in_pad, c, pre);
      else if (v == 3) group<3>(xb, Pp, pstride, in_pad, c, pre);
      else if (v == 2) group<2>(xb, Pp, pstride, in_pad, c, pre);
      else group<1>(xb, Pp, pstride, in_pad, c, pre);
      for (int64_t j = 0; j < v; ++j) {
        const int64_t col0 = (p + j) * 16, cols = std::min<int64_t>(16, out - col0);
        for (int64_t i = 0; i < mb; ++i) {
          const float* ci = c + j * 256 + i * 16;
          float* yi = y + (m + i) * out + col0;
          if (bias == nullptr) std::memcpy(yi, ci, cols * sizeof(float));
          else for (int64_t q = 0; q < cols; ++q) yi[q] = ci[q] + bias[col0 + q];
        }
      }
    }
  }
}

#endif  // GLM_LIGHTNING_AMX

}  // namespace glm_lightning_amx
