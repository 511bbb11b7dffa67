// Writes new K or V rows into a quantized cache (int8 or float8 e4m3fn, one float32 scale per
// (token, KV head)): the arithmetic of QuantizedCache.write in kvstore/quant.py, in one pass
// instead of a handful of torch ops per layer per step (about 70 us a call at one token, most of
// an fp8 decode step's overhead). The rows come as the model made them (any float type, a view
// into its fused projection) and are rotated here (vec.h: hadamard), as such a cache holds them.
//
// Each (token, head) row gets the smallest scale that holds its largest value. Rounding matches
// torch's: int8 rounds half to even, fp8 rounds to nearest even after clamping to +-448.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "pagedkv_abi.h"
#include "vec.h"

namespace {

using namespace pk;

constexpr float kMinScale = 0x1p-64f;  // scale of an all-zero block (quant.py's _MIN_SCALE)

struct Int8Format {
  using Q = i8;
  static float scale_for(float amax) { return std::max(amax / 127.f, kMinScale); }
  static I32 codes(Vec x) { return int8_codes(x); }
};

struct Fp8Format {
  using Q = e4m3;
  // Powers of two, at most 2^7 (quant.py: FP8.scale_for).
  static float scale_for(float amax) {
    const float s = std::max(amax / 448.f, kMinScale);
    return std::min(std::exp2(std::ceil(std::log2(s))), 128.f);
  }
  static I32 codes(Vec x) { return e4m3_codes(x); }
};

// The largest |x| over n floats.
inline float abs_max(const float* x, int64_t n) {
  Vec m = zero();
  for (int64_t d = 0; d < n; d += W) m = vmax(m, vabs(load(x + d, lanes(n, d))));
  return hmax(m);
}

template <typename F>
void write(const float* x, int64_t T, int64_t H, int64_t D, const int64_t* slots, typename F::Q* data,
           float* scales, int64_t bs) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / bs, off = slots[t] % bs;
    for (int64_t h = 0; h < H; ++h) {
      const float* row = x + (t * H + h) * D;
      const int64_t at = (block * H + h) * bs + off;  // the row's place in [blocks, H, bs]
      const float scale = F::scale_for(abs_max(row, D));
      scales[at] = scale;
      const Vec divisor = set1(scale);
      typename F::Q* dst = data + at * D;
      for (int64_t d = 0; d < D; d += W) {
        const Mask m = lanes(D, d);
        store_codes(dst + d, F::codes(vdiv(load(row + d, m), divisor)), m);  // as torch: x / scale
      }
    }
  }
}

// The rows [T, H, D] (tokens `stride` elements apart) as float32, each rotated, into out.
template <typename T>
void rotated(const T* x, int64_t stride, int64_t tokens, int64_t H, int64_t D, float* out) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const T* src = x + t * stride + h * D;
      float* dst = out + (t * H + h) * D;
      for (int64_t d = 0; d < D; d += W) store(dst + d, load(src + d, lanes(D, d)), lanes(D, d));
      hadamard(dst, D);
    }
}

}  // namespace

extern "C" {

// See pagedkv_abi.h. Returns 0, or 1 with a message in err.
int pagedkv_quant_write(const pagedkv_quant_write_params* p, char* err, int errlen) {
  const int64_t slots = p->num_blocks * p->block_size;
  for (int64_t t = 0; t < p->num_tokens; ++t) {
    if (p->slots[t] < 0 || p->slots[t] >= slots) {
      std::snprintf(err, size_t(errlen), "slot %lld is outside the cache of %lld slots", (long long)p->slots[t],
                    (long long)slots);
      return 1;
    }
  }
  const int64_t T = p->num_tokens, H = p->num_heads, D = p->head_dim;
  std::vector<float> x(size_t(T * H * D));
  switch (p->x_dtype) {
    case PAGEDKV_DTYPE_FLOAT32: rotated(static_cast<const float*>(p->x), p->x_stride, T, H, D, x.data()); break;
    case PAGEDKV_DTYPE_BFLOAT16: rotated(static_cast<const bf16*>(p->x), p->x_stride, T, H, D, x.data()); break;
    case PAGEDKV_DTYPE_FLOAT16: rotated(static_cast<const fp16*>(p->x), p->x_stride, T, H, D, x.data()); break;
    default:
      std::snprintf(err, size_t(errlen), "rows of dtype %d: want float32, bfloat16 or float16", int(p->x_dtype));
      return 1;
  }
  switch (p->dtype) {
    case PAGEDKV_DTYPE_INT8:
      write<Int8Format>(x.data(), T, H, D, p->slots, static_cast<i8*>(p->data), p->scales, p->block_size);
      return 0;
    case PAGEDKV_DTYPE_FLOAT8_E4M3FN:
      write<Fp8Format>(x.data(), T, H, D, p->slots, static_cast<e4m3*>(p->data), p->scales, p->block_size);
      return 0;
    default:
      std::snprintf(err, size_t(errlen), "unknown quantized format %d", int(p->dtype));
      return 1;
  }
}

}  // extern "C"
