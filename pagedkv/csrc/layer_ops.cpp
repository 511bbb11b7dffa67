// The small operations around a decoder layer's matmuls, fused: RMSNorm with the residual
// add, SiLU(gate) * up, RoPE with the store of the new K/V into the paged cache, and the LoRA
// adapters' deltas added to a matmul's output.
//
// In torch each of these is 4-10 ops: at one decode token per step that is Python and dispatch
// overhead (about 7 ms of an 18 ms step for SmolLM2-135M), and on a 2048-token prompt chunk it
// is several passes over memory with slow bf16 elementwise kernels (about a quarter of a
// prefill step). Here each is one pass. Results are rounded to the tensor dtype where torch's
// ops would round (see each function), so the float32 path matches torch to float rounding.
//
// Like paged_attention.cpp: no torch headers, called through ctypes with the parameter structs of
// pagedkv_abi.h; every index read from a tensor is checked before use.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include <omp.h>

#include "micro.h"
#include "pagedkv_abi.h"
#include "vec.h"

namespace {

using namespace pk;

constexpr int64_t kParallelElems = 1 << 15;  // fewer elements than this run on one thread

inline int threads_for(int64_t elems, int threads) {
  return elems < kParallelElems ? 1 : std::max(1, threads);
}

// 1 / sqrt(mean(v^2) + eps) over n values.
template <typename T>
inline float inv_rms(const T* v, int64_t n, float eps) {
  Vec sq = zero();
  for (int64_t c = 0; c < n; c += W) {
    const Mask m = lanes(n, c);
    const Vec x = load(v + c, m);
    sq = fma(x, x, sq);
  }
  return 1.f / std::sqrt(hsum(sq) / float(n) + eps);
}

// o = round(w * round(src * inv)): torch's `weight * (x.float() * rsqrt(...)).to(dtype)`; o may be src.
template <typename T>
inline void scale_row(const T* src, const T* w, T* o, int64_t n, float inv) {
  const Vec s = set1(inv);
  for (int64_t c = 0; c < n; c += W) {
    const Mask m = lanes(n, c);
    store(o + c, mul(load(w + c, m), round_as<T>(mul(load(src + c, m), s))), m);
  }
}

// residual (when given) = round(x + residual), or round(round(x * x_scale) + residual) for an x_scale
// other than 0 and 1 (transformers' Granite: residual + h * residual_multiplier);
// out = round(w * round(s * rsqrt(mean(s^2) + eps))) with s the (new) residual or x.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t rows, int64_t n,
              float eps, float x_scale, int threads) {
  const bool scaled = x_scale != 0.f && x_scale != 1.f;
  const Vec xs = set1(x_scale);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* res = residual ? residual + r * n : nullptr;
    if (!res) {
      scale_row(xr, w, out + r * n, n, inv_rms(xr, n, eps));
      continue;
    }
    Vec sq = zero();  // the sum of squares in the same pass as the add
    for (int64_t c = 0; c < n; c += W) {
      const Mask m = lanes(n, c);
      const Vec xv = scaled ? round_as<T>(unfused(mul(load(xr + c, m), xs))) : load(xr + c, m);
      const Vec v = round_as<T>(add(xv, load(res + c, m)));
      store(res + c, v, m);
      sq = fma(v, v, sq);
    }
    scale_row(res, w, out + r * n, n, 1.f / std::sqrt(hsum(sq) / float(n) + eps));
  }
}

// GELU, tanh approximation (torch's approximate="tanh"): x / 2 (1 + tanh(sqrt(2 / pi) (x +
// 0.044715 x^3))).
inline Vec gelu_tanh(Vec x) {
  const Vec y = mul(set1(0.7978845608f), fma(mul(set1(0.044715f), mul(x, x)), x, x));
  return mul(mul(set1(0.5f), x), add(set1(1.f), vtanh(y)));
}

