// out = x W^T for the dense matmuls of a decode step (tens of rows) and of prefill chunks: for
// bfloat16 x and W on CPUs with AVX512_BF16, for 4-bit W there too, and for float32 on every ISA
// (its section below).
//
// bfloat16: W is packed once at load (model/prepacked.py) into panels of 32 output columns, each panel
// [k / 2][32][2] (the last one [k / 2][n % 32][2] when 32 does not divide n): column c's
// consecutive k pairs side by side, so one vdpbf16ps multiplies a
// broadcast pair of x by 32 pairs of W (two vectors) and adds both products to float32 sums.
// A micro-kernel holds R rows x 32 columns of sums in registers (2 R of the 32) for the whole of
// k: per pair of k, 2 loads of W and R broadcasts feed 2 R dot products.
//
// Why not oneDNN (torch's bf16 matmul): at a decode step's 64 rows the weights come from memory
// (270 MB a step for SmolLM2-135M) and oneDNN leaves the cores waiting for them. Here each
// thread prefetches its next panel while it multiplies the current one, and the calls cost less:
// a step's matmuls take 24.7 ms instead of 30.8 at 64 rows, 8.3 instead of 11.9 at one
// (BENCHMARKS.md "A bf16 GEMM of our own"; 1.16-1.30x at 64 rows over runs).
//
// Rows are taken in chunks whose x fits in L2, so large prefill chunks do not reread x from
// memory for every panel. Threads split the (chunk, panel) pairs into contiguous ranges.
//
// Like the other kernels: no torch headers, called through ctypes with the parameter struct of
// pagedkv_abi.h. The bfloat16 and 4-bit kernels are built only where the compiler targets
// AVX512_BF16 (pagedkv_bf16_gemm says); elsewhere they refuse.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "pagedkv_abi.h"
#include "micro.h"
#include "vec.h"

#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__)
#define PAGEDKV_BF16_GEMM 1
#endif
#include "amx.h"

namespace {

using namespace pk;

constexpr int kCols = 32;                 // columns of a panel: two vectors of float32 sums
constexpr int kRowBlock = 12;             // rows of a micro-kernel: 24 sums + 2 W vectors in registers
constexpr int64_t kChunkBytes = 1 << 18;  // x rows of a chunk: this many bytes at most (L2)

int fail(char* err, int errlen, const char* msg, long long a, long long b) {
  std::snprintf(err, size_t(errlen), msg, a, b);
  return 1;
}

// Both kernels' row strides against their row lengths (k of x, n of out): 0, or 1 with a message.
template <typename Params>
int check_strides(const Params& P, char* err, int errlen) {
  if (P.x_stride >= P.k && P.out_stride >= P.n) return 0;
  return fail(err, errlen, "row strides below the row lengths (x_stride %lld, out_stride %lld)", P.x_stride,
              P.out_stride);
}

// Runs run(r0, rows, panel, ahead) over (chunk of rows, panel) pairs, split into contiguous ranges
// among the threads; `ahead` is true when the same thread takes the next panel of the chunk next
// (so its weights may be prefetched). Chunks are of equal rows (whole row blocks of `block` but the
// last): as few as keep each within kChunkBytes of x, unless the panels alone are too few to give
// every thread about four items (a narrow matrix on many cores), and never more than there are
// row blocks.
template <typename F>
void over_runs(int64_t rows, int64_t panels, int64_t row_bytes, int64_t block, int max_threads, F&& run,
               int64_t chunk_bytes = kChunkBytes) {
  const int64_t most = std::max<int64_t>(block, chunk_bytes / row_bytes);
  const int64_t blocks = (rows + block - 1) / block;
  const int64_t spread = (4 * int64_t(std::max(1, max_threads)) + panels - 1) / panels;
  const int64_t want = std::max<int64_t>(1, std::min(blocks, std::max((rows + most - 1) / most, spread)));
  const int64_t chunk = ((rows + want - 1) / want + block - 1) / block * block;
  const int64_t items = (rows + chunk - 1) / chunk * panels;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(max_threads, items)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = items * t / nt, hi = items * (t + 1) / nt;  // chunk-major
    for (int64_t i = lo; i < hi;) {  // the thread's panels of each chunk, as one run
      const int64_t r0 = i / panels * chunk, end = std::min(hi, (i / panels + 1) * panels);
      run(r0, std::min(chunk, rows - r0), i % panels, i % panels + (end - i));
      i = end;
    }
  }
}

