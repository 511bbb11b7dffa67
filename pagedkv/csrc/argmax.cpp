// Greedy tokens: the index of each row's first maximum, for the sampler (engine/sampler.py).
//
// torch's `max(-1)` with indices takes 1.4 ms over a batch-64 step's [64, 49152] logits here
// (its value-only `amax` 0.1 ms): index-tracking reductions are not vectorized there. One pass
// keeps, per lane, the running maximum and where it first occurred; the lanes are then folded
// by value, then by the lowest index. A row holding NaN gives its first NaN's index, as torch's
// max does (NaN counts as the largest).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include <omp.h>

#include "pagedkv_abi.h"
#include "vec.h"

namespace {

using namespace pk;

int64_t row_argmax(const float* x, int64_t n) {
  float lane[W];
  for (int i = 0; i < W; ++i) lane[i] = float(i);
  const Vec ninf = set1(-std::numeric_limits<float>::infinity()), step = set1(float(W));
  Vec at = load(lane, kFull), best = ninf, where = at, odd = zero();
  for (int64_t c = 0; c < n; c += W, at = add(at, step)) {
    const Mask m = lanes(n, c);
    const Vec v = masked(load(x + c, m), m, ninf);
    where = where_negative(sub(best, v), at, where);  // lanes where v > best: here (first max kept)
    best = vmax(best, v);
    odd = add(odd, sub(v, v));  // NaN once a NaN (or an infinity) went by
  }
  if (std::isnan(hsum(odd)))
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  float b[W], w[W];
  store(b, best, kFull);
  store(w, where, kFull);
  const float top = *std::max_element(b, b + W);
  float first = std::numeric_limits<float>::infinity();
  for (int i = 0; i < W; ++i)
    if (b[i] == top) first = std::min(first, w[i]);
  return int64_t(first);
}

}  // namespace

extern "C" int pagedkv_argmax(const pagedkv_argmax_params* p, char* err, int errlen) {
  const pagedkv_argmax_params& P = *p;
  if (P.rows < 0 || P.n < 1 || P.n > (int64_t(1) << 24) || P.x_stride < P.n) {
    std::snprintf(err, size_t(errlen), "need rows >= 0, 1 <= n <= 2^24 and x_stride >= n (n = %lld, x_stride = %lld)",
                  static_cast<long long>(P.n), static_cast<long long>(P.x_stride));
    return 1;
  }
  const int threads = P.rows * P.n < (1 << 16) ? 1 : std::max(1, P.threads);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < P.rows; ++r) P.out[r] = row_argmax(P.x + r * P.x_stride, P.n);
  return 0;
}
