// Vector helpers shared by the kernels: float32 vectors of W lanes (AVX-512 when the CPU has
// it, plain loops the compiler may vectorise otherwise), loads and stores that convert bf16 and
// fp16 to and from float32, and exp. Everything else is written in terms of these.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(PAGEDKV_PORTABLE)
#define PAGEDKV_AVX512 1
#include <immintrin.h>
#endif

namespace pk {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };
struct i8 { int8_t v; };        // an int8 KV element (times its block's scale)
struct e4m3 { uint8_t bits; };  // a float8 e4m3fn KV element (times its block's scale)

// One e4m3fn value, exactly (NaN, never stored, reads as 480).
inline float e4m3_to_float(uint8_t bits) {
  const int e = (bits >> 3) & 15, m = bits & 7;
  const float f = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return (bits & 0x80) ? -f : f;
}

#ifdef PAGEDKV_AVX512

constexpr int W = 16;
using Vec = __m512;
using Mask = __mmask16;
constexpr Mask kFull = 0xFFFF;

inline Mask first_lanes(int n) { return static_cast<Mask>((1u << n) - 1u); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float hmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec masked(Vec v, Mask m, Vec fill) { return _mm512_mask_blend_ps(m, fill, v); }
inline Vec vabs(Vec v) { return _mm512_abs_ps(v); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// Lanes where s < 0 from a, the others from b.
inline Vec where_negative(Vec s, Vec a, Vec b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero(), _CMP_LT_OQ), b, a); }

// Horizontal sums of many vectors at once, in two steps. reduce4 folds a0..a3 so that lane
// 4q+j holds quarter q (four lanes) of a_j's sum; finish4 adds the quarters of four such
// results so that lane 4g+j holds the whole sum of vector j of group g. About 3 operations
// per sum instead of 10 for one sum at a time.
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  const Vec b01 = add(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const Vec b23 = add(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return add(_mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline Vec finish4(const Vec* c) {
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

// exp(x) for x <= 0 (scores minus their running max), relative error ~1e-7: 2^n * e^r with
// |r| <= ln2/2 and a degree-6 polynomial for e^r. Very negative x gives 0.
inline Vec vexp(Vec x) {
  x = _mm512_max_ps(x, set1(-104.0f));
  const Vec n = _mm512_roundscale_ps(mul(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = fma(n, set1(-0.693359375f), x);
  r = fma(n, set1(2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, set1(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }  // into L2: L1 is too small for a tile ahead

#else  // portable: plain loops the compiler may vectorise

constexpr int W = 16;
struct Vec { float x[W]; };
using Mask = uint32_t;
constexpr Mask kFull = (1u << W) - 1u;

inline Mask first_lanes(int n) { return (1u << n) - 1u; }
inline bool on(Mask m, int i) { return (m >> i) & 1u; }
inline Vec zero() { return Vec{}; }
inline Vec set1(float a) { Vec v; for (int i = 0; i < W; ++i) v.x[i] = a; return v; }
inline Vec fma(Vec a, Vec b, Vec c) { for (int i = 0; i < W; ++i) c.x[i] += a.x[i] * b.x[i]; return c; }
inline Vec add(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.x[i] += b.x[i]; return a; }
inline Vec mul(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.x[i] *= b.x[i]; return a; }
inline Vec sub(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.x[i] -= b.x[i]; return a; }
inline Vec vmax(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.x[i] = std::max(a.x[i], b.x[i]); return a; }
inline float hsum(Vec v) { float s = 0.f; for (int i = 0; i < W; ++i) s += v.x[i]; return s; }
inline float hmax(Vec v) { float s = v.x[0]; for (int i = 1; i < W; ++i) s = std::max(s, v.x[i]); return s; }
inline Vec masked(Vec v, Mask m, Vec fill) { for (int i = 0; i < W; ++i) if (!on(m, i)) v.x[i] = fill.x[i]; return v; }
inline Vec vabs(Vec v) { for (int i = 0; i < W; ++i) v.x[i] = std::fabs(v.x[i]); return v; }
inline Vec vdiv(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.x[i] /= b.x[i]; return a; }
inline Vec where_negative(Vec s, Vec a, Vec b) { for (int i = 0; i < W; ++i) if (s.x[i] < 0.f) b.x[i] = a.x[i]; return b; }
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  Vec r = zero(); r.x[0] = hsum(a0); r.x[1] = hsum(a1); r.x[2] = hsum(a2); r.x[3] = hsum(a3); return r;
}
inline Vec finish4(const Vec* c) {
  Vec r = zero();
  for (int g = 0; g < 4; ++g) for (int q = 0; q < 4; ++q) for (int j = 0; j < 4; ++j) r.x[4 * g + j] += c[g].x[4 * q + j];
  return r;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { uint32_t b = uint32_t(x.bits) << 16; float f; std::memcpy(&f, &b, 4); return f; }
inline float to_float(fp16 x) {
  const uint32_t s = (x.bits >> 15) & 1u, e = (x.bits >> 10) & 31u, m = x.bits & 1023u;
  float f = e == 0 ? std::ldexp(float(m), -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 1024u), int(e) - 25);
  return s ? -f : f;
}
inline float to_float(i8 x) { return float(x.v); }
inline float to_float(e4m3 x) { return e4m3_to_float(x.bits); }
inline void from_float(float a, float* p) { *p = a; }
inline void from_float(float a, bf16* p) {
  uint32_t b; std::memcpy(&b, &a, 4);
  p->bits = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline void from_float(float a, fp16* p) {
  // Round to nearest through the float16 grid: frexp splits off the exponent exactly.
  const uint16_t sign = std::signbit(a) ? 0x8000 : 0;
  a = std::fabs(a);
  if (std::isnan(a)) { p->bits = 0x7E00; return; }
  if (a >= 65520.f) { p->bits = sign | 0x7C00; return; }
  int e; std::frexp(a, &e);                       // a = f * 2^e, f in [0.5, 1)
  const int q = std::max(e - 11, -24);            // spacing of the float16 grid near a
  const uint32_t k = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, -q)));
  const uint32_t bits = (q == -24 && k < 1024u) ? k : ((uint32_t(q + 25) << 10) + (k - 1024u));
  p->bits = sign | static_cast<uint16_t>(bits);
}
template <typename T> inline Vec load(const T* p, Mask m) {
  Vec v; for (int i = 0; i < W; ++i) v.x[i] = on(m, i) ? to_float(p[i]) : 0.f; return v;
}
template <typename T> inline void store(T* p, Vec v, Mask m) {
  for (int i = 0; i < W; ++i) if (on(m, i)) from_float(v.x[i], p + i);
}
inline Vec vexp(Vec v) { for (int i = 0; i < W; ++i) v.x[i] = std::exp(v.x[i]); return v; }
inline void prefetch(const void* p) { __builtin_prefetch(p); }

#endif

// v rounded to T's precision and back (what storing a float result in a T tensor does).
template <typename T> inline Vec round_as(Vec v) {
  T tmp[W];
  store(tmp, v, kFull);
  return load(tmp, kFull);
}
template <> inline Vec round_as<float>(Vec v) { return v; }

}  // namespace pk