// out[r, i] = round(round(act(g)) * u) for g = x[r, i], u = x[r, n + i]: torch's F.silu(gate) * up
// (or F.gelu(gate, approximate="tanh") * up).
template <typename T>
void silu_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t n, bool gelu, int threads) {
  const Vec one = set1(1.f);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x + r * x_stride;
    const T* u = g + n;
    T* o = out + r * n;
    for (int64_t c = 0; c < n; c += W) {
      const Mask m = lanes(n, c);
      const Vec gv = load(g + c, m);
      Vec a;
      if (gelu) {
        a = gelu_tanh(gv);
      } else {
        const Vec e = vexp(mul(vabs(gv), set1(-1.f)));  // exp(-|g|) never overflows
        a = mul(gv, vdiv(where_negative(gv, e, one), add(one, e)));
      }
      store(o + c, mul(round_as<T>(a), load(u + c, m)), m);
    }
  }
}

// Rotates one head in place: x * cos + rotate_half(x) * sin, with rotate_half's sign folded
// into sin (the Rotary tables in model/llama.py): out[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i].
template <typename T>
inline void rotate(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t c = 0; c < half; c += W) {
    const Mask m = lanes(half, c);
    const Vec a = load(x + c, m), b = load(x + half + c, m);
    store(x + c, fma(b, load(sin + c, m), mul(a, load(cos + c, m))), m);
    store(x + half + c, fma(a, load(sin + half + c, m), mul(b, load(cos + half + c, m))), m);
  }
}

// Token t's q | k | v row (qkv[t]) gets the projection's bias (if any); its q and k heads their
// RMSNorm over the head (if any: Qwen3's q_norm / k_norm, rounded as rms_norm rounds), then their
// rotation for its position, of their first rotary_dim dims (transformers' partial rotary); then,
// with a cache, its k and v heads are stored at slot slots[t] of k_cache / v_cache
// ([num_blocks, Hkv, block_size, D], the layout of attention/paged.py).
template <typename T>
void rope_cache(const pagedkv_rope_cache_params& p, int threads) {
  const int64_t Hq = p.num_q_heads, Hkv = p.num_kv_heads, D = p.head_dim, width = (Hq + 2 * Hkv) * D;
  const int64_t R = p.rotary_dim ? p.rotary_dim : D;  // the rest of each head passes unturned
  const int64_t block_size = p.block_size;
  const T* bias = static_cast<const T*>(p.bias);
  const T* norms[2] = {static_cast<const T*>(p.q_norm), static_cast<const T*>(p.k_norm)};
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    T* row = static_cast<T*>(p.qkv) + t * p.row_stride;
    if (bias)
      for (int64_t c = 0; c < width; c += W) {
        const Mask m = lanes(width, c);
        store(row + c, add(load(row + c, m), load(bias + c, m)), m);
      }
    for (int64_t h = 0; h < Hq + Hkv; ++h) {
      T* head = row + h * D;
      const T* norm = norms[h < Hq ? 0 : 1];
      if (norm) scale_row(head, norm, head, D, inv_rms(head, D, p.norm_eps));
      if (p.cos) rotate(head, p.cos + p.positions[t] * R, p.sin + p.positions[t] * R, R / 2);
    }
    if (!p.slots) continue;
    const int64_t block = p.slots[t] / block_size, offset = p.slots[t] % block_size;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = ((block * Hkv + h) * block_size + offset) * D;
      std::copy(row + (Hq + h) * D, row + (Hq + h + 1) * D, k_cache + at);
      std::copy(row + (Hq + Hkv + h) * D, row + (Hq + Hkv + h + 1) * D, v_cache + at);
    }
  }
}

int fail(char* err, int errlen, const char* msg, long long a, long long b) {
  std::snprintf(err, size_t(errlen), msg, a, b);
  return 1;
}

// Calls f(T()) with T the element type of a float dtype; false for any other dtype.
template <typename F>
bool with_float_type(pagedkv_dtype dtype, F&& f) {
  switch (dtype) {
    case PAGEDKV_DTYPE_FLOAT32: f(float()); return true;
    case PAGEDKV_DTYPE_BFLOAT16: f(bf16()); return true;
    case PAGEDKV_DTYPE_FLOAT16: f(fp16()); return true;
    default: return false;
  }
}


