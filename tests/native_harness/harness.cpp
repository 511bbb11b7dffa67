// Numeric check of the C++ kernels without Python or torch: small random inputs through every
// entry point of pagedkv/csrc, compared with a scalar reference computed here in double. Built
// once per vector ISA (natively for the x86 ones, with the AArch64 cross compiler and run under
// qemu-user for NEON) by tests/test_native_isa.py, against the same pagedkv_abi.h as Python. Prints one line per check and "N passed, M
// failed"; exits non-zero on any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "pagedkv_abi.h"

namespace {

#if defined(__aarch64__)
using half = __fp16;  // GCC 12's C++ has no _Float16 on Arm
#else
using half = _Float16;
#endif

std::mt19937 rng(1234);
int passed = 0, failed = 0;

char err[256] = "";  // the last kernel's message

// Records a kernel that refused its arguments (nonzero status) as a failed check.
void ran(int status, const char* kernel) {
  if (status == 0) return;
  failed++;
  std::printf("FAIL %s refused: %s\n", kernel, err);
}

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// Element codecs by pagedkv_dtype, scalar and independent of vec.h.
float decode(int dtype, const uint8_t* p) {
  switch (dtype) {
    case PAGEDKV_DTYPE_FLOAT32: { float f; std::memcpy(&f, p, 4); return f; }
    case PAGEDKV_DTYPE_BFLOAT16: { uint32_t b = uint32_t(p[0] | (p[1] << 8)) << 16; float f; std::memcpy(&f, &b, 4); return f; }
    case PAGEDKV_DTYPE_FLOAT16: { half h; std::memcpy(&h, p, 2); return float(h); }
    case PAGEDKV_DTYPE_INT8: return float(int8_t(p[0]));
    default: {
      const int e = (p[0] >> 3) & 15, m = p[0] & 7;
      const double f = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
      return float((p[0] & 0x80) ? -f : f);
    }
  }
}
void encode(int dtype, float x, uint8_t* p) {
  switch (dtype) {
    case PAGEDKV_DTYPE_FLOAT32: std::memcpy(p, &x, 4); break;
    case PAGEDKV_DTYPE_BFLOAT16: {
      uint32_t b; std::memcpy(&b, &x, 4);
      const uint16_t h = uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
      std::memcpy(p, &h, 2); break;
    }
    default: { const half h = static_cast<half>(x); std::memcpy(p, &h, 2); }
  }
}
size_t elem_size(int dtype) {
  return dtype == PAGEDKV_DTYPE_FLOAT32 ? 4 : dtype == PAGEDKV_DTYPE_BFLOAT16 || dtype == PAGEDKV_DTYPE_FLOAT16 ? 2 : 1;
}

struct Buf {  // n elements of one dtype
  int dtype;
  std::vector<uint8_t> bytes;
  Buf(int d, size_t n) : dtype(d), bytes(n * elem_size(d)) {}
  float get(size_t i) const { return decode(dtype, &bytes[i * elem_size(dtype)]); }
  void set(size_t i, float x) { encode(dtype, x, &bytes[i * elem_size(dtype)]); }
  void* data() { return bytes.data(); }
  size_t size() const { return bytes.size() / elem_size(dtype); }
  void fill_random(float lo, float hi) {
    for (size_t i = 0; i < size(); ++i) {
      if (dtype == PAGEDKV_DTYPE_INT8) bytes[i] = uint8_t(randint(-127, 127));
      else if (dtype == PAGEDKV_DTYPE_FLOAT8_E4M3FN) { bytes[i] = uint8_t(randint(0, 255)); if ((bytes[i] & 0x7F) == 0x7F) bytes[i] ^= 1; }
      else set(i, uniform(lo, hi));
    }
  }
};

// Records one check: the largest error relative to max(1, |want|) against tol.
void check(const std::string& name, const std::vector<double>& want, const Buf& got, double tol) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::fabs(got.get(i) - want[i]) / std::max(1.0, std::fabs(want[i])));
  const bool ok = worst <= tol && !std::isnan(worst);
  (ok ? passed : failed)++;
  std::printf("%s %s: max error %.3g (tolerance %.3g)\n", ok ? "ok  " : "FAIL", name.c_str(), worst, tol);
}

