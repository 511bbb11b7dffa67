// AVX2 + FMA + F16C backend of vec.h: eight float32 lanes in a __m256.
#pragma once

#include <immintrin.h>

namespace pk {

constexpr int kRegisters = 16;  // vector registers: bounds the kernels' register blocking
using Vec = __m256;
using Mask = int;  // the first n lanes
constexpr Mask kFull = W;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec round_even(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float hmax(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Horizontal sums of many vectors at once, in two steps. reduce4 folds a0..a3 so that lane
// 4q+j holds half q of a_j's sum; finish adds the halves of two such results so that lane 4g+j
// holds the whole sum of vector j of group g.
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
}
inline Vec finish(const Vec* c) {
  return add(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

inline Vec half_to_float(Lanes<uint16_t> h) { return _mm256_cvtph_ps((__m128i)h); }
inline Lanes<uint16_t> float_to_half(Vec v) {
  return (Lanes<uint16_t>)_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Integer lanes widened (zero- or sign-extended) to the next size, one instruction each.
inline U32 widen(Lanes<uint16_t> x) { return (U32)_mm256_cvtepu16_epi32((__m128i)x); }
inline I32 widen(Lanes<int8_t> x) { return (I32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)&x)); }
inline Lanes<uint16_t> widen(Lanes<uint8_t> x) {
  return (Lanes<uint16_t>)_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)&x));
}

}  // namespace pk

#include "vec_lanes.h"
