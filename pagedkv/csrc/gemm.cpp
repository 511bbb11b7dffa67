// out = x W^T for bfloat16 x and W on CPUs with AVX512_BF16: the dense matmuls of a decode
// step (tens of rows) and of prefill chunks.
//
// W is packed once at load (model/prepacked.py) into panels of 32 output columns, each panel
// [k / 2][32][2] (the last one [k / 2][n % 32][2] when 32 does not divide n): column c's
// consecutive k pairs side by side, so one vdpbf16ps multiplies a
// broadcast pair of x by 32 pairs of W (two vectors) and adds both products to float32 sums.
// A micro-kernel holds R rows x 32 columns of sums in registers (2 R of the 32) for the whole of
// k: per pair of k, 2 loads of W and R broadcasts feed 2 R dot products.
//
// Why not oneDNN (torch's bf16 matmul): at a decode step's 64 rows the weights come from memory
// (270 MB a step for SmolLM2-135M) and oneDNN leaves the cores waiting for them. Here each
// thread prefetches its next panel while it multiplies the current one, and the calls cost less:
// a step's matmuls take 21.7 ms instead of 28.0 at 64 rows, 6.0 instead of 9.4 at one
// (BENCHMARKS.md "A bf16 GEMM of our own").
//
// Rows are taken in chunks whose x fits in L2, so large prefill chunks do not reread x from
// memory for every panel. Threads split the (chunk, panel) pairs into contiguous ranges.
//
// Like the other kernels: no torch headers, called through ctypes with the parameter struct of
// pagedkv_abi.h; built only where the compiler targets AVX512_BF16 (pagedkv_bf16_gemm says).

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include <omp.h>

#include "pagedkv_abi.h"
#include "vec.h"

#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__)
#define PAGEDKV_BF16_GEMM 1
#endif

namespace {

using namespace pk;

constexpr int kCols = 32;                 // columns of a panel: two vectors of float32 sums
constexpr int kRowBlock = 12;             // rows of a micro-kernel: 24 sums + 2 W vectors in registers
constexpr int64_t kChunkBytes = 1 << 18;  // x rows of a chunk: this many bytes at most (L2)

int fail(char* err, int errlen, const char* msg, long long a, long long b) {
  std::snprintf(err, size_t(errlen), msg, a, b);
  return 1;
}

#ifdef PAGEDKV_BF16_GEMM

// y[R rows, cols] = x[R rows, k] . panel; `ahead` (or null) is the next panel, prefetched a
// pair of cache lines per k pair so that it is in cache when its turn comes. Full: cols is 32
// (masked loads of W instead cost 2.5x in a prototype, so only the last panel takes them).
template <int R, bool Full>
__attribute__((always_inline)) inline void micro(const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                                                 int64_t pairs, bf16* y, int64_t y_stride, int cols,
                                                 const char* ahead) {
  __m512 acc[R][2];
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
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * x_stride + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store(y + r * y_stride, acc[r][0], Full ? kFull : m0);
    if (Full || cols > W) store(y + r * y_stride + W, acc[r][1], Full ? kFull : m1);
  }
}

// Rows [0, rows) of a chunk against one panel, kRowBlock at a time, then the remainder.
template <bool Full>
void panel_rows(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs, bf16* y,
                int64_t y_stride, int cols, int64_t rows, const char* ahead) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock, ahead = nullptr)
    micro<kRowBlock, Full>(x + r * x_stride, x_stride, panel, pairs, y + r * y_stride, y_stride, cols, ahead);
  const uint16_t* xr = x + r * x_stride;
  bf16* yr = y + r * y_stride;
  switch (rows - r) {
#define PAGEDKV_TAIL(n) \
  case n: micro<n, Full>(xr, x_stride, panel, pairs, yr, y_stride, cols, ahead); break;
    PAGEDKV_TAIL(1) PAGEDKV_TAIL(2) PAGEDKV_TAIL(3) PAGEDKV_TAIL(4) PAGEDKV_TAIL(5) PAGEDKV_TAIL(6)
    PAGEDKV_TAIL(7) PAGEDKV_TAIL(8) PAGEDKV_TAIL(9) PAGEDKV_TAIL(10) PAGEDKV_TAIL(11)
#undef PAGEDKV_TAIL
    default: break;
  }
}

void gemm(const pagedkv_gemm_bf16_params& P) {
  const auto* x = static_cast<const uint16_t*>(P.x);
  const auto* w = static_cast<const uint16_t*>(P.w);
  bf16* y = static_cast<bf16*>(P.out);
  const int64_t pairs = P.k / 2, panels = (P.n + kCols - 1) / kCols, panel_elems = P.k * kCols;
  // Chunks of equal rows (whole row blocks but the last): as few as keep each within kChunkBytes,
  // unless the panels alone are too few to give every thread about four items (a narrow matrix
  // on many cores), and never more than there are row blocks.
  const int64_t most = std::max<int64_t>(kRowBlock, kChunkBytes / (2 * P.k));
  const int64_t blocks = (P.rows + kRowBlock - 1) / kRowBlock;
  const int64_t spread = (4 * int64_t(std::max(1, P.threads)) + panels - 1) / panels;
  const int64_t want = std::max<int64_t>(1, std::min(blocks, std::max((P.rows + most - 1) / most, spread)));
  const int64_t chunk = ((P.rows + want - 1) / want + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t items = (P.rows + chunk - 1) / chunk * panels;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(P.threads, items)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = items * t / nt, hi = items * (t + 1) / nt;  // (chunk, panel) pairs, chunk-major
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i / panels, p = i % panels, r0 = c * chunk;
      const bool next_here = i + 1 < hi && (i + 1) % panels != 0;
      const char* ahead = next_here ? reinterpret_cast<const char*>(w + (p + 1) * panel_elems) : nullptr;
      const int cols = int(std::min<int64_t>(kCols, P.n - p * kCols));
      const auto run = cols == kCols ? panel_rows<true> : panel_rows<false>;
      run(x + r0 * P.x_stride, P.x_stride, w + p * panel_elems, pairs, y + r0 * P.out_stride + p * kCols,
          P.out_stride, cols, std::min(chunk, P.rows - r0), ahead);
    }
  }
}

#endif  // PAGEDKV_BF16_GEMM

}  // namespace

extern "C" {

int pagedkv_gemm_bf16(const pagedkv_gemm_bf16_params* p, char* err, int errlen) {
#ifdef PAGEDKV_BF16_GEMM
  const pagedkv_gemm_bf16_params& P = *p;
  if (P.rows < 0 || P.n < 1 || P.k < 2 || P.k % 2)
    return fail(err, errlen, "need rows >= 0, n >= 1 and an even k >= 2 (k = %lld, n = %lld)", P.k, P.n);
  if (P.x_stride < P.k || P.out_stride < P.n)
    return fail(err, errlen, "row strides below the row lengths (x_stride %lld, out_stride %lld)", P.x_stride,
                P.out_stride);
  if (P.rows > 0) gemm(P);
  return 0;
#else
  (void)p;
  return fail(err, errlen, "the bf16 GEMM needs AVX512_BF16, which this build lacks", 0, 0);
#endif
}

int pagedkv_bf16_gemm(void) {
#ifdef PAGEDKV_BF16_GEMM
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