const double kTol[] = {2e-5, 2e-2, 3e-3};  // per query dtype: float32, bfloat16, float16
const char* kName[] = {"float32", "bfloat16", "float16", "int8", "e4m3"};  // by pagedkv_dtype
static_assert(PAGEDKV_DTYPE_FLOAT32 == 0 && PAGEDKV_DTYPE_BFLOAT16 == 1 && PAGEDKV_DTYPE_FLOAT16 == 2 &&
                  PAGEDKV_DTYPE_INT8 == 3 && PAGEDKV_DTYPE_FLOAT8_E4M3FN == 4,
              "kTol and kName are indexed by pagedkv_dtype");

// Varlen paged attention over scattered blocks against softmax(q k^T * scale) v in double; with a
// sliding window (> 0) each query sees only the last `window` keys up to its own; with a softcap
// (> 0) each score s becomes softcap tanh(s / softcap).
// x H for rows of D: the orthonormal Hadamard matrix of quantized caches (vec.h: hadamard),
// Sylvester blocks of P = D & -D, entries (-1)^popcount(i & j) / sqrt(P); its own inverse.
std::vector<double> hadamard_ref(const double* x, int64_t D) {
  const int64_t P = D & -D;
  std::vector<double> y(D, 0.0);
  for (int64_t b = 0; b < D; b += P)
    for (int64_t i = 0; i < P; ++i)
      for (int64_t j = 0; j < P; ++j) y[b + i] += x[b + j] * (__builtin_popcountll(i & j) % 2 ? -1.0 : 1.0);
  for (double& v : y) v /= std::sqrt(double(P));
  return y;
}

