// x @ W^T for a few rows against weights packed once into output panels (decoding without autograd).
//
// Why: a decode step streams every weight once for a few rows. small_matmul (small_matmul.cpp) reads W as stored,
// [out, in], so each output is a dot product along `in` (12-24 vectors at flash-25m) that ends in a horizontal sum;
// on an Intel Xeon (AVX-512, 1 thread) it streamed the weights at 2.2-3.0 GB/s, a third of a plain read. Here each
// weight matrix is packed once per generation into panels of kLanes outputs, [ceil(out / L), in, L] (zero padded):
// panel p holds W[pL .. pL+L-1, k] at row k, so the kernel reads each panel as one contiguous stream, broadcasts
// x[m, k] and multiplies it into a vector of L outputs. No horizontal sums, no shuffles; a tile of rows x panels stays
// in registers over the whole `in` loop, and the next weights are prefetched.
//
//   panel_pack(W [out, in] or [E, out, in], dtype) -> P [ceil(out / L), in, L] or [E, ceil(out / L), in, L]
//       (P in dtype: fp32 or bf16; None: W's. bf16: [.., in + in % 2, L], rows k, k + 1 as L pairs)
//   panel_matmul(x [..., in], P [panels, in, L], out, None, bias [out]) -> y [..., out]   (M rows: x's leading dims)
//   panel_matmul(x [E, M, in], P [E, ...], out, counts [E] int64, bias [E, out]) -> y [E, M, out]
//       y[e, m] = W[e] x[e, m] + bias[e] for m < counts[e]; 0 for the padding rows m >= counts[e]
//
// Each output sums its `in` products in order k = 0, 1, ... (one fused multiply-add per k), whatever the other rows
// or outputs are, so a token's output never depends on its batch. The order differs from BLAS's and small_matmul's
// in the last bits (tests: within 1e-5 of torch.mm).
//
// P may be fp32 or bf16 (panel_pack's dtype); x, bias and y are fp32 either way. bf16 panels are half the bytes a
// decode step streams, and take x rounded to bf16 (nearest even, as c10::BFloat16): y = round(x) W^T + b, products
// of bf16 values summed in fp32, the bias added in fp32 (autocast's bf16 linear without its output rounding; the
// numerics contract of generation.py's precision="bf16"). bf16 panels hold rows k, k + 1 as pairs (`in` padded to
// even: amx_panels.h's layout). Where the CPU has AMX-BF16 and the kernel grants the tiles (amx_on) they run on AMX
// tiles (amx_panels.h: within fp32 summation order of the reference, tests/test_panel_amx.py); elsewhere each pair
// row is widened to fp32 in registers (exact) and multiplied with the rounded x as the fp32 kernel does, so the
// products and their order are those of the fp32 kernel on the rounded operands (tests: bit for bit against fp32
// panels of W.bfloat16().float() applied to x.bfloat16().float()). One template over the stored type serves both.
//
//   panel_amx(enable or None) -> bool: switch the AMX form on (where available) or off; whether it is on
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_panels.h"
#include "kernel_helpers.h"