// LoRA: out[r] += (x[r] A^T) B for the rows of one adapter, kLoraRows rows at a time, so that each
// line of A and B read from L1/L2 serves them all. torch's two small matmuls for this cost ~90 us
// a projection, four times their arithmetic, so this one call per projection serves every
// adapter's rows (BENCHMARKS.md "LoRA adapters").
constexpr int kLoraRows = 4;
constexpr int kLoraRanks = 4;  // A's rows a pass over x: 16 sums of 4 rows x 4 ranks in registers
constexpr int kMaxLoraRank = 1024;

template <typename T, int R>
void lora_rows(const T* const (&x)[R], T* const (&out)[R], const T* a, const T* b, int rank, int64_t k,
               int64_t n) {
  float t[R][kMaxLoraRank];  // x A^T, kept in float32
  for (int j0 = 0; j0 < rank; j0 += kLoraRanks) {
    const int nj = std::min(kLoraRanks, rank - j0);
    Vec acc[R][kLoraRanks];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kLoraRanks; ++j) acc[r][j] = zero();
    for (int64_t c = 0; c < k; c += W) {
      const Mask m = lanes(k, c);
      Vec xs[R];
      for (int r = 0; r < R; ++r) xs[r] = load(x[r] + c, m);
      for (int j = 0; j < nj; ++j) {
        const Vec av = load(a + (j0 + j) * k + c, m);
        for (int r = 0; r < R; ++r) acc[r][j] = fma(xs[r], av, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < nj; ++j) t[r][j0 + j] = hsum(acc[r][j]);
  }
  for (int64_t c = 0; c < n; c += W) {
    const Mask m = lanes(n, c);
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = load(out[r] + c, m);
    for (int j = 0; j < rank; ++j) {
      const Vec bv = load(b + j * n + c, m);
      for (int r = 0; r < R; ++r) acc[r] = fma(set1(t[r][j]), bv, acc[r]);
    }
    for (int r = 0; r < R; ++r) store(out[r] + c, acc[r], m);
  }
}

template <typename T>
void lora(const pagedkv_lora_params& P, const std::vector<std::vector<int32_t>>& rows_of, int threads) {
  std::vector<std::pair<int32_t, int32_t>> items;  // (adapter, first of its rows in this item)
  for (int32_t s = 0; s < int32_t(rows_of.size()); ++s)
    for (size_t i = 0; i < rows_of[s].size(); i += kLoraRows) items.emplace_back(s, int32_t(i));
  const int64_t count = int64_t(items.size());
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const auto [s, first] = items[size_t(i)];
    const auto& rows = rows_of[size_t(s)];
    const T* a = reinterpret_cast<const T*>(P.a[s]);
    const T* b = reinterpret_cast<const T*>(P.b[s]);
    const int left = int(std::min<size_t>(kLoraRows, rows.size() - size_t(first)));
    by_row_blocks<kLoraRows>(left, [&](auto R, int64_t r0) {
      constexpr int kR = decltype(R)::value;
      const T* xs[kR];
      T* outs[kR];
      for (int r = 0; r < kR; ++r) {
        const int64_t row = rows[size_t(first + r0 + r)];
        xs[r] = static_cast<const T*>(P.x) + row * P.x_stride;
        outs[r] = static_cast<T*>(P.out) + row * P.out_stride;
      }
      lora_rows<T, kR>(xs, outs, a, b, P.ranks[s], P.k, P.n);
    });
  }
}

}  // namespace

