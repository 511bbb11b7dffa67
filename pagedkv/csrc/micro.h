// What the float32 GEMM (gemm.cpp) and attention's score pass for many rows (paged_attention.cpp)
// share: a micro-kernel y[R rows, 2 W columns] = x . panel with every sum in registers, and the
// dispatch of rows in blocks to it. Details of the panel layout: gemm.cpp, "float32 weights".
#pragma once

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace pk {

// Calls f(std::integral_constant<int, R>{}, r) for rows [r, r + R) of [0, rows): R = Block while
// whole blocks remain, then once for the remainder, so each micro-kernel size is a template.
template <int N, typename F>
__attribute__((always_inline)) inline void row_tail(int64_t n, int64_t r, F& f) {
  if constexpr (N > 0) {
    if (n == N) f(std::integral_constant<int, N>{}, r);
    else row_tail<N - 1>(n, r, f);
  }
}
template <int Block, typename F>
__attribute__((always_inline)) inline void by_row_blocks(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + Block <= rows; r += Block) f(std::integral_constant<int, Block>{}, r);
  row_tail<Block - 1>(rows - r, r, f);
}

constexpr int kColsF = 2 * W;
constexpr int kRowBlockF = kRegisters >= 32 ? 12 : 6;
constexpr int kPanelRowBytes = kColsF * 4;

// The operands of micro_f32: x[r][i] at x + r * x_stride + i * x_step (k elements a row), the
// panel's row i at panel + i * panel_stride (2 W floats), y's row r at y + r * y_stride.
struct MicroArgs {
  const float* x;
  int64_t x_stride, x_step;
  const float* panel;
  int64_t panel_stride, k;
  int64_t y_stride;
};

// y[R rows, cols] = x . panel (Add: y += x . panel). Few rows give few independent sums, each FMA
// waiting on the one before: those rows keep U sums a column vector over interleaved k (U R >= 4),
// added at the end. `ahead`: a panel of kPanelRowBytes rows to prefetch, a row per k.
template <int R, bool Add = false, typename Y>
__attribute__((always_inline)) inline void micro_f32(const MicroArgs& a, Y* y, int cols, const char* ahead) {
  constexpr int U = R >= 4 ? 1 : R == 1 ? 4 : 2;
  const float* x = a.x;
  const float* panel = a.panel;
  const int64_t x_stride = a.x_stride, x_step = a.x_step, panel_stride = a.panel_stride, k = a.k;
  const int64_t y_stride = a.y_stride;
  Vec acc[R][2][U];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const bool init = Add && u == 0;
      acc[r][0][u] = init ? load(y + r * y_stride, kFull) : zero();
      acc[r][1][u] = init ? load(y + r * y_stride + W, kFull) : zero();
    }
  for (int64_t i0 = 0; i0 < k; i0 += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u;
      if (U > 1 && i >= k) break;
      if (ahead) {
#pragma GCC unroll 4
        for (int line = 0; line < kPanelRowBytes; line += 64) prefetch(ahead + i * kPanelRowBytes + line);
      }
      const Vec w0 = load(panel + i * panel_stride, kFull), w1 = load(panel + i * panel_stride + W, kFull);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec xv = set1(x[r * x_stride + i * x_step]);
        acc[r][0][u] = fma(xv, w0, acc[r][0][u]);
        acc[r][1][u] = fma(xv, w1, acc[r][1][u]);
      }
    }
  }
  const Mask m0 = lanes(cols, 0), m1 = cols > W ? lanes(cols, W) : kFull;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) {
      acc[r][0][0] = add(acc[r][0][0], acc[r][0][u]);
      acc[r][1][0] = add(acc[r][1][0], acc[r][1][u]);
    }
    store(y + r * y_stride, acc[r][0][0], m0);
    if (cols > W) store(y + r * y_stride + W, acc[r][1][0], m1);
  }
}

}  // namespace pk