void attention(int dtype, int kv_dtype, int64_t D, int threads, int64_t window = 0, float softcap = 0) {
  const int64_t Hkv = 2, G = 3, Hq = Hkv * G, bs = 16, B = 3;
  const int32_t seq_lens[B] = {1 + randint(0, 40), 70 + randint(0, 200), 300 + randint(0, 300)};
  const int32_t qlens[B] = {1, 30, 1};  // 90 rows of a prompt chunk: the panel path on every ISA
  std::vector<int32_t> qsl(B + 1, 0);
  int64_t max_blocks = 0, num_blocks = 0;
  for (int b = 0; b < B; ++b) {
    qsl[b + 1] = qsl[b] + qlens[b];
    max_blocks = std::max<int64_t>(max_blocks, (seq_lens[b] + bs - 1) / bs);
    num_blocks += (seq_lens[b] + bs - 1) / bs;
  }
  num_blocks += 4;
  std::vector<int32_t> perm(num_blocks), tables(B * max_blocks, 0);
  for (int64_t i = 0; i < num_blocks; ++i) perm[i] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t b = 0, used = 0; b < B; ++b)
    for (int64_t j = 0; j < (seq_lens[b] + bs - 1) / bs; ++j) tables[b * max_blocks + j] = perm[used++];
  const int cache = kv_dtype < 0 ? dtype : kv_dtype;
  const int64_t T = qsl[B];
  Buf q(dtype, T * Hq * D), out(dtype, T * Hq * D), k(cache, num_blocks * Hkv * bs * D), v(cache, k.size());
  q.fill_random(-1, 1); k.fill_random(-1, 1); v.fill_random(-1, 1);
  std::vector<float> ks(num_blocks * Hkv * bs, 1.f), vs(num_blocks * Hkv * bs, 1.f);  // per (token, head)
  if (kv_dtype >= 0)
    for (size_t i = 0; i < ks.size(); ++i) { ks[i] = uniform(0.001f, 0.01f); vs[i] = uniform(0.001f, 0.01f); }
  const float scale = float(1.0 / std::sqrt(double(D)));
  pagedkv_paged_attention_params p{};
  p.dtype = pagedkv_dtype(dtype);
  p.kv_dtype = pagedkv_dtype(cache);
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = out.data();
  p.k_scales = kv_dtype >= 0 ? ks.data() : nullptr;
  p.v_scales = kv_dtype >= 0 ? vs.data() : nullptr;
  p.query_start_loc = qsl.data(); p.seq_lens = seq_lens; p.block_tables = tables.data();
  p.num_tokens = T; p.num_seqs = B; p.max_blocks = max_blocks; p.num_blocks = num_blocks;
  p.num_q_heads = Hq; p.num_kv_heads = Hkv; p.block_size = bs; p.head_dim = D;
  p.q_stride = Hq * D; p.out_stride = Hq * D; p.scale = scale; p.threads = threads;
  p.window = window;
  p.softcap = softcap;
  if (pagedkv_paged_attention(&p, err, sizeof err)) {
    ran(1, "paged_attention");
    return;
  }
  // what each K/V row stands for: code x scale, and for a quantized cache rotated back
  std::vector<double> kd(k.size()), vd(v.size());
  for (int64_t r = 0; r < num_blocks * Hkv * bs; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      kd[r * D + d] = double(k.get(r * D + d)) * ks[r];
      vd[r * D + d] = double(v.get(r * D + d)) * vs[r];
    }
    if (kv_dtype >= 0)
      for (std::vector<double>* rows : {&kd, &vd}) {
        const std::vector<double> back = hadamard_ref(rows->data() + r * D, D);
        std::copy(back.begin(), back.end(), rows->begin() + r * D);
      }
  }
  std::vector<double> want(out.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < qlens[b]; ++i)
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t t = qsl[b] + i, h = hq / G, end = seq_lens[b] - qlens[b] + i + 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0, keys = end - first;
        std::vector<double> s(keys);
        double mx = -1e300, sum = 0;
        const auto row = [&](int64_t pos) {
          pos += first;
          const int64_t blk = tables[b * max_blocks + pos / bs];
          return ((blk * Hkv + h) * bs + pos % bs) * D;
        };
        for (int64_t p = 0; p < keys; ++p) {
          const int64_t at = row(p);
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(q.get((t * Hq + hq) * D + d)) * kd[at + d];
          s[p] = dot * scale;
          if (softcap > 0) s[p] = softcap * std::tanh(s[p] / softcap);
          mx = std::max(mx, s[p]);
        }
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t p = 0; p < keys; ++p) acc += s[p] * vd[row(p) + d];
          want[(t * Hq + hq) * D + d] = acc / sum;
        }
      }
  check(std::string("attention ") + kName[dtype] + " cache " + kName[cache] + " D=" + std::to_string(D) +
            " threads=" + std::to_string(threads) + " window=" + std::to_string(window) +
            " softcap=" + std::to_string(softcap), want, out, kTol[dtype] * (kv_dtype >= 0 ? 2 : 1));
}

double round_to(int dtype, double x) { uint8_t b[4]; encode(dtype, float(x), b); return decode(dtype, b); }

// RMSNorm with the residual add, rounding where torch rounds (see layer_ops.cpp).
void rms_norm(int dtype, int64_t rows, int64_t n, float x_scale) {
  Buf x(dtype, rows * n), res(dtype, rows * n), w(dtype, n), out(dtype, rows * n);
  x.fill_random(-2, 2); res.fill_random(-2, 2); w.fill_random(0.5, 1.5);
  std::vector<double> want(rows * n), want_res(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double sq = 0;
    for (int64_t c = 0; c < n; ++c) {
      const double xv = x_scale != 0.f ? round_to(dtype, double(x.get(r * n + c)) * double(x_scale)) : x.get(r * n + c);
      want_res[r * n + c] = round_to(dtype, xv + res.get(r * n + c));
      sq += want_res[r * n + c] * want_res[r * n + c];
    }
    const double inv = 1.0 / std::sqrt(sq / double(n) + 1e-6);
    for (int64_t c = 0; c < n; ++c) want[r * n + c] = w.get(c) * round_to(dtype, want_res[r * n + c] * inv);
  }
  pagedkv_rms_norm_params p{pagedkv_dtype(dtype), x.data(), n, res.data(), w.data(), out.data(), rows, n, 1e-6f, 2,
                            x_scale};
  ran(pagedkv_rms_norm(&p, err, sizeof err), "rms_norm");
  const std::string tag = std::string(kName[dtype]) + " n=" + std::to_string(n) + " x_scale=" + std::to_string(x_scale);
  check("rms_norm residual " + tag, want_res, res, 1e-6);
  check("rms_norm " + tag, want, out, kTol[dtype]);
}