namespace {

using PVec = glm_lightning_ops::Lanes<float>::Vec;
constexpr int64_t kPanel = glm_lightning_ops::kLanes;  // outputs per panel: one vector

// Accumulators per register tile: 16 where the target has 32 vector registers (AVX-512, aarch64), 12 where it has 16
// (AVX2, SSE: the tile's accumulators, its weight vectors and the broadcast must fit without spilling).
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kTileAcc = 16;
#else
constexpr int kTileAcc = 12;
#endif

// What the kernel prefetches: while a tile streams its V panels (V * in * L contiguous weights), the next V panels,
// row k of each at step k, into all cache levels: the next tile's, task's or matrix's weights (P is contiguous over
// panels and matrices), one tile's bytes ahead. A fixed distance within each panel (64 rows, 4 KB of fp32) did as
// well for fp32 but not for bf16 panels, whose 192-384 rows at flash-25m are 6-12 KB: the first rows of every panel
// waited on memory. Measured on an Intel Xeon (AVX-512, 1 thread, flash-25m's expert shapes at 32 assignments over 8
// experts, 48 layers' weights cycled cold, process time, median of 7, the two forms in turns, one build switching
// them at run time): bf16 experts 26.9-27.5 -> 21.4-22.0 ms (6.2 -> 7.9 GB/s), fp32 36.4-38.0 -> 36.9-38.2 ms, 16-row
// dense linears unchanged (FMA bound). Earlier (one build per setting): a non-temporal hint streamed at about half a
// plain read's rate, and no prefetch took 1.5-2x the time.

// One panel row of L weights as fp32 lanes, from fp32 or from bf16 bits.
inline PVec load_w(const float* p) { return glm_lightning_ops::Lanes<float>::load(p); }

// Rows a panel holds: `in`, padded to even for bf16 (pairs).
template <typename D>
constexpr int64_t panel_rows(int64_t in) {
  return std::is_same_v<D, float> ? in : in + (in & 1);
}

// Two bf16 panel rows k, k + 1 stored as L pairs (amx_panels.h's layout) widened to fp32 lanes, exactly: each pair is
// one 32-bit word, row k its low half (shifted up), row k + 1 its high half (masked); two integer instructions.
inline void load_pair(const uint16_t* p, PVec& w0, PVec& w1) {
  typedef uint32_t Word __attribute__((vector_size(kPanel * sizeof(uint32_t))));
  Word w;
  std::memcpy(&w, p, sizeof(w));
  const Word lo = w << 16, hi = w & 0xFFFF0000u;
  std::memcpy(&w0, &lo, sizeof(w0));
  std::memcpy(&w1, &hi, sizeof(w1));
}

// y[m0 .. m0+MB, panels p0 .. p0+V] for MB rows of x and V panels starting at P (panel stride panel_rows * L); the
// MB x V accumulators stay in registers across k. x is rows (row stride `in`) or, with XT, the block transposed
// ([in, MB]: x_block[i, k] at x[k * MB + i], see transpose_blocks). Writes the first `cols` outputs of the last panel
// (fewer than L at a matrix's ragged end), adding bias (nullable) at the panel's outputs.
template <int MB, int V, bool XT, typename W>
inline void tile(const float* __restrict x, const W* __restrict P, float* __restrict y, int64_t in, int64_t out,
                 int64_t last_cols, const float* bias, bool prefetch) {
  PVec acc[MB][V];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = PVec{};
  if constexpr (std::is_same_v<W, float>) {
    const int64_t stride = in * kPanel;
    for (int64_t k = 0; k < in; ++k) {
      PVec w[V];
      for (int v = 0; v < V; ++v) w[v] = load_w(P + v * stride + k * kPanel);
      if (prefetch)  // the next V panels (contiguous after these: the next tile's, task's or matrix's), row for row
        for (int v = 0; v < V; ++v) __builtin_prefetch(P + (V + v) * stride + k * kPanel, 0, 3);
      for (int i = 0; i < MB; ++i) {
        const float xi = XT ? x[k * MB + i] : x[i * in + k];
        for (int v = 0; v < V; ++v) acc[i][v] += xi * w[v];
      }
    }
  } else {  // bf16 pairs (amx_panels.h's layout): rows k and k + 1 from one load, multiplied in that order
    const int64_t stride = (in + (in & 1)) * kPanel;
    for (int64_t k = 0; k < in; k += 2) {
      PVec w0[V], w1[V];
      for (int v = 0; v < V; ++v) load_pair(P + v * stride + k * kPanel, w0[v], w1[v]);
      if (prefetch)
        for (int v = 0; v < V; ++v) __builtin_prefetch(P + (V + v) * stride + k * kPanel, 0, 3);
      for (int i = 0; i < MB; ++i) {
        const float xi = XT ? x[k * MB + i] : x[i * in + k];
        for (int v = 0; v < V; ++v) acc[i][v] += xi * w0[v];
      }
      if (k + 1 == in) break;  // an odd `in`: the pair's second row is padding
      for (int i = 0; i < MB; ++i) {
        const float xi = XT ? x[(k + 1) * MB + i] : x[i * in + k + 1];
        for (int v = 0; v < V; ++v) acc[i][v] += xi * w1[v];
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t cols = v == V - 1 ? last_cols : kPanel;
    PVec b{};
    if (bias != nullptr) {
      if (cols == kPanel) {
        b = glm_lightning_ops::Lanes<float>::load(bias + v * kPanel);
      } else {
        for (int64_t c = 0; c < cols; ++c) b[c] = bias[v * kPanel + c];
      }
    }
    for (int i = 0; i < MB; ++i) {
      const PVec r = acc[i][v] + b;
      float* yr = y + i * out + v * kPanel;
      if (cols == kPanel) {
        glm_lightning_ops::Lanes<float>::store(yr, r);
      } else {
        float tmp[kPanel];
        glm_lightning_ops::Lanes<float>::store(tmp, r);
        std::memcpy(yr, tmp, cols * sizeof(float));
      }
    }
  }
}

// tile<mb, V> for a run-time mb in [1, kTileAcc / V]: every row count gets its own register tile (a tile padded with
// dummy rows, or one row at a time, would multiply the work or wait on one multiply-add chain per output).
template <int V, bool XT, int MB = 1, typename W>
inline void tile_rows(int64_t mb, const float* x, const W* P, float* y, int64_t in, int64_t out, int64_t last_cols,
                      const float* bias, bool prefetch) {
  if constexpr ((MB + 1) * V <= kTileAcc) {
    if (mb > MB) return tile_rows<V, XT, MB + 1, W>(mb, x, P, y, in, out, last_cols, bias, prefetch);
  }
  tile<MB, V, XT>(x, P, y, in, out, last_cols, bias, prefetch);
}

// Panels [p_begin, p_end) of one matrix against its `rows` rows, V panels at a time and up to kTileAcc / V rows per
// tile: as many accumulators as the registers hold (MB x V <= kTileAcc leaves room for the V weight vectors), and
// several panels streaming at once when there are few rows (one row and one panel would wait on one chain of
// multiply-adds). The first row block streams the panels from memory (prefetching); the others find
// them in cache. Panels left over at the end (fewer than V) run one at a time (V = 1 only with XT: x's blocks are
// transposed for one block height).
template <int V, bool XT, typename W>
inline void tiles(const float* x, const W* P, float* y, int64_t rows, int64_t p_begin, int64_t p_end, int64_t in,
                  int64_t out, const float* bias) {
  for (int64_t p = p_begin; p < p_end;) {
    const int64_t v = std::min<int64_t>(V, p_end - p);
    const int64_t last_cols = std::min<int64_t>(kPanel, out - (p + v - 1) * kPanel);
    if (v == V) {
      for (int64_t m = 0; m < rows; m += kTileAcc / V)
        tile_rows<V, XT>(std::min<int64_t>(kTileAcc / V, rows - m), x + m * in, P + p * panel_rows<W>(in) * kPanel,
                     y + m * out + p * kPanel, in, out, last_cols, bias == nullptr ? nullptr : bias + p * kPanel,
                     m == 0);
    } else {
      for (int64_t j = p; j < p + v; ++j)
        for (int64_t m = 0; m < rows; m += kTileAcc)
          tile_rows<1, false>(std::min<int64_t>(kTileAcc, rows - m), x + m * in, P + j * panel_rows<W>(in) * kPanel,
                       y + m * out + j * kPanel, in, out, j == p + v - 1 ? last_cols : kPanel,
                       bias == nullptr ? nullptr : bias + j * kPanel, m == 0);
    }
    p += v;
  }
}

// Whether a matrix's `rows` rows run as one-panel tiles of kTileAcc rows, read from x's transposed blocks
// (transpose_blocks): more than kTileAcc / 2 rows.
inline bool tall(int64_t rows) { return rows > kTileAcc / 2; }

// x's rows [rows, in] as blocks of kTileAcc rows (the last one shorter), each transposed to [in, mb]: a tile then reads
// its MB values at step k from one place (x_t + k * MB), one address register for all rows. Read from the rows
// themselves, a 16-row tile needs 16 row addresses: more than the general registers left beside the loop's, so the
// compiler spilled them and moved them back per step through vector registers on the ports the multiply-adds use.
// Measured on an Intel Xeon (AVX-512, 1 thread, benchmarks/bench_panel_matmul.py's shapes, 16 rows, weights cold,
// process time, median of 7, the forms in turns): fp32 [768 x 192] 94 -> 81 us, bf16 [576 x 192] 71 -> 57 us,
// [768 x 192] 90 -> 70 us; rows up to kTileAcc / 2 (several panels per tile, at most 8 rows) gained nothing, and stay
// rows. A flash-25m decode step (16 rows, the two forms switched in turns in one process): fp32 19.3 -> 18.5 ms,
// bf16 15.4 -> 15.2 ms (medians of 9 rounds on the shared machine).
// A block of L rows (AVX-512's 16-row tiles) goes through register transposes of L x L (lanes.h), L values of each
// row at a time; other block heights (AVX2's 12-row tiles, a shorter last block) element by element.
void transpose_blocks(const float* x, float* xt, int64_t rows, int64_t in) {
  using L = glm_lightning_ops::Lanes<float>;
  for (int64_t m = 0; m < rows; m += kTileAcc) {
    const int64_t mb = std::min<int64_t>(kTileAcc, rows - m);
    const float* xb = x + m * in;
    float* tb = xt + m * in;
    int64_t k0 = 0;
    if (mb == L::N) {
      PVec r[L::N];
      for (; k0 + L::N <= in; k0 += L::N) {
        for (int64_t i = 0; i < L::N; ++i) r[i] = L::load(xb + i * in + k0);
        L::transpose(r);  // r[j] lane i = x[i, k0 + j]
        for (int64_t j = 0; j < L::N; ++j) L::store(tb + (k0 + j) * mb, r[j]);
      }
    }
    for (int64_t k = k0; k < in; ++k)
      for (int64_t i = 0; i < mb; ++i) tb[k * mb + i] = xb[i * in + k];
  }
}

// x_t: x's transposed blocks where tall(rows), else unused.
template <typename W>
inline void matrix(const float* x, const float* x_t, const W* P, float* y, int64_t rows, int64_t p_begin,
                   int64_t p_end, int64_t in, int64_t out, const float* bias) {
  if (tall(rows)) return tiles<1, true>(x_t, P, y, rows, p_begin, p_end, in, out, bias);
  if (rows > kTileAcc / 4) return tiles<2, false>(x, P, y, rows, p_begin, p_end, in, out, bias);
  return tiles<4, false>(x, P, y, rows, p_begin, p_end, in, out, bias);
}

// Packing runs once per generation over every weight the decode reads (flash-25m: 127 packs), so each
// panel is written as register transposes of L x L blocks: L weight rows' next L values loaded as L vectors (each row
// read contiguously), transposed in registers (lanes.h), stored as L contiguous panel rows; a ragged last panel's
// missing outputs are zero vectors, a ragged end of `in` goes through a zeroed L x L buffer. The panels may take
// another dtype than W: fp32 -> bf16 rounds to nearest even (c10::BFloat16's rounding, lanes.h store_bf16) in the
// same pass; a bf16 W is widened exactly first. All 196 of flash-25m's matrices (106 MB), 1 thread, Intel Xeon: the
// scalar blocked transpose before took 2.0x the time of a clone of the same bytes (43.6-46.5 ms against 20.9-21.1,
// process time, the two builds in turns), these transposes 1.5x (28.9-41.8 against 20.0-26.6 ms); bf16 panels
// 1.0x -> 1.1-1.3x of the (fp32) clone (36.5-37.6 -> 22.1-32.9 ms).
inline PVec pack_load(const float* p) { return glm_lightning_ops::Lanes<float>::load(p); }
inline PVec pack_load(const at::BFloat16* p) {
  return glm_lightning_ops::load_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline void pack_store(float* p, const PVec& v) { glm_lightning_ops::Lanes<float>::store(p, v); }
inline void pack_store(at::BFloat16* p, const PVec& v) {
  glm_lightning_ops::store_bf16(reinterpret_cast<uint16_t*>(p), v);
}

// Rows j, j + 1 of a transposed block as L pairs (amx_panels.h's layout): lanes c of `a` and `b` interleaved.
template <int... I>
inline void zip(const PVec& a, const PVec& b, PVec& lo, PVec& hi, std::integer_sequence<int, I...>) {
  lo = __builtin_shufflevector(a, b, ((I % 2) * kPanel + I / 2)...);
  hi = __builtin_shufflevector(a, b, ((I % 2) * kPanel + kPanel / 2 + I / 2)...);
}

// The panel rows [k0, k0 + n) of a transposed block r into the panel at dst: fp32 row by row; bf16 as pairs of rows
// (n rounded up to even: an odd `in`'s padding row is one of r's zero rows).
inline void pack_rows(float* dst, PVec* r, int64_t k0, int64_t n) {
  for (int64_t j = 0; j < n; ++j) pack_store(dst + (k0 + j) * kPanel, r[j]);
}
inline void pack_rows(at::BFloat16* dst, PVec* r, int64_t k0, int64_t n) {
  for (int64_t j = 0; j < n; j += 2) {
    PVec lo, hi;
    zip(r[j], r[j + 1], lo, hi, std::make_integer_sequence<int, kPanel>{});
    pack_store(dst + (k0 + j) * kPanel, lo);
    pack_store(dst + (k0 + j) * kPanel + kPanel, hi);
  }
}

template <typename S, typename D>
void pack(const S* wp, D* pp, int64_t E, int64_t out, int64_t in, int64_t panels) {
  at::parallel_for(0, E * panels, 1, [&](int64_t begin, int64_t end) {
    PVec r[kPanel];
    S tail[kPanel * kPanel];  // the ragged end of `in`, zero padded
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = t / panels, p = t % panels, cols = std::min(kPanel, out - p * kPanel);
      D* dst = pp + t * panel_rows<D>(in) * kPanel;
      const S* src = wp + (e * out + p * kPanel) * in;
      for (int64_t k0 = 0; k0 < in; k0 += kPanel) {
        const int64_t n = std::min(kPanel, in - k0);
        if (n < kPanel) {
          std::fill(tail, tail + kPanel * kPanel, S(0.f));
          for (int64_t c = 0; c < cols; ++c) std::copy(src + c * in + k0, src + c * in + k0 + n, tail + c * kPanel);
        }
        for (int64_t c = 0; c < kPanel; ++c)
          r[c] = c >= cols ? PVec{} : n < kPanel ? pack_load(tail + c * kPanel) : pack_load(src + c * in + k0);
        glm_lightning_ops::Lanes<float>::transpose(r);
        pack_rows(dst, r, k0, n);
      }
    }
  });
}

// fn(T{}) for the panels' element type: float, or at::BFloat16 (the kernel reads its bits as uint16_t).
template <typename F>
void with_type(at::ScalarType t, F&& fn) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "panels are fp32 or bf16, got ", t);
  if (t == at::kFloat) return fn(float{});
  return fn(at::BFloat16{});
}

at::Tensor panel_pack(const at::Tensor& W_in, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(W_in.dim() == 2 || W_in.dim() == 3, "expected W [out, in] or [E, out, in]");
  TORCH_CHECK(W_in.device().is_cpu(), "CPU only");
  const bool one = W_in.dim() == 2;
  const at::Tensor W = W_in.contiguous();
  const int64_t E = one ? 1 : W.size(0), out = W.size(-2), in = W.size(-1), panels = (out + kPanel - 1) / kPanel;
  const at::ScalarType dt = dtype.value_or(W.scalar_type());
  const int64_t rows = dt == at::kBFloat16 ? panel_rows<at::BFloat16>(in) : in;
  at::Tensor P = at::empty(one ? at::IntArrayRef{panels, rows, kPanel} : at::IntArrayRef{E, panels, rows, kPanel},
                           W.options().dtype(dt));
  with_type(W.scalar_type(), [&](auto s) {
    with_type(P.scalar_type(), [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      pack(W.data_ptr<S>(), P.data_ptr<D>(), E, out, in, panels);
    });
  });
  return P;
}

// The one place that decides whether bf16 panels go through AMX tiles (amx_panels.h): compiled for them, the CPU has
// them, the kernel granted the tile data, and not switched off (panel_amx: tests and benchmarks compare the forms).
std::atomic<bool> amx_wanted{true};

bool amx_available() {
#if GLM_LIGHTNING_AMX
  static const bool granted = glm_lightning_amx::amx_granted();
  return granted;
#else
  return false;
#endif
}

bool amx_on() { return amx_wanted.load(std::memory_order_relaxed) && amx_available(); }

// n values of x rounded to bf16 as c10::BFloat16 rounds (nearest, ties to even), as bits (`bits`) or widened back to
// fp32 (`wide`; either may be null): the input of a product with bf16 panels.
void round_bf16(const float* x, uint16_t* bits, float* wide, int64_t n) {
  using L = glm_lightning_ops::Lanes<float>;
  int64_t i = 0;
  for (; i + kPanel <= n; i += kPanel) {
    uint16_t h[kPanel];
    glm_lightning_ops::store_bf16(h, L::load(x + i));
    if (bits != nullptr) std::memcpy(bits + i, h, sizeof(h));
    if (wide != nullptr) L::store(wide + i, glm_lightning_ops::load_bf16(h));
  }
  for (; i < n; ++i) {
    const c10::BFloat16 h(x[i]);
    if (bits != nullptr) bits[i] = h.x;
    if (wide != nullptr) wide[i] = static_cast<float>(h);
  }
}

constexpr int64_t CHUNK = 4;  // panels per task (64 outputs at 16 lanes; a [192, in] linear: 3 tasks)

#if GLM_LIGHTNING_AMX
// bf16 panels through AMX tiles: x's real rows rounded to bf16 once per call into [E, Mp, in_pad] (Mp: M rounded up
// to 16 rows; padding rows and the odd `in`'s padding column zero), then the same tasks as run_tasks, each thread
// loading the tile configuration for its task range and releasing the tiles after it.
void run_amx(const float* xp, const uint16_t* pp, float* yp, const float* bp, const int64_t* cp, int64_t E, int64_t M,
             int64_t in, int64_t out, int64_t panels) {
  namespace amx = glm_lightning_amx;
  const int64_t in_pad = in + (in & 1), Mp = (M + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
  static_assert(kPanel == 16 && CHUNK == amx::kGroup);
  thread_local std::vector<uint16_t> x_b;
  if (static_cast<int64_t>(x_b.size()) < E * Mp * in_pad) x_b.resize(E * Mp * in_pad);
  uint16_t* xb = x_b.data();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = cp == nullptr ? M : cp[e];
    uint16_t* base = xb + e * Mp * in_pad;
    for (int64_t m = 0; m < rows; ++m) {
      round_bf16(xp + (e * M + m) * in, base + m * in_pad, nullptr, in);
      if (in_pad > in) base[m * in_pad + in] = 0;
    }
    const int64_t end = (rows + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
    std::fill(base + rows * in_pad, base + end * in_pad, uint16_t{0});
  }
  const int64_t per_e = (panels + CHUNK - 1) / CHUNK;
  at::parallel_for(0, E * per_e, 1, [&](int64_t begin, int64_t end) {
    amx::configure(in_pad);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / per_e, p_begin = (task % per_e) * CHUNK, p_end = std::min(panels, p_begin + CHUNK);
      const int64_t rows = cp == nullptr ? M : cp[e];
      if (rows == 0) continue;
      amx::matrix(xb + e * Mp * in_pad, pp + e * panels * in_pad * kPanel, yp + e * M * out, rows, p_begin, p_end,
                  in_pad, out, bp == nullptr ? nullptr : bp + e * out);
    }
    amx::release();
  });
}
#endif

// The matrices' tasks: CHUNK panels of one matrix each, against its real rows. bf16 panels take x rounded to bf16
// (through AMX tiles where amx_on, else widened: x's rounded values in fp32 times the widened weights).
template <typename W>
void run_tasks(const float* xp, const W* pp, float* yp, const float* bp, const int64_t* cp, int64_t E, int64_t M,
               int64_t in, int64_t out, int64_t panels) {
  if constexpr (std::is_same_v<W, uint16_t>) {
#if GLM_LIGHTNING_AMX
    if (amx_on()) return run_amx(xp, pp, yp, bp, cp, E, M, in, out, panels);
#endif
    thread_local std::vector<float> x_r;
    if (static_cast<int64_t>(x_r.size()) < E * M * in) x_r.resize(E * M * in);
    round_bf16(xp, nullptr, x_r.data(), E * M * in);
    xp = x_r.data();
  }
  const int64_t per_e = (panels + CHUNK - 1) / CHUNK, pstride = panel_rows<W>(in) * kPanel;
  // The tall matrices' transposed blocks, once per call (every task of a matrix reads them); the buffer is this
  // thread's, reused across calls (the decode makes ~130 a step).
  thread_local std::vector<float> x_t;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = cp == nullptr ? M : cp[e];
    if (!tall(rows)) continue;
    if (static_cast<int64_t>(x_t.size()) < E * M * in) x_t.resize(E * M * in);
    transpose_blocks(xp + e * M * in, x_t.data() + e * M * in, rows, in);
  }
  const float* tp = x_t.data();  // (read only where tall: then sized above)
  at::parallel_for(0, E * per_e, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / per_e, p_begin = (task % per_e) * CHUNK, p_end = std::min(panels, p_begin + CHUNK);
      const int64_t rows = cp == nullptr ? M : cp[e];
      if (rows == 0) continue;
      matrix(xp + e * M * in, tall(rows) ? tp + e * M * in : nullptr, pp + e * panels * pstride,
             yp + e * M * out, rows, p_begin, p_end, in, out, bp == nullptr ? nullptr : bp + e * out);
    }
  });
}

