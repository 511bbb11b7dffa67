// Portable backend of vec.h: eight float32 lanes as a GCC/Clang vector, for CPUs with none of
// the others (the compiler maps it onto whatever SIMD the target has). fp16 converts through
// the compiler's half type, which rounds to nearest even like torch.
#pragma once

namespace pk {

#if defined(__aarch64__) || defined(__arm__)
using half = __fp16;  // GCC 12's C++ has no _Float16 on Arm
#else
using half = _Float16;
#endif

constexpr int kRegisters = 16;  // vector registers: bounds the kernels' register blocking
using Vec = F32;
using Mask = int;  // the first n lanes
constexpr Mask kFull = W;

inline Vec zero() { return Vec{}; }
inline Vec set1(float x) { return Vec{} + x; }
inline Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec add(Vec a, Vec b) { return a + b; }
inline Vec mul(Vec a, Vec b) { return a * b; }
inline Vec sub(Vec a, Vec b) { return a - b; }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
inline Vec vmin(Vec a, Vec b) { return a < b ? a : b; }
// Round to nearest even by adding and removing 1.5 * 2^23 (exact for |v| < 2^22, all the
// kernels round).
inline Vec round_even(Vec v) { return (v + 0x1.8p23f) - 0x1.8p23f; }
inline float hmax(Vec v) {
  float s = v[0];
  for (int i = 1; i < W; ++i) s = std::max(s, v[i]);
  return s;
}

// Horizontal sums of many vectors: lane 4q+j of reduce4 holds quarter q (four lanes) of a_j's
// sum; lane 4g+j of finish adds the quarters of group g's vector j.
inline Vec reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  const Vec a[4] = {a0, a1, a2, a3};
  Vec r{};
  for (int q = 0; q < W / 4; ++q)
    for (int j = 0; j < 4; ++j) r[4 * q + j] = a[j][4 * q] + a[j][4 * q + 1] + a[j][4 * q + 2] + a[j][4 * q + 3];
  return r;
}
inline Vec finish(const Vec* c) {
  Vec r{};
  for (int g = 0; g < kGroups; ++g)
    for (int q = 0; q < W / 4; ++q)
      for (int j = 0; j < 4; ++j) r[4 * g + j] += c[g][4 * q + j];
  return r;
}

inline Vec half_to_float(Lanes<uint16_t> h) {
  Vec v;
  for (int i = 0; i < W; ++i) {
    half x;
    const uint16_t bits = h[i];
    std::memcpy(&x, &bits, 2);
    v[i] = float(x);
  }
  return v;
}
inline Lanes<uint16_t> float_to_half(Vec v) {
  Lanes<uint16_t> h;
  for (int i = 0; i < W; ++i) {
    const half x = static_cast<half>(v[i]);
    uint16_t bits;
    std::memcpy(&bits, &x, 2);
    h[i] = bits;
  }
  return h;
}

// Integer lanes widened (zero- or sign-extended) to the next size.
inline U32 widen(Lanes<uint16_t> x) { return __builtin_convertvector(x, U32); }
inline I32 widen(Lanes<int8_t> x) { return __builtin_convertvector(x, I32); }
inline Lanes<uint16_t> widen(Lanes<uint8_t> x) { return __builtin_convertvector(x, Lanes<uint16_t>); }

}  // namespace pk

#include "vec_lanes.h"