// act(gate) * up: SiLU, or (gelu) GELU with the tanh approximation.
void silu_mul(int dtype, int64_t rows, int64_t n, bool gelu) {
  Buf x(dtype, rows * 2 * n), out(dtype, rows * n);
  x.fill_random(-8, 8);
  std::vector<double> want(rows * n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const double g = x.get(r * 2 * n + c);
      const double a = gelu ? 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
                            : g / (1 + std::exp(-g));
      want[r * n + c] = round_to(dtype, a) * x.get(r * 2 * n + n + c);
    }
  pagedkv_silu_mul_params p{pagedkv_dtype(dtype), x.data(), 2 * n, out.data(), rows, n, 2, gelu};
  ran(pagedkv_silu_mul(&p, err, sizeof err), "silu_mul");
  check(std::string(gelu ? "gelu_mul " : "silu_mul ") + kName[dtype] + " n=" + std::to_string(n), want, out,
        kTol[dtype]);
}

// RoPE on the first R dims of the q and k heads (R < D: partial rotary; 0: none, a NoPE layer),
// then k and v stored at their slots of the paged cache; with `qwen`, a bias added first and each q and k head RMS-normed
// before its rotation.
void rope_cache(int dtype, int64_t D, bool qwen, int64_t R) {
  const int64_t tokens = 5, Hq = 3, Hkv = 1, stride = (Hq + 2 * Hkv) * D, max_pos = 64, bs = 4, num_blocks = 8;
  const float eps = 1e-6f;
  Buf qkv(dtype, tokens * stride), kc(dtype, num_blocks * Hkv * bs * D), vc(dtype, kc.size());
  Buf bias(dtype, stride), qn(dtype, D), kn(dtype, D);
  qkv.fill_random(-1, 1);
  bias.fill_random(-2, 2);
  qn.fill_random(0.5, 1.5);
  kn.fill_random(0.5, 1.5);
  std::vector<double> x(qkv.size());  // what RoPE rotates: bias added, heads normed, as rounded
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < stride; ++e)
      x[t * stride + e] = qwen ? round_to(dtype, qkv.get(t * stride + e) + bias.get(e)) : qkv.get(t * stride + e);
  if (qwen)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        double* head = &x[t * stride + h * D];
        double sq = 0;
        for (int64_t i = 0; i < D; ++i) sq += head[i] * head[i];
        const double inv = 1 / std::sqrt(sq / double(D) + eps);
        const Buf& w = h < Hq ? qn : kn;
        for (int64_t i = 0; i < D; ++i) head[i] = round_to(dtype, w.get(i) * round_to(dtype, head[i] * inv));
      }
  std::vector<float> cos(max_pos * std::max<int64_t>(R, 1)), sin(cos.size());
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < R; ++i) {
      const double a = p * std::pow(10000.0, -double(2 * (i % (R / 2))) / double(R));
      cos[p * R + i] = float(std::cos(a));
      sin[p * R + i] = float(i < R / 2 ? -std::sin(a) : std::sin(a));
    }
  std::vector<int64_t> pos(tokens), slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) { pos[t] = randint(0, max_pos - 1); slots[t] = t * 5 + 1; }
  std::vector<double> want(qkv.size()), want_k(kc.size(), 0.0), want_v(vc.size(), 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < Hq + 2 * Hkv; ++h)
      for (int64_t i = 0; i < D; ++i) {
        const int64_t at = t * stride + h * D;
        const double a = x[at + i];
        if (h >= Hq + Hkv || i >= R) { want[at + i] = a; continue; }
        const double b = x[at + (i + R / 2) % R];
        want[at + i] = a * cos[pos[t] * R + i] + b * sin[pos[t] * R + i];
      }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < D; ++i) {
      const int64_t c = ((slots[t] / bs * Hkv) * bs + slots[t] % bs) * D + i;
      want_k[c] = round_to(dtype, want[t * stride + Hq * D + i]);
      want_v[c] = want[t * stride + (Hq + Hkv) * D + i];
    }
  pagedkv_rope_cache_params p{pagedkv_dtype(dtype), qkv.data(), tokens, stride, Hq, Hkv, D, pos.data(),
                              R ? cos.data() : nullptr, R ? sin.data() : nullptr, max_pos, slots.data(), kc.data(),
                              vc.data(), num_blocks, bs, 2,
                              qwen ? bias.data() : nullptr, qwen ? qn.data() : nullptr,
                              qwen ? kn.data() : nullptr, eps, R == D ? 0 : R};
  ran(pagedkv_rope_cache(&p, err, sizeof err), "rope_cache");
  const std::string tag = std::string(kName[dtype]) + " D=" + std::to_string(D) + " R=" + std::to_string(R) +
                          (qwen ? " bias+norm" : "");
  check("rope " + tag, want, qkv, kTol[dtype]);
  check("rope k cache " + tag, want_k, kc, kTol[dtype]);
  check("rope v cache " + tag, want_v, vc, 0);
}

