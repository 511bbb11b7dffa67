// AArch64 NEON backend of vec.h: four float32 lanes in a float32x4_t.
#pragma once

#include <arm_neon.h>

namespace pk {

constexpr int kRegisters = 32;  // vector registers: bounds the kernels' register blocking
using Vec = float32x4_t;
using Mask = int;  // the first n lanes
constexpr Mask kFull = W;

inline Vec zero() { return vdupq_n_f32(0.f); }
inline Vec set1(float x) { return vdupq_n_f32(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
inline Vec add(Vec a, Vec b) { return vaddq_f32(a, b); }
inline Vec mul(Vec a, Vec b) { return vmulq_f32(a, b); }
inline Vec sub(Vec a, Vec b) { return vsubq_f32(a, b); }
inline Vec vdiv(Vec a, Vec b) { return vdivq_f32(a, b); }
inline Vec vmax(Vec a, Vec b) { return vmaxq_f32(a, b); }
inline Vec vmin(Vec a, Vec b) { return vminq_f32(a, b); }
inline Vec round_even(Vec v) { return vrndnq_f32(v); }
inline float hmax(Vec v) { return vmaxvq_f32(v); }

// Horizontal sums of four vectors: lane j of reduce4 holds all of a_j's sum, so finish (one
// group of four) has nothing left to add.
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) { return vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)); }
inline Vec finish(const Vec* c) { return c[0]; }

inline Vec half_to_float(Lanes<uint16_t> h) { return vcvt_f32_f16(vreinterpret_f16_u16((uint16x4_t)h)); }
inline Lanes<uint16_t> float_to_half(Vec v) { return (Lanes<uint16_t>)vreinterpret_u16_f16(vcvt_f16_f32(v)); }

// Integer lanes widened (zero- or sign-extended) to the next size.
inline U32 widen(Lanes<uint16_t> x) { return __builtin_convertvector(x, U32); }
inline I32 widen(Lanes<int8_t> x) { return __builtin_convertvector(x, I32); }
inline Lanes<uint16_t> widen(Lanes<uint8_t> x) { return __builtin_convertvector(x, Lanes<uint16_t>); }

}  // namespace pk

#include "vec_lanes.h"