// over_runs one (chunk, panel) at a time: run(r0, rows, panel, ahead), `ahead` true when the same
// thread takes the next panel of the chunk next (so its weights may be prefetched).
template <typename F>
void over_items(int64_t rows, int64_t panels, int64_t row_bytes, int64_t block, int max_threads, F&& run,
                int64_t chunk_bytes = kChunkBytes) {
  over_runs(rows, panels, row_bytes, block, max_threads, [&](int64_t r0, int64_t n, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run(r0, n, p, p + 1 < p1);
  }, chunk_bytes);
}

// Each row's sum of x over each group of k (the zeros' term of the 4-bit kernels), [rows][groups],
// once for all panels; and x itself in float [rows][k] into xf unless null. X: x's type.
template <typename X>
std::vector<float> group_sums(const pagedkv_gemm_int4_params& P, float* xf) {
  const auto* x = static_cast<const X*>(P.x);
  const int64_t groups = P.k / P.group;
  std::vector<float> sums(size_t(P.rows * groups));
  for (int64_t r = 0; r < P.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      Vec sum = zero();
      for (int64_t c = g * P.group; c < (g + 1) * P.group; c += W) {
        const Mask m = lanes((g + 1) * P.group, c);
        const Vec v = load(x + r * P.x_stride + c, m);
        if (xf) store(xf + r * P.k + c, v, m);
        sum = add(sum, v);
      }
      sums[size_t(r * groups + g)] = hsum(sum);
    }
  return sums;
}

// The row blocks of a 4-bit GEMM's (chunk, panel) items: run(R, row, panel, its codes, its scales,
// the next panel's codes when the same thread takes it next (else null), their bytes).
template <int Block, typename F>
void over_int4_items(const pagedkv_gemm_int4_params& P, int64_t row_bytes, F&& run) {
  const auto* codes = static_cast<const uint8_t*>(P.codes);
  const auto* sz = static_cast<const uint16_t*>(P.scales);
  const int64_t panels = P.n / kCols, code_bytes = P.k / 2 * kCols, sz_elems = P.k / P.group * 2 * kCols;
  over_items(P.rows, panels, row_bytes, Block, P.threads, [&](int64_t r0, int64_t rows, int64_t p, bool ahead) {
    const uint8_t* c = codes + p * code_bytes;
    const char* next = ahead ? reinterpret_cast<const char*>(c + code_bytes) : nullptr;
    by_row_blocks<Block>(rows, [&](auto R, int64_t r) {
      run(R, r0 + r, p, c, sz + p * sz_elems, r == 0 ? next : nullptr, code_bytes);
    });
  });
}

#ifdef PAGEDKV_BF16_GEMM

// acc[r] += x[r]'s k pair (at x + r * x_stride, broadcast) . the pairs of 32 columns in w0, w1.
template <int R>
__attribute__((always_inline)) inline void dot_pairs(__m512 (&acc)[R][2], const uint16_t* x, int64_t x_stride,
                                                     __m512bh w0, __m512bh w1) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    __builtin_memcpy(&pair, x + r * x_stride, 4);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
  }
}

// y[R rows, cols] = x[R rows, k] . panel; `ahead` (or null) is the next panel, prefetched a
// pair of cache lines per k pair so that it is in cache when its turn comes. Full: cols is 32
// (masked loads of W instead cost 2.5x in a prototype, so only the last panel takes them).
template <int R, bool Full>
__attribute__((always_inline)) inline void micro(const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                                                 int64_t pairs, bf16* y, int64_t y_stride, int cols,
                                                 const char* ahead) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // a pair row holds `cols` columns (32 but in the last panel): masks for its two halves
  const Mask m0 = cols >= W ? kFull : first_lanes(cols), m1 = cols >= 2 * W ? kFull : first_lanes(std::max(0, cols - W));
  const int64_t row = Full ? 2 * kCols : 2 * cols;
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead) {
      prefetch(ahead + p * 128);
      prefetch(ahead + p * 128 + 64);
    }
    const __m512bh w0 = (__m512bh)(Full ? _mm512_loadu_si512(panel + p * row)
                                         : _mm512_maskz_loadu_epi32(m0, panel + p * row));
    const __m512bh w1 = (__m512bh)(Full ? _mm512_loadu_si512(panel + p * row + 32)
                                         : _mm512_maskz_loadu_epi32(m1, panel + p * row + 32));
    dot_pairs<R>(acc, x + 2 * p, x_stride, w0, w1);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store(y + r * y_stride, acc[r][0], Full ? kFull : m0);
    if (Full || cols > W) store(y + r * y_stride + W, acc[r][1], Full ? kFull : m1);
  }
}