// Quantized writes of rows (tokens a padded stride apart) that the write rotates first: each
// (token, head) row's scale from its own largest rotated |x|, each value within half a step of
// int8 or within e4m3's rounding.
void quant_write(int format, int64_t D) {
  const int64_t T = 6, H = 2, bs = 4, num_blocks = 4, stride = H * D + 7;
  std::vector<float> raw(T * stride, 1e30f);  // the padding must not be read
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < H * D; ++e) raw[t * stride + e] = uniform(-3, 3) * (randint(0, 9) ? 1.f : 1e-3f);
  std::vector<double> x(T * H * D);  // the rows rotated
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> row(raw.begin() + t * stride + h * D, raw.begin() + t * stride + (h + 1) * D);
      const std::vector<double> r = hadamard_ref(row.data(), D);
      std::copy(r.begin(), r.end(), x.begin() + (t * H + h) * D);
    }
  std::vector<int64_t> slots = {0, 1, 2, 3, 8, 9};  // blocks 0 and 2, both from offset 0
  Buf data(format, num_blocks * H * bs * D);
  std::vector<float> scales(num_blocks * H * bs, 0.f);
  pagedkv_quant_write_params p{pagedkv_dtype(format), PAGEDKV_DTYPE_FLOAT32, raw.data(), stride, T, H, D, slots.data(),
                               data.data(), scales.data(), num_blocks, bs};
  ran(pagedkv_quant_write(&p, err, sizeof err), "quant_write");
  std::vector<double> want(data.size(), 0.0);
  Buf got(0, data.size());
  bool scales_ok = true;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (slots[t] / bs * H + h) * bs + slots[t] % bs;  // in [blocks, H, bs]
      double amax = 0;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[(t * H + h) * D + d]));
      const double s = format == PAGEDKV_DTYPE_INT8 ? amax / 127 : std::min(std::exp2(std::ceil(std::log2(amax / 448))), 128.0);
      scales_ok &= std::fabs(scales[row] - s) <= 1e-6 * s;
      for (int64_t d = 0; d < D; ++d) {
        want[row * D + d] = x[(t * H + h) * D + d] / scales[row];  // in steps of the scale
        got.set(row * D + d, data.get(row * D + d));
      }
    }
  (scales_ok ? passed : failed)++;
  std::printf("%s quant_write %s D=%lld scales\n", scales_ok ? "ok  " : "FAIL", kName[format], (long long)D);
  // int8: within half a step; e4m3: within 1/16 relative (3 mantissa bits) or 2^-10 absolute.
  check(std::string("quant_write ") + kName[format] + " D=" + std::to_string(D), want, got, format == PAGEDKV_DTYPE_INT8 ? 0.5 : 0.0625);
}

