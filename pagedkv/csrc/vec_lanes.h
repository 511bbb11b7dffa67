// What the AVX2, NEON and portable backends share: loads and stores written with GCC vector
// extensions over the backend's half_to_float / float_to_half, the lane-wise helpers, and exp.
// Included by those backends after their own definitions; not on its own.
#pragma once

namespace pk {

inline Mask first_lanes(int n) { return n; }
inline int lane_count(Mask m) { return m; }
inline I32 lane_index() {
  I32 v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
// v in the first m lanes, fill in the others.
inline Vec masked(Vec v, Mask m, Vec fill) { return (Vec)(lane_index() < m ? (F32)v : (F32)fill); }
// Lanes where s < 0 from a, the others from b.
inline Vec where_negative(Vec s, Vec a, Vec b) { return (Vec)((F32)s < 0.f ? (F32)a : (F32)b); }
inline Vec vabs(Vec v) { return (Vec)((U32)v & 0x7FFFFFFFu); }
inline float hsum(Vec v) {
  const F32 f = (F32)v;
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += f[i];
  return s;
}

// n < Size bytes from s to d in power-of-two pieces of constant size: no call to memcpy, which
// would make the compiler spill every vector register around it in the kernels' loops.
template <size_t Size, size_t Piece = 32> inline void copy_small(char* d, const char* s, size_t n) {
  if constexpr (Piece > 0) {
    if constexpr (Piece < Size) {
      if (n & Piece) {
        std::memcpy(d, s, Piece);
        d += Piece;
        s += Piece;
      }
    }
    copy_small<Size, Piece / 2>(d, s, n);
  }
}

// The first m lanes of p as raw bits, zeros after. (Whole vectors take the branch with a
// constant size: one load or store instruction.)
template <typename R, typename T> inline R load_raw(const T* p, Mask m) {
  if (m == kFull) {
    R r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  R r{};
  copy_small<sizeof(R)>(reinterpret_cast<char*>(&r), reinterpret_cast<const char*>(p), size_t(m) * sizeof(T));
  return r;
}
template <typename T, typename R> inline void store_raw(T* p, R r, Mask m) {
  if (m == kFull) std::memcpy(p, &r, sizeof r);
  else copy_small<sizeof(R)>(reinterpret_cast<char*>(p), reinterpret_cast<const char*>(&r), size_t(m) * sizeof(T));
}

inline Vec load(const float* p, Mask m) { return (Vec)load_raw<F32>(p, m); }
inline Vec load(const bf16* p, Mask m) {  // bf16 is float32's top half
  return (Vec)(widen(load_raw<Lanes<uint16_t>>(p, m)) << 16);
}
inline Vec load(const fp16* p, Mask m) { return half_to_float(load_raw<Lanes<uint16_t>>(p, m)); }
inline Vec load(const i8* p, Mask m) { return (Vec)__builtin_convertvector(widen(load_raw<Lanes<int8_t>>(p, m)), F32); }
// e4m3's sign, exponent and mantissa moved to float16's places read as value * 2^-8, subnormals
// included (both formats scale linearly there); NaN (never stored) would read as a large number.
inline Vec load(const e4m3* p, Mask m) {
  const Lanes<uint16_t> x = widen(load_raw<Lanes<uint8_t>>(p, m));
  const Lanes<uint16_t> h = ((x & 0x80) << 8) | ((x & 0x7F) << 7);
  return mul(half_to_float(h), set1(256.f));
}

inline void store(float* p, Vec v, Mask m) { store_raw(p, (F32)v, m); }
inline void store(bf16* p, Vec v, Mask m) {  // round to nearest even: add 0x7FFF plus the lowest kept bit
  const U32 b = (U32)v;
  store_raw(p, __builtin_convertvector((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16, Lanes<uint16_t>), m);
}
inline void store(fp16* p, Vec v, Mask m) { store_raw(p, float_to_half(v), m); }

// p * 2^n for whole numbers n in float32's normal exponent range (vexp's last step).
inline Vec scale_pow2(Vec p, Vec n) { return mul(p, (Vec)((__builtin_convertvector((F32)n, I32) + 127) << 23)); }

}  // namespace pk