extern "C" {

// The parameters of each: pagedkv_abi.h. Each returns 0, or 1 with a message in err.

int pagedkv_rms_norm(const pagedkv_rms_norm_params* p, char* err, int errlen) {
  const int threads = threads_for(p->rows * p->n, p->threads);
  const bool known = with_float_type(p->dtype, [&](auto t) {
    using T = decltype(t);
    rms_norm(static_cast<const T*>(p->x), p->x_stride, static_cast<T*>(p->residual),
             static_cast<const T*>(p->weight), static_cast<T*>(p->out), p->rows, p->n, p->eps, p->x_scale,
             threads);
  });
  return known ? 0 : fail(err, errlen, "unsupported dtype code %lld%.0lld", p->dtype, 0);
}

int pagedkv_silu_mul(const pagedkv_silu_mul_params* p, char* err, int errlen) {
  const int threads = threads_for(p->rows * p->n, p->threads);
  const bool known = with_float_type(p->dtype, [&](auto t) {
    using T = decltype(t);
    silu_mul(static_cast<const T*>(p->x), p->x_stride, static_cast<T*>(p->out), p->rows, p->n, p->gelu != 0,
             threads);
  });
  return known ? 0 : fail(err, errlen, "unsupported dtype code %lld%.0lld", p->dtype, 0);
}

// slots may be null (rotate only); else k_cache and v_cache hold num_blocks blocks of qkv's dtype.
int pagedkv_rope_cache(const pagedkv_rope_cache_params* p, char* err, int errlen) {
  const int64_t D = p->head_dim, Hq = p->num_q_heads, Hkv = p->num_kv_heads;
  if (D % 2 || p->row_stride < (Hq + 2 * Hkv) * D)
    return fail(err, errlen, "head_dim %lld and row stride %lld disagree with the heads", D, p->row_stride);
  if (p->rotary_dim < 0 || p->rotary_dim > D || p->rotary_dim % 2)
    return fail(err, errlen, "rotary_dim %lld: not an even count of at most head_dim %lld", p->rotary_dim, D);
  if (!p->cos != !p->sin) return fail(err, errlen, "cos and sin: both tables or neither%.0lld%.0lld", 0, 0);
  for (int64_t t = 0; t < p->num_tokens; ++t) {
    if (p->cos && (p->positions[t] < 0 || p->positions[t] >= p->max_positions))
      return fail(err, errlen, "position %lld is outside the rotary table of %lld positions", p->positions[t],
                  p->max_positions);
    if (p->slots && (p->slots[t] < 0 || p->slots[t] >= p->num_blocks * p->block_size))
      return fail(err, errlen, "slot %lld is outside the cache of %lld slots", p->slots[t],
                  p->num_blocks * p->block_size);
  }
  const int threads = threads_for(p->num_tokens * p->row_stride, p->threads);
  const bool known = with_float_type(p->dtype, [&](auto t) {
    using T = decltype(t);
    rope_cache<T>(*p, threads);
  });
  return known ? 0 : fail(err, errlen, "unsupported dtype code %lld%.0lld", p->dtype, 0);
}

int pagedkv_lora(const pagedkv_lora_params* p, char* err, int errlen) {
  const pagedkv_lora_params& P = *p;
  if (P.k < 1 || P.n < 1 || P.x_stride < P.k || P.out_stride < P.n || P.adapters < 0)
    return fail(err, errlen, "need k, n >= 1 and row strides at least k and n (k = %lld, n = %lld)", P.k, P.n);
  for (int64_t s = 0; s < P.adapters; ++s)
    if (P.ranks[s] < 0 || P.ranks[s] > kMaxLoraRank || (P.ranks[s] && (!P.a[s] || !P.b[s])))
      return fail(err, errlen, "adapter %lld: rank %lld, or no A or B", s, P.ranks[s]);
  std::vector<std::vector<int32_t>> rows_of(size_t(P.adapters));
  for (int64_t r = 0; r < P.rows; ++r) {
    const int32_t s = P.slots[r];
    if (s < -1 || s >= P.adapters)
      return fail(err, errlen, "row %lld names adapter %lld, which is not given", r, s);
    if (s >= 0 && P.ranks[s] > 0) rows_of[size_t(s)].push_back(int32_t(r));
  }
  int64_t work = 0;
  for (int64_t s = 0; s < P.adapters; ++s) work += int64_t(rows_of[size_t(s)].size()) * P.ranks[s] * (P.k + P.n);
  const int threads = threads_for(work, p->threads);
  const bool known = with_float_type(p->dtype, [&](auto t) { lora<decltype(t)>(P, rows_of, threads); });
  return known ? 0 : fail(err, errlen, "unsupported dtype code %lld%.0lld", p->dtype, 0);
}

}  // extern "C"