// Greedy tokens: each row's first maximum, with ties, rows of -inf and a NaN (torch's rule: the
// first NaN) among them.
void argmax(int64_t n) {
  const int64_t rows = 5;
  std::vector<float> x(rows * n);
  for (float& f : x) f = float(randint(-3, 3));  // many ties
  for (int64_t c = 0; c < n; ++c) x[n + c] = -INFINITY;
  x[3 * n + n / 2] = NAN;
  x[3 * n + n - 1] = NAN;
  std::vector<int64_t> out(rows, -1);
  pagedkv_argmax_params p{x.data(), n, out.data(), rows, n, 2};
  ran(pagedkv_argmax(&p, err, sizeof err), "argmax");
  bool ok = true;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t want = 0;
    for (int64_t c = 0; c < n; ++c) {
      const float v = x[r * n + c];
      if (std::isnan(v)) { want = c; break; }
      if (v > x[r * n + want]) want = c;
    }
    ok &= out[r] == want;
  }
  (ok ? passed : failed)++;
  std::printf("%s argmax n=%lld\n", ok ? "ok  " : "FAIL", (long long)n);
}

// True where the build lacks the bf16 GEMM (no AVX512_BF16): then the call must have refused.
bool refused_without_bf16(int status, const std::string& tag) {
  if (pagedkv_bf16_gemm()) return false;
  (status ? passed : failed)++;
  std::printf("%s %s refused without AVX512_BF16\n", status ? "ok  " : "FAIL", tag.c_str());
  return true;
}

// x [rows, k] times W [n, k] transposed, in double.
std::vector<double> product(const Buf& x, const Buf& w, int64_t rows, int64_t n, int64_t k) {
  std::vector<double> out(rows * n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double s = 0;
      for (int64_t i = 0; i < k; ++i) s += double(x.get(r * k + i)) * w.get(c * k + i);
      out[r * n + c] = s;
    }
  return out;
}

// The bf16 GEMM where the build has it (AVX512_BF16) against the product in double; elsewhere
// it must refuse.
void gemm_bf16(int64_t rows, int64_t n, int64_t k) {
  Buf x(PAGEDKV_DTYPE_BFLOAT16, rows * k), w(PAGEDKV_DTYPE_BFLOAT16, n * k), out(PAGEDKV_DTYPE_BFLOAT16, rows * n);
  x.fill_random(-1, 1); w.fill_random(-1, 1);
  Buf packed(PAGEDKV_DTYPE_BFLOAT16, n * k);  // panels of 32 rows of w, each [k / 2][rows][2]
  for (int64_t p0 = 0, at = 0; p0 < n; p0 += 32) {
    const int64_t cols = std::min<int64_t>(32, n - p0);
    for (int64_t kp = 0; kp < k / 2; ++kp)
      for (int64_t c = 0; c < cols; ++c)
        for (int j = 0; j < 2; ++j) packed.set(at++, w.get((p0 + c) * k + 2 * kp + j));
  }
  pagedkv_gemm_bf16_params p{x.data(), k, packed.data(), out.data(), n, rows, n, k, 2};
  const int status = pagedkv_gemm_bf16(&p, err, sizeof err);
  const std::string tag = "gemm_bf16 " + std::to_string(rows) + "x" + std::to_string(n) + "x" + std::to_string(k);
  if (refused_without_bf16(status, tag)) return;
  ran(status, "gemm_bf16");
  check(tag, product(x, w, rows, n, k), out, kTol[PAGEDKV_DTYPE_BFLOAT16]);
}

