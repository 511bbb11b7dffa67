// AVX-512 backend of vec.h (F, BW, VL): sixteen float32 lanes in a __m512, masks as __mmask16.
#pragma once

#include <immintrin.h>

namespace pk {

constexpr int kRegisters = 32;  // vector registers: bounds the kernels' register blocking

using Vec = __m512;
using Mask = __mmask16;
constexpr Mask kFull = 0xFFFF;

inline Mask first_lanes(int n) { return static_cast<Mask>((1u << n) - 1u); }
inline int lane_count(Mask m) { return __builtin_popcount(m); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec round_even(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float hmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec masked(Vec v, Mask m, Vec fill) { return _mm512_mask_blend_ps(m, fill, v); }
inline Vec vabs(Vec v) { return _mm512_abs_ps(v); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// Lanes where s < 0 from a, the others from b.
inline Vec where_negative(Vec s, Vec a, Vec b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero(), _CMP_LT_OQ), b, a); }

// Horizontal sums of many vectors at once, in two steps. reduce4 folds a0..a3 so that lane
// 4q+j holds quarter q (four lanes) of a_j's sum; finish adds the quarters of four such
// results so that lane 4g+j holds the whole sum of vector j of group g. About 3 operations
// per sum instead of 10 for one sum at a time.
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  const Vec b01 = add(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const Vec b23 = add(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return add(_mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline Vec finish(const Vec* c) {
  const Vec d01 = add(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const Vec d23 = add(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline Vec load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec load(const bf16* p, Mask m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec load(const fp16* p, Mask m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline Vec load(const i8* p, Mask m) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))); }
// e4m3's sign, exponent and mantissa moved to float16's places read as value * 2^-8, subnormals
// included (both formats scale linearly there); NaN (never stored) would read as a large number.
inline Vec load(const e4m3* p, Mask m) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

inline void store(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(bf16* p, Vec v, Mask m) {
#ifdef __AVX512BF16__
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);  // a bit cast between vector types
#else
  // Round to nearest even: add 0x7FFF plus the lowest kept bit, then keep the top half.
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
  _mm256_mask_storeu_epi16(p, m, h);
}
inline void store(fp16* p, Vec v, Mask m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// bf16 two vectors at a time (2W elements, one load): the even ones (the low half of each 32-bit
// lane) shifted up and the odd ones masked, one operation per vector where a widening load and a
// shift take two. to_halves / from_halves move two float vectors of 2W consecutive dims into and
// out of that order (even dims, then odd), so that sums meet such values lane for lane.
#define PAGEDKV_BF16_HALVES 1
inline void load_halves(const void* p, Vec& even, Vec& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline void to_halves(Vec& a, Vec& b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const Vec e = _mm512_permutex2var_ps(a, even, b);
  b = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  a = e;
}
inline void from_halves(Vec& a, Vec& b) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const Vec x = _mm512_permutex2var_ps(a, lo, b);
  b = _mm512_permutex2var_ps(a, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), b);
  a = x;
}

// p * 2^n for whole numbers n (vexp's last step).
inline Vec scale_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }

}  // namespace pk
