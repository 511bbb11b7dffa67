// A small vector layer for the kernels: float32 vectors of W lanes with one API over four
// backends, chosen at compile time (PAGEDKV_ISA_* from native.py, else from the compiler's
// target macros):
//   vec_avx512.h  AVX-512 (F, BW, VL; BF16 dot products when the CPU has them), W = 16
//   vec_avx2.h    AVX2 + FMA + F16C, W = 8
//   vec_neon.h    AArch64 NEON (with its fp16 conversions), W = 4
//   vec_portable.h GCC/Clang vector extensions only, W = 8
// Every backend gives: zero set1 fma add sub mul vdiv vmax vabs hsum hmax masked where_negative
// reduce4 finish round_even scale_pow2, and load / store converting float32 to and from
// float, bf16, fp16 (and load from int8 / e4m3). A Mask selects the first n lanes (every mask
// the kernels use is such a prefix). Conversions round like torch: to nearest even, once. On
// top of them, for every backend: vexp (and vexp2_bf16 where bf16 precision is enough), vtanh,
// prefetch, round_as, int8 / e4m3 codes, and load_halves / to_halves / from_halves (2W bf16 as
// two vectors, their own order where a backend converts them cheaper so: AVX-512).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(PAGEDKV_ISA_AVX512) && !defined(PAGEDKV_ISA_AVX2) && !defined(PAGEDKV_ISA_NEON) && \
    !defined(PAGEDKV_ISA_PORTABLE)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDKV_ISA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDKV_ISA_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define PAGEDKV_ISA_NEON 1
#else
#define PAGEDKV_ISA_PORTABLE 1
#endif
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

#if defined(PAGEDKV_ISA_AVX512)
constexpr int W = 16;
#elif defined(PAGEDKV_ISA_NEON)
constexpr int W = 4;
#else
constexpr int W = 8;
#endif
constexpr int kGroups = W / 4;  // vectors of partial sums that finish() folds into one

// W lanes of E as one GCC vector (the backends' intrinsic types are such vectors too, so a
// C-style cast between two of the same size reinterprets the bits).
template <typename E> struct LanesOf { typedef E type __attribute__((vector_size(W * sizeof(E)))); };
template <typename E> using Lanes = typename LanesOf<E>::type;
using F32 = Lanes<float>;
using I32 = Lanes<int32_t>;
using U32 = Lanes<uint32_t>;

}  // namespace pk

#if defined(PAGEDKV_ISA_AVX512)
#include "vec_avx512.h"
#elif defined(PAGEDKV_ISA_AVX2)
#include "vec_avx2.h"
#elif defined(PAGEDKV_ISA_NEON)
#include "vec_neon.h"
#else
#include "vec_portable.h"
#endif