// The int4 GEMM (every build: vdpbf16ps with AVX512_BF16, dequantized into float32 elsewhere)
// against the product in double of its dequantized weights, w = (q - 8) * scale + zero per group
// of k, from panels packed as quant_linear.pack_int4 does; x and out in bfloat16 or float32.
void gemm_int4(int64_t rows, int64_t n, int64_t k, int64_t group, pagedkv_dtype dtype) {
  const int64_t groups = k / group;
  Buf x(dtype, rows * k), out(dtype, rows * n);
  x.fill_random(-1, 1);
  std::vector<int> q(n * k);
  for (int& c : q) c = randint(0, 15);
  Buf sz(PAGEDKV_DTYPE_BFLOAT16, n * groups * 2);  // [n / 32][groups][2][32]
  std::vector<double> scale(n * groups), zero(n * groups);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = ((c / 32 * groups + g) * 2) * 32 + c % 32;
      sz.set(at, uniform(0.001f, 0.01f));
      sz.set(at + 32, uniform(-0.01f, 0.01f));
      scale[c * groups + g] = sz.get(at);
      zero[c * groups + g] = sz.get(at + 32);
    }
  std::vector<uint8_t> codes(n * k / 2);  // [n / 32][k / 2][32]: byte j = element j | element j + 32 << 4
  for (int64_t p = 0; p < n / 32; ++p)
    for (int64_t kp = 0; kp < k / 2; ++kp)
      for (int j = 0; j < 32; ++j) {
        const int64_t lo = (p * 32 + j / 2) * k + 2 * kp + j % 2, hi = (p * 32 + 16 + j / 2) * k + 2 * kp + j % 2;
        codes[(p * (k / 2) + kp) * 32 + j] = uint8_t(q[lo] | (q[hi] << 4));
      }
  pagedkv_gemm_int4_params p{dtype, x.data(), k, codes.data(), sz.data(), out.data(), n, rows, n, k, group, 2};
  const std::string tag = "gemm_int4 " + std::to_string(rows) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                          (dtype == PAGEDKV_DTYPE_FLOAT32 ? " float32" : " bfloat16");
  ran(pagedkv_gemm_int4(&p, err, sizeof err), "gemm_int4");
  std::vector<double> want(rows * n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double s = 0;
      for (int64_t i = 0; i < k; ++i)
        s += x.get(r * k + i) * ((q[c * k + i] - 8) * scale[c * groups + i / group] + zero[c * groups + i / group]);
      want[r * n + c] = s;
    }
  check(tag, want, out, kTol[PAGEDKV_DTYPE_BFLOAT16]);  // (float32 x: rounded to bf16 on some builds)
}

// The float32 GEMM (every build) against the product in double, W packed as prepacked.py does:
// panels of 2 x vector width rows, each [k][c], the last padded with zero rows.
void gemm_f32(int64_t rows, int64_t n, int64_t k) {
  const int64_t c = 2 * pagedkv_vector_width(), panels = (n + c - 1) / c;
  Buf x(PAGEDKV_DTYPE_FLOAT32, rows * k), w(PAGEDKV_DTYPE_FLOAT32, n * k), out(PAGEDKV_DTYPE_FLOAT32, rows * n);
  x.fill_random(-1, 1); w.fill_random(-1, 1);
  Buf packed(PAGEDKV_DTYPE_FLOAT32, panels * c * k);
  for (int64_t p0 = 0; p0 < panels; ++p0)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < c; ++j) {
        const int64_t col = p0 * c + j;
        packed.set((p0 * k + i) * c + j, col < n ? w.get(col * k + i) : 0.f);
      }
  pagedkv_gemm_f32_params p{static_cast<const float*>(x.data()), k, static_cast<const float*>(packed.data()),
                            static_cast<float*>(out.data()), n, rows, n, k, 2};
  ran(pagedkv_gemm_f32(&p, err, sizeof err), "gemm_f32");
  check("gemm_f32 " + std::to_string(rows) + "x" + std::to_string(n) + "x" + std::to_string(k),
        product(x, w, rows, n, k), out, kTol[PAGEDKV_DTYPE_FLOAT32]);
}