// Two whole panels at once, y[R rows, 64 columns]: per k pair four W vectors and R broadcasts of x
// feed 4 R dot products (micro: two and R for 2 R), the same sums in the same order as micro's.
// From 24 rows on: 1.03-1.17x micro's rate at 64 rows on Gemma-2-2B's and the default model's
// shapes, W1 / W2 +4-11% (BENCHMARKS.md "Session 26"); at fewer rows it lost as often as it won.
template <int R>
__attribute__((always_inline)) inline void micro2(const uint16_t* x, int64_t x_stride, const uint16_t* pa,
                                                  const uint16_t* pb, int64_t pairs, bf16* y, int64_t y_stride,
                                                  const char* ahead, int64_t ahead_gap) {
  __m512 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead) {
      prefetch(ahead + p * 128);
      prefetch(ahead + p * 128 + 64);
      prefetch(ahead + ahead_gap + p * 128);
      prefetch(ahead + ahead_gap + p * 128 + 64);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pa + p * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pa + p * 2 * kCols + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(pb + p * 2 * kCols);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(pb + p * 2 * kCols + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * x_stride + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) store(y + r * y_stride + v * W, acc[r][v], kFull);
}

constexpr int kRowBlock2 = 6;  // rows of micro2: 24 sums + 4 W vectors

#ifdef PAGEDKV_AMX
// AMX (Sapphire Rapids and later): a tile multiply takes 16 rows x 32 k of x against 32 k x 16
// columns of W, 16 times the work of a vdpbf16ps. A panel's pair rows are already AMX's B layout
// (VNNI: 16 columns' k pairs side by side, 64 bytes a row), so each half of a panel is a B tile
// whose rows are 128 bytes apart: the same packed weights serve both kernels. From kAmxRows rows
// on (a prefill chunk, a decode step of eight sequences or more) tiles are used; at a
// step of 64 rows the default model's matmuls take ~5x less time (BENCHMARKS.md "Session 40").
// The sums run in another order, so a row's result may differ from micro's by a bf16 rounding.

// fewest rows given to tiles (the default model's matmuls, ms: at 4 rows 9.7 by dot products
// against 10.6 by tiles, at 8 11.9 against 10.9, at 12 15.7 against 10.9)
constexpr int64_t kAmxRows = 8;
constexpr int64_t kAmxBlock = 32;  // rows of a block: two A tiles against the two halves of a panel
// x rows of a chunk for tiles: tiles multiply so fast that rereading the weights for each chunk of
// kChunkBytes costs more than a larger x kept in L2 does. 1 MiB took the default model's matmuls
// at 256 rows from 55.9 to 44.3 ms (bench_prepacked.py), at 1024 rows from 206 to 178.
constexpr int64_t kAmxChunkBytes = 1 << 20;
// Weights a row block meets before the next block does (gemm_amx): whole panels, within L2 (2 MiB a
// core on Sapphire Rapids) beside the blocks' x. bench_prepacked.py, the default model's matmuls,
// one panel at a time against groups of 1 MiB (alternating, ms): 64 rows 17.6-17.8 -> 16.5-16.8,
// 256 rows 50-50.4 -> 42, 1024 rows 200-202 -> 166-167; a thread's whole run at once lost (256
// rows: 47-51).
constexpr int64_t kAmxGroupBytes = 1 << 20;