namespace pk {

#if defined(PAGEDKV_BF16_HALVES)
constexpr bool kBf16Halves = true;
#else
// Backends without a cheaper way (see vec_avx512.h) read 2W bf16 as two plain loads, in order.
constexpr bool kBf16Halves = false;
inline void load_halves(const void* p, Vec& lo, Vec& hi) {
  lo = load(static_cast<const bf16*>(p), kFull);
  hi = load(static_cast<const bf16*>(p) + W, kFull);
}
inline void to_halves(Vec&, Vec&) {}
inline void from_halves(Vec&, Vec&) {}
#endif

constexpr float kLog2e = 1.44269504088896341f;

// exp(x) for x <= 0 (scores minus their running max), relative error ~1e-7: 2^n * e^r with
// |r| <= ln2/2 and a degree-6 polynomial for e^r. Below -87.3 (2^n no longer a normal float)
// it gives 0.
inline Vec vexp(Vec x) {
  const Vec xc = vmax(x, set1(-87.3f));
  const Vec n = round_even(mul(xc, set1(kLog2e)));
  Vec r = fma(n, set1(-0.693359375f), xc);
  r = fma(n, set1(2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, set1(1.0f)));
  return where_negative(add(x, set1(87.3f)), zero(), scale_pow2(p, n));
}

// 2^t for t <= 0 to a bf16 probability's precision (relative error 1e-4, where bf16 rounds to
// 2e-3): a degree-3 polynomial for 2^f, t = n + f, |f| <= 1/2; 0 below -126.5 (-inf included).
// Half vexp's operations, for softmaxes whose result is bf16 (BENCHMARKS.md, sessions 42-43).
inline Vec vexp2_bf16(Vec t) {
  const Vec tc = vmax(t, set1(-127.f));
  const Vec n = round_even(tc), f = sub(tc, n);
  const Vec p = fma(fma(fma(set1(5.503953016e-2f), f, set1(2.422110065e-1f)), f, set1(6.932765959e-1f)), f, set1(1.f));
  return scale_pow2(p, n);
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2 |x|), which never overflows; absolute
// error ~1e-7.
inline Vec vtanh(Vec x) {
  const Vec one = set1(1.f);
  const Vec e = vexp(mul(vabs(x), set1(-2.f)));
  const Vec t = vdiv(sub(one, e), add(one, e));
  return where_negative(x, sub(zero(), t), t);
}

// Starts loading the cache line at p into L2 (an upcoming tile is too large for L1). In asm,
// as GCC 12 deletes __builtin_prefetch from a loop that does nothing else; with p in a register
// (not a memory operand), so that the compiler need not store the caller's vectors first.
inline void prefetch(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, [%0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// v as computed: never fused with a following add into one FMA (GCC contracts a mul and an add,
// which rounds once where torch rounds twice: a Granite residual times its multiplier).
inline Vec unfused(Vec v) {
#if defined(PAGEDKV_ISA_AVX512) || defined(PAGEDKV_ISA_AVX2)
  asm("" : "+v"(v));
#elif defined(PAGEDKV_ISA_NEON)
  asm("" : "+w"(v));
#else
  asm("" : "+m"(v));
#endif
  return v;
}

// The mask of lanes [c, c + W) that fall before n.
inline Mask lanes(int64_t n, int64_t c) { return c + W <= n ? kFull : first_lanes(int(n - c)); }

// v rounded to T's precision and back (what storing a float result in a T tensor does).
template <typename T> inline Vec round_as(Vec v) {
  T tmp[W];
  store(tmp, v, kFull);
  return load(tmp, kFull);
}
template <> inline Vec round_as<float>(Vec v) { return v; }
// bf16 in registers: round to nearest even on the bits (a memory round trip costs more than the
// rest of a fused op), as the bf16 stores without AVX512_BF16 do.
template <> inline Vec round_as<bf16>(Vec v) {
  const U32 b = (U32)v;
  return (Vec)((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

// int8 codes of x: clamped to +-127, rounded half to even (torch's round().clamp()).
inline I32 int8_codes(Vec x) {
  return __builtin_convertvector((F32)round_even(vmin(vmax(x, set1(-127.f)), set1(127.f))), I32);
}

// float8 e4m3fn codes of x: clamped to +-448, rounded to nearest even, NaN to 0x7F.
inline I32 e4m3_codes(Vec x) {
  const U32 sign = ((U32)x >> 24) & 0x80u;
  const Vec a = vmin(vabs(x), set1(448.f));
  const U32 b = (U32)a;
  const U32 normal = ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3);  // 3 mantissa bits, ties to even
  const U32 sub = (U32)__builtin_convertvector((F32)round_even(mul(a, set1(512.f))), I32);  // multiples of 2^-9
  const F32 af = (F32)a, xf = (F32)x;
  U32 code = af < 0x1p-6f ? sub : normal;
  code = xf != xf ? U32{} + 0x7Fu : code;
  return (I32)(code | sign);
}

// x <- x H over its D floats, H the orthonormal Hadamard matrix that quantized KV caches hold K
// and V rotated by (attention/rotation.py, whose torch path does the same butterflies in the same
// order: equal bit for bit): Sylvester blocks of P = the largest power of two dividing D. H is
// symmetric and its own inverse, so this also rotates back.
inline void hadamard(float* x, int64_t D) {
  const int64_t P = D & -D;
  for (int64_t b = 0; b < D; b += P)
    for (int64_t h = 1; h < P; h *= 2)
      for (int64_t i = b; i < b + P; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], c = x[j + h];
          x[j] = a + c;
          x[j + h] = a - c;
        }
  const float s = float(1.0 / std::sqrt(double(P)));
  for (int64_t d = 0; d < D; ++d) x[d] *= s;
}

// The first lanes (m) of one-byte codes to p.
template <typename T> inline void store_codes(T* p, I32 codes, Mask m) {
  static_assert(sizeof(T) == 1, "codes are bytes");
  const Lanes<int8_t> b = __builtin_convertvector(codes, Lanes<int8_t>);
  std::memcpy(p, &b, size_t(lane_count(m)));
}

}  // namespace pk