// LoRA deltas: rows under two adapters of ranks 3 and 5 (one with none), a row under none; x and
// out are rows of wider buffers (strides past their widths).
void lora(int dtype, int64_t rows, int64_t k, int64_t n) {
  const int64_t xs = k + 3, os = n + 5;
  const int32_t ranks[3] = {3, 0, 5};
  Buf x(dtype, rows * xs), out(dtype, rows * os), a0(dtype, 3 * k), b0(dtype, 3 * n), a2(dtype, 5 * k), b2(dtype, 5 * n);
  for (Buf* b : {&x, &out, &a0, &b0, &a2, &b2}) b->fill_random(-1, 1);
  std::vector<int32_t> slots(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) slots[size_t(r)] = int32_t(r % 4) - 1;  // -1, 0, 1 (rank 0), 2
  const Buf* as[3] = {&a0, nullptr, &a2};
  const Buf* bs[3] = {&b0, nullptr, &b2};
  std::vector<double> want(static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double v = out.get(r * os + c);
      const int s = slots[size_t(r)];
      for (int j = 0; s >= 0 && j < ranks[s]; ++j) {
        double t = 0;
        for (int64_t i = 0; i < k; ++i) t += double(x.get(r * xs + i)) * as[s]->get(j * k + i);
        v += t * bs[s]->get(j * n + c);
      }
      want[size_t(r * n + c)] = v;
    }
  const int64_t a[3] = {int64_t(a0.data()), 0, int64_t(a2.data())}, b[3] = {int64_t(b0.data()), 0, int64_t(b2.data())};
  pagedkv_lora_params p{pagedkv_dtype(dtype), x.data(), xs, out.data(), os, slots.data(), a, b, ranks, 3, rows, k, n, 2};
  ran(pagedkv_lora(&p, err, sizeof err), "lora");
  Buf got(dtype, static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) got.set(size_t(r * n + c), out.get(r * os + c));
  check(std::string("lora ") + kName[dtype] + " " + std::to_string(rows) + "x" + std::to_string(k) + "x" +
            std::to_string(n), want, got, kTol[dtype] * 4);
}

}  // namespace

int main() {
  std::printf("ISA %s\n", pagedkv_isa());
  for (int dtype : {PAGEDKV_DTYPE_FLOAT32, PAGEDKV_DTYPE_BFLOAT16, PAGEDKV_DTYPE_FLOAT16}) {
    for (int64_t D : {64, 40, 100}) attention(dtype, -1, D, 2);
    for (int kv : {PAGEDKV_DTYPE_INT8, PAGEDKV_DTYPE_FLOAT8_E4M3FN}) attention(dtype, kv, 64, 1);
    for (int64_t window : {1, 20, 150}) attention(dtype, -1, 64, 2, window);
    for (int64_t window : {0, 20}) attention(dtype, -1, 64, 2, window, 0.25f);
    for (int64_t n : {64, 100}) {
      for (float x_scale : {0.f, 0.22f}) rms_norm(dtype, 3, n, x_scale);
      for (bool gelu : {false, true}) silu_mul(dtype, 3, n, gelu);
    }
    for (int64_t D : {64, 20})
      for (bool qwen : {false, true})
        for (int64_t R : {D, D * 3 / 4 / 2 * 2, int64_t(0)}) rope_cache(dtype, D, qwen, R);
    lora(dtype, 11, 40, 36);
    lora(dtype, 64, 576, 192);
  }
  attention(PAGEDKV_DTYPE_BFLOAT16, -1, 128, 1);
  for (int fmt : {PAGEDKV_DTYPE_INT8, PAGEDKV_DTYPE_FLOAT8_E4M3FN}) for (int64_t D : {64, 36}) quant_write(fmt, D);
  for (int64_t n : {1, 37, 1000}) argmax(n);
  gemm_bf16(3, 40, 64);
  gemm_bf16(29, 96, 576);
  for (pagedkv_dtype d : {PAGEDKV_DTYPE_BFLOAT16, PAGEDKV_DTYPE_FLOAT32}) {
    gemm_int4(1, 64, 64, 32, d);
    gemm_int4(13, 96, 576, 32, d);
    gemm_int4(7, 32, 256, 128, d);
    gemm_int4(64, 64, 96, 32, d);
  }
  for (int64_t rows : {1, 5, 13, 64}) gemm_f32(rows, 40, 96);  // every row block and tail, a partial panel
  gemm_f32(7, 100, 576);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