// y[m rows, 32 columns] = a[16 (Two: 32) rows, k] . a whole panel, k a multiple of 32; a's rows
// from m on are read (padding) but not stored. `ahead` (or null): the next panel, prefetched a
// k step at a time.
template <bool Two>
void amx_block(const uint16_t* a, int64_t a_stride, const uint16_t* panel, int64_t k, bf16* y, int64_t y_stride,
               int64_t m, const char* ahead) {
  _tile_zero(0);
  _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kk = 0; kk < k; kk += 32) {
    const uint16_t* b = panel + kk * kCols;  // pair row kk / 2, 2 kCols elements each
    if (ahead)  // the next panel's same 2 KiB, so that its tiles come from cache
      for (int line = 0; line < 32; ++line) prefetch(ahead + kk * kCols * 2 + line * 64);
    _tile_loadd(6, b, 4 * kCols);
    _tile_loadd(7, b + kCols, 4 * kCols);
    _tile_loadd(4, a + kk, 2 * a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (Two) {
      _tile_loadd(5, a + 16 * a_stride + kk, 2 * a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (Two) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = i / 16 * 2, row = i % 16;
    store(y + i * y_stride, _mm512_load_ps(c[t][row]), kFull);
    store(y + i * y_stride + W, _mm512_load_ps(c[t + 1][row]), kFull);
  }
}

// The whole panels by tiles, the narrower last one (n % 32 columns) by micro. Row blocks of 32
// (chunks are whole blocks); the last block, when short, reads its rows from a zero-padded copy.
void gemm_amx(const pagedkv_gemm_bf16_params& P) {
  const auto* x = static_cast<const uint16_t*>(P.x);
  const auto* w = static_cast<const uint16_t*>(P.w);
  bf16* y = static_cast<bf16*>(P.out);
  const int64_t whole = P.n / kCols, panels = (P.n + kCols - 1) / kCols, panel_elems = P.k * kCols;
  const int64_t tail_row = P.rows / kAmxBlock * kAmxBlock, tail = P.rows - tail_row;
  std::vector<uint16_t> pad(size_t(tail ? kAmxBlock * P.k : 0), 0);
  for (int64_t r = 0; r < tail; ++r)
    std::memcpy(pad.data() + r * P.k, x + (tail_row + r) * P.x_stride, size_t(2 * P.k));
  // A run of panels goes in groups of kAmxGroupBytes: each row block meets the whole group before
  // the next block does, so the group's weights come from memory once and from L2 after, and each
  // block's x stays in cache across the group.
  const int64_t group = std::max<int64_t>(1, kAmxGroupBytes / (2 * panel_elems));
  over_runs(P.rows, panels, 2 * P.k, kAmxBlock, P.threads, [&](int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
    const int64_t last = std::min(p1, whole);
    if (last > p0) amx_configure();
    for (int64_t g0 = p0; g0 < last; g0 += group) {
      const int64_t g1 = std::min(last, g0 + group);
      for (int64_t r = r0; r < r0 + rows; r += kAmxBlock) {
        const int64_t m = std::min(kAmxBlock, r0 + rows - r);
        const bool padded = r == tail_row;
        const uint16_t* a = padded ? pad.data() : x + r * P.x_stride;
        const int64_t a_stride = padded ? P.k : P.x_stride;
        for (int64_t p = g0; p < g1; ++p) {
          const uint16_t* panel = w + p * panel_elems;
          // the first block prefetches the next panel (the group's, or the next group's first)
          const char* pf = r == r0 && p + 1 < last ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
          bf16* yr = y + r * P.out_stride + p * kCols;
          if (m > 16) amx_block<true>(a, a_stride, panel, P.k, yr, P.out_stride, m, pf);
          else amx_block<false>(a, a_stride, panel, P.k, yr, P.out_stride, m, pf);
        }
      }
    }
    if (p1 > whole) {  // the narrower last panel
      const int cols = int(P.n - whole * kCols);
      const uint16_t* panel = w + whole * panel_elems;
      by_row_blocks<kRowBlock>(rows, [&](auto R, int64_t r) {
        micro<R, false>(x + (r0 + r) * P.x_stride, P.x_stride, panel, P.k / 2,
                        y + (r0 + r) * P.out_stride + whole * kCols, P.out_stride, cols, nullptr);
      });
    }
  }, kAmxChunkBytes);
}
#endif

void gemm(const pagedkv_gemm_bf16_params& P) {
#ifdef PAGEDKV_AMX
  if (P.rows >= kAmxRows && P.k % 32 == 0 && amx_ready()) return gemm_amx(P);
#endif
  const auto* x = static_cast<const uint16_t*>(P.x);
  const auto* w = static_cast<const uint16_t*>(P.w);
  bf16* y = static_cast<bf16*>(P.out);
  const int64_t pairs = P.k / 2, panels = (P.n + kCols - 1) / kCols, panel_elems = P.k * kCols;
  // Many rows: pairs of whole panels, then the rest one by one, where the threads' shares of the
  // pairs (each ~1.8 panels' time) end sooner than their shares of single panels would (576
  // columns on two threads: 9 pairs split 5 / 4 lose to 18 panels split 9 / 9).
  const int64_t twos = P.n / (2 * kCols), units = twos + (panels - 2 * twos);
  const int64_t threads = std::max(1, P.threads);
  const bool paired = 18 * ((units + threads - 1) / threads) < 10 * ((panels + threads - 1) / threads);
  if (P.rows >= 2 * kRowBlock && paired) {
    over_items(P.rows, units, 2 * P.k, kRowBlock2, P.threads, [&](int64_t r0, int64_t rows, int64_t u, bool ahead) {
      const int64_t first = u < twos ? 2 * u : 2 * twos + (u - twos);  // the unit's (first) panel
      const uint16_t* pa = w + first * panel_elems;
      const char* next = ahead && u + 1 < twos ? reinterpret_cast<const char*>(pa + 2 * panel_elems) : nullptr;
      const int cols = int(std::min<int64_t>(kCols, P.n - first * kCols));
      by_row_blocks<kRowBlock2>(rows, [&](auto R, int64_t r) {
        const uint16_t* xr = x + (r0 + r) * P.x_stride;
        bf16* yr = y + (r0 + r) * P.out_stride + first * kCols;
        const char* pf = r == 0 ? next : nullptr;
        if (u < twos) micro2<R>(xr, P.x_stride, pa, pa + panel_elems, pairs, yr, P.out_stride, pf, 2 * panel_elems);
        else if (cols == kCols) micro<R, true>(xr, P.x_stride, pa, pairs, yr, P.out_stride, cols, nullptr);
        else micro<R, false>(xr, P.x_stride, pa, pairs, yr, P.out_stride, cols, nullptr);
      });
    });
    return;
  }
  over_items(P.rows, panels, 2 * P.k, kRowBlock, P.threads, [&](int64_t r0, int64_t rows, int64_t p, bool ahead) {
    const char* next = ahead ? reinterpret_cast<const char*>(w + (p + 1) * panel_elems) : nullptr;
    const int cols = int(std::min<int64_t>(kCols, P.n - p * kCols));
    const uint16_t* panel = w + p * panel_elems;
    by_row_blocks<kRowBlock>(rows, [&](auto R, int64_t r) {
      const uint16_t* xr = x + (r0 + r) * P.x_stride;
      bf16* yr = y + (r0 + r) * P.out_stride + p * kCols;
      const char* pf = r == 0 ? next : nullptr;  // (the first block prefetches for all)
      if (cols == kCols) micro<R, true>(xr, P.x_stride, panel, pairs, yr, P.out_stride, cols, pf);
      else micro<R, false>(xr, P.x_stride, panel, pairs, yr, P.out_stride, cols, pf);
    });
  });
}

// ---------------------------------------------------------------------------------------
// 4-bit weights, w = (q - 8) * scale + zero per group of k (torch's int4 convention; GGUF's
// Q4_0 / Q4_1 / Q4_K map onto it, quant_linear.py). A panel of 32 columns holds per k pair 32
// bytes of codes: byte j's low nibble is element j of the pair row (column j / 2, k parity
// j % 2), its high nibble element j + 32 (column 16 + j / 2); then per group the 32 scales and
// the 32 zeros in bf16. One table lookup (vpermw) turns 32 codes into bf16 (q - 8), exact, so a
// group's dot products run as in the bf16 kernel and are scaled once a group:
//   out = sum_g scale_g * (x . (q - 8))_g + zero_g * sum_g x.
// A quarter of the bf16 weights' bytes: at few rows, where the bytes are the cost, 1.5-2x the
// speed of torch's int4 kernel (BENCHMARKS.md "A bf16 GEMM of our own").

constexpr int kRowBlock4 = 6;  // rows: 12 sums + 12 group partials + 2 W vectors + table + mask

// bf16 bits of q - 8 for the codes q = 0..15 (twice: vpermw indexes 32 entries)
#define PAGEDKV_CODES 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, \
                      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0
alignas(64) constexpr uint16_t kCodeValues[32] = {PAGEDKV_CODES, PAGEDKV_CODES};
#undef PAGEDKV_CODES

inline __m512 bf16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int R>
__attribute__((always_inline)) inline void micro4(const uint16_t* x, int64_t x_stride, const float* xsum,
                                                  int64_t groups, const uint8_t* codes, const uint16_t* sz,
                                                  int64_t group, bf16* y, int64_t y_stride, const char* ahead,
                                                  int64_t ahead_bytes) {
  const __m512i table = _mm512_load_si512(kCodeValues), low = _mm512_set1_epi16(15);
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t gp = group / 2;  // k pairs a group
  int64_t fetched = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    for (int64_t p = g * gp; p < (g + 1) * gp; ++p) {
      if (ahead && fetched < ahead_bytes) {
        prefetch(ahead + fetched);
        fetched += 64;
      }
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + p * 32)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      dot_pairs<R>(part, x + 2 * p, x_stride, w0, w1);
    }
    const uint16_t* s = sz + g * 64;
    const __m512 s0 = bf16_to_float(s), s1 = bf16_to_float(s + 16);
    const __m512 z0 = bf16_to_float(s + 32), z1 = bf16_to_float(s + 48);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
      acc[r][0] = _mm512_fmadd_ps(part[r][0], s0, _mm512_fmadd_ps(xs, z0, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(part[r][1], s1, _mm512_fmadd_ps(xs, z1, acc[r][1]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store(y + r * y_stride, acc[r][0], kFull);
    store(y + r * y_stride + W, acc[r][1], kFull);
  }
}

void gemm_int4_bf16(const pagedkv_gemm_int4_params& P) {
  const auto* x = static_cast<const uint16_t*>(P.x);
  bf16* y = static_cast<bf16*>(P.out);
  const int64_t groups = P.k / P.group;
  const std::vector<float> xsum = group_sums<bf16>(P, nullptr);
  over_int4_items<kRowBlock4>(P, 2 * P.k, [&](auto R, int64_t r, int64_t p, const uint8_t* c, const uint16_t* s,
                                              const char* next, int64_t next_bytes) {
    micro4<R>(x + r * P.x_stride, P.x_stride, xsum.data() + r * groups, groups, c, s, P.group,
              y + r * P.out_stride + p * kCols, P.out_stride, next, next_bytes);
  });
}

#endif  // PAGEDKV_BF16_GEMM

// ---------------------------------------------------------------------------------------
// float32 weights, on every vector ISA: panels of 2 W output columns (16 with AVX2), each
// [k][2 W], the last one padded with zero columns. Per k, two loads of W and R broadcasts of x
// feed 2 R FMAs into sums that stay in registers for the whole of k (R = 6 with 16 registers,
// 12 with 32); the next panel is prefetched a row per k. At a decode step's 64 rows a matmul
// is bound by the FMA rate, not by the bytes; MKL's sgemm reaches ~60% of it there on AVX2,
// this ~90% (BENCHMARKS.md "A float32 GEMM of our own"). Every loop over the sums is unrolled,
// the ones that zero and store them too: otherwise GCC keeps the array in memory and stores each
// sum after every FMA (half the speed in a prototype). The kernels above take the same care.

void gemm_f32(const pagedkv_gemm_f32_params& P) {
  const auto* x = static_cast<const float*>(P.x);
  const auto* w = static_cast<const float*>(P.w);
  auto* y = static_cast<float*>(P.out);
  const int64_t panels = (P.n + kColsF - 1) / kColsF, panel_elems = P.k * kColsF;
  over_items(P.rows, panels, 4 * P.k, kRowBlockF, P.threads, [&](int64_t r0, int64_t rows, int64_t p, bool ahead) {
    const char* next = ahead ? reinterpret_cast<const char*>(w + (p + 1) * panel_elems) : nullptr;
    const int cols = int(std::min<int64_t>(kColsF, P.n - p * kColsF));
    by_row_blocks<kRowBlockF>(rows, [&](auto R, int64_t r) {
      micro_f32<R>({x + (r0 + r) * P.x_stride, P.x_stride, 1, w + p * panel_elems, kColsF, P.k, P.out_stride},
                   y + (r0 + r) * P.out_stride + p * kColsF, cols, r == 0 ? next : nullptr);
    });
  });
}


// ---------------------------------------------------------------------------------------
// 4-bit weights without AVX512_BF16 (the same panels as gemm_int4_bf16), in float32 FMAs. A
// panel is taken in two halves of 16 columns: per k pair, the low nibbles of its 32 bytes of
// codes are the first half's two k rows (even bytes the first k, odd ones the second), the high
// nibbles the second half's. Each becomes (q - 8) in int8, then float, and R rows' sums of
// x . (q - 8) over a group stay in registers (R x 16 columns); each group's sums are scaled into
// the rows' totals, as gemm_int4_bf16 does:
//   out = sum_g scale_g * (x . (q - 8))_g + zero_g * sum_g x.
// Half a panel keeps 6 rows' sums in AVX2's 16 registers, so steps of up to 6 rows (a single
// stream, a speculative verify) unpack each code once. With AVX2, 1.2x torch's int4 kernel at one
// row and 1.4x at five, about even at 2-4 (the widening to float is the cost; BENCHMARKS.md
// "4-bit weights on AVX2"). The next panel's codes are prefetched: without, 0.7x at one row.

using Bytes32 = uint8_t __attribute__((vector_size(32)));
using Bytes16 = int8_t __attribute__((vector_size(16)));
constexpr int kHalf = kCols / 2;
constexpr int kHalfVecs = kHalf / W;  // vectors of a row's 16 sums
static_assert(kHalf % W == 0, "whole vectors in half a panel");
constexpr int kRowBlockQ = std::min(6, (kRegisters - 4) / kHalfVecs);

template <int R, int H, typename Y>
__attribute__((always_inline)) inline void micro4_f32(const float* x, int64_t k, const float* xsum, int64_t groups,
                                                      const uint8_t* codes, const uint16_t* sz, int64_t group, Y* y,
                                                      int64_t y_stride, const char* ahead, int64_t ahead_bytes) {
  alignas(32) float total[R][kHalf] = {};
  alignas(16) int8_t rows[2][kHalf];
  const int64_t gp = group / 2;  // k pairs a group
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[R][kHalfVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kHalfVecs; ++v) part[r][v] = zero();
    for (int64_t p = g * gp; p < (g + 1) * gp; ++p) {
      if (ahead && p * 64 < ahead_bytes) prefetch(ahead + p * 64);  // the next panel, a line a pair
      Bytes32 b;
      __builtin_memcpy(&b, codes + p * kCols, sizeof b);
      const Bytes32 q = (H ? b >> 4 : b & 15) - 8;  // this half's q - 8, as int8
      const Bytes16 r0 = (Bytes16)__builtin_shufflevector(q, q, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                                          28, 30);
      const Bytes16 r1 = (Bytes16)__builtin_shufflevector(q, q, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                                          29, 31);
      __builtin_memcpy(rows[0], &r0, sizeof r0);
      __builtin_memcpy(rows[1], &r1, sizeof r1);
#pragma GCC unroll 2
      for (int parity = 0; parity < 2; ++parity)
#pragma GCC unroll 4
        for (int v = 0; v < kHalfVecs; ++v) {
          const Vec w = load(reinterpret_cast<const i8*>(rows[parity] + v * W), kFull);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) part[r][v] = fma(set1(x[r * k + 2 * p + parity]), w, part[r][v]);
        }
    }
    const bf16* s = reinterpret_cast<const bf16*>(sz + g * 2 * kCols + H * kHalf);
#pragma GCC unroll 4
    for (int v = 0; v < kHalfVecs; ++v) {
      const Vec scale = load(s + v * W, kFull), zero_ = load(s + kCols + v * W, kFull);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* t = total[r] + v * W;
        store(t, fma(part[r][v], scale, fma(set1(xsum[r * groups + g]), zero_, load(t, kFull))), kFull);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kHalfVecs; ++v)
      store(y + r * y_stride + H * kHalf + v * W, load(total[r] + v * W, kFull), kFull);
}

// X: the type of x and out (bf16, or float32 for a float32 model: no rounding to bf16 between).
template <typename X>
void gemm_int4_f32(const pagedkv_gemm_int4_params& P) {
  X* y = static_cast<X*>(P.out);
  const int64_t groups = P.k / P.group;
  std::vector<float> xf(size_t(P.rows * P.k));  // x in float, once for every panel
  const std::vector<float> xsum = group_sums<X>(P, xf.data());
  over_int4_items<kRowBlockQ>(P, 4 * P.k, [&](auto R, int64_t r, int64_t p, const uint8_t* c, const uint16_t* s,
                                              const char* next, int64_t next_bytes) {
    const float* xr = xf.data() + r * P.k;
    const float* xs = xsum.data() + r * groups;
    X* yr = y + r * P.out_stride + p * kCols;
    micro4_f32<R, 0>(xr, P.k, xs, groups, c, s, P.group, yr, P.out_stride, next, next_bytes);
    micro4_f32<R, 1>(xr, P.k, xs, groups, c, s, P.group, yr, P.out_stride, nullptr, 0);
  });
}

}  // namespace

extern "C" {

int pagedkv_gemm_bf16(const pagedkv_gemm_bf16_params* p, char* err, int errlen) {
#ifdef PAGEDKV_BF16_GEMM
  const pagedkv_gemm_bf16_params& P = *p;
  if (P.rows < 0 || P.n < 1 || P.k < 2 || P.k % 2)
    return fail(err, errlen, "need rows >= 0, n >= 1 and an even k >= 2 (k = %lld, n = %lld)", P.k, P.n);
  if (check_strides(P, err, errlen)) return 1;
  if (P.rows > 0) gemm(P);
  return 0;
#else
  (void)p;
  return fail(err, errlen, "the bf16 GEMM needs AVX512_BF16, which this build lacks", 0, 0);
#endif
}

int pagedkv_gemm_int4(const pagedkv_gemm_int4_params* p, char* err, int errlen) {
  const pagedkv_gemm_int4_params& P = *p;
  if (P.rows < 0 || P.n < kCols || P.n % kCols || P.group < 2 || P.group % 2 || P.k < P.group || P.k % P.group)
    return fail(err, errlen, "need n a multiple of 32 and k a multiple of an even group (n = %lld, k = %lld)", P.n,
                P.k);
  if (P.dtype != PAGEDKV_DTYPE_BFLOAT16 && P.dtype != PAGEDKV_DTYPE_FLOAT32)
    return fail(err, errlen, "x and out must be bfloat16 or float32 (dtype %lld)", P.dtype, 0);
  if (check_strides(P, err, errlen)) return 1;
  if (P.rows == 0) return 0;
#ifdef PAGEDKV_BF16_GEMM
  if (P.dtype == PAGEDKV_DTYPE_FLOAT32) {  // through bf16 rows (x rounded as torch rounds it)
    std::vector<bf16> xb(size_t(P.rows * P.k)), yb(size_t(P.rows * P.n));
    const auto* x = static_cast<const float*>(P.x);
    auto* y = static_cast<float*>(P.out);
    for (int64_t r = 0; r < P.rows; ++r)
      for (int64_t c = 0; c < P.k; c += W) {
        const Mask m = lanes(P.k, c);
        store(xb.data() + r * P.k + c, load(x + r * P.x_stride + c, m), m);
      }
    pagedkv_gemm_int4_params Q = P;
    Q.dtype = PAGEDKV_DTYPE_BFLOAT16;
    Q.x = xb.data(), Q.x_stride = P.k, Q.out = yb.data(), Q.out_stride = P.n;
    gemm_int4_bf16(Q);
    for (int64_t r = 0; r < P.rows; ++r)
      for (int64_t c = 0; c < P.n; c += W) store(y + r * P.out_stride + c, load(yb.data() + r * P.n + c, kFull), kFull);
    return 0;
  }
  gemm_int4_bf16(P);
#else
  if (P.dtype == PAGEDKV_DTYPE_FLOAT32)
    gemm_int4_f32<float>(P);
  else
    gemm_int4_f32<bf16>(P);
#endif
  return 0;
}

int pagedkv_gemm_f32(const pagedkv_gemm_f32_params* p, char* err, int errlen) {
  const pagedkv_gemm_f32_params& P = *p;
  if (P.rows < 0 || P.n < 1 || P.k < 1)
    return fail(err, errlen, "need rows >= 0, n >= 1 and k >= 1 (n = %lld, k = %lld)", P.n, P.k);
  if (check_strides(P, err, errlen)) return 1;
  if (P.rows > 0) gemm_f32(P);
  return 0;
}

int pagedkv_bf16_gemm(void) {
#ifdef PAGEDKV_BF16_GEMM
  return 1;
#else
  return 0;
#endif
}

int pagedkv_amx(void) {
#ifdef PAGEDKV_AMX
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

}  // extern "C"