// panel_amx(enable): switch the AMX form on (where available) or off; returns whether bf16 panels now use it.
bool panel_amx(std::optional<bool> enable) {
  if (enable.has_value()) amx_wanted.store(*enable, std::memory_order_relaxed);
  return amx_on();
}

}  // namespace

namespace panel_ops {  // named: moe_decode.cpp calls it as a C++ function (no dispatch per call)

// A view's own contiguity: `contiguous()` is free when it already is (no dispatch), and the sizes are read from the
// tensor as given (no unsqueeze: each view is a dispatched op, and a decode step makes ~130 of these calls).
at::Tensor panel_matmul(const at::Tensor& x_in, const at::Tensor& P_in, int64_t out,
                        const std::optional<at::Tensor>& counts_in, const std::optional<at::Tensor>& bias_in) {
  const bool one = P_in.dim() == 3;
  TORCH_CHECK((one && x_in.dim() >= 1) || (x_in.dim() == 3 && P_in.dim() == 4 && x_in.size(0) == P_in.size(0)),
              "expected x [..., in] and P [panels, in, L], or x [E, M, in] and P [E, panels, in, L]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(P_in.scalar_type() == at::kFloat || P_in.scalar_type() == at::kBFloat16, "P must be fp32 or bf16");
  TORCH_CHECK(x_in.device().is_cpu() && P_in.device().is_cpu(), "CPU only");
  const at::Tensor x = x_in.contiguous(), P = P_in.contiguous();
  const int64_t in = x.size(-1), E = one ? 1 : x.size(0), M = one ? x.numel() / std::max<int64_t>(in, 1) : x.size(1),
                panels = P.size(-3);
  const int64_t rows_p = P.scalar_type() == at::kFloat ? in : panel_rows<uint16_t>(in);  // bf16: pairs
  TORCH_CHECK(P.size(-2) == rows_p && P.size(-1) == kPanel, "P must be panel_pack's [.., panels, ", rows_p, ", ",
              kPanel, "] for x's in = ", in);
  TORCH_CHECK(out > (panels - 1) * kPanel && out <= panels * kPanel, "out ", out, " does not match ", panels,
              " panels");
  at::Tensor counts;
  if (counts_in.has_value()) {
    counts = counts_in->scalar_type() == at::kLong ? counts_in->contiguous() : counts_in->to(at::kLong).contiguous();
    TORCH_CHECK(counts.numel() == E, "counts must hold one row count per matrix");
  }
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == E * out, "bias must be fp32 [E, out] or [out]");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t* cp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  glm_lightning_ops::zero_padding_rows(yp, cp, E, M, out);
  if (P.scalar_type() == at::kFloat)
    run_tasks(x.data_ptr<float>(), P.data_ptr<float>(), yp, bp, cp, E, M, in, out, panels);
  else  // bf16 panels: their bits, widened in the kernel
    run_tasks(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>()), yp, bp, cp, E, M,
              in, out, panels);
  return y;
}

}  // namespace panel_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("panel_pack(Tensor W, ScalarType? dtype=None) -> Tensor");
  m.def("panel_matmul(Tensor x, Tensor P, int out, Tensor? counts=None, Tensor? bias=None) -> Tensor");
  m.def("panel_amx(bool? enable=None) -> bool", &panel_amx);  // no tensors: one kernel for every backend
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_matmul", &panel_ops::panel_matmul);
}
