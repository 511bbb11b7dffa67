// Paged attention on the CPU: every query row attends to its sequence's keys, read in place
// through the block table (no gather), with an online softmax over tiles of keys.
//
// Work is cut into items of (sequence, KV head, run of query tokens, run of keys). An item
// reads each of its K/V rows once and serves every query head of the KV head's group with
// it (GQA), so K/V traffic is one pass per layer: the memory bound. Sequences too few to
// keep every thread busy have their keys split across items (split-K); the partial results
// are merged by log-sum-exp afterwards. Items run longest first on the caller's OpenMP
// threads (torch's own libgomp), claimed from an atomic counter. How K/V rows are read and
// prefetched: see kTile. An item of few rows (decode: a KV head's G query heads) meets each key
// as dot products (tile_scores, tile_values); one of many rows (a prompt chunk, a cascade's
// shared prefix) as two small GEMMs over panels of query rows (Attend::panel_tile), or of AMX
// tiles for bf16 on CPUs that have them (Attend::amx_item).
//
// Deliberately free of torch headers: the library compiles in about 5 s (an extension that
// includes torch's headers takes about 25 s here) and is called through ctypes, which
// releases the GIL for the call.
//
// Layouts (element strides):
//   q   [T, Hq, D]  rows of one token q_stride apart, heads D apart
//   out [T, Hq, D]  rows out_stride apart, heads D apart
//   k, v [num_blocks, Hkv, block_size, D] contiguous
//   query_start_loc [B+1] (null: every sequence has one query), seq_lens [B],
//   block_tables [B, max_blocks]; query i of sequence b sits at position
//   seq_lens[b] - qlen_b + i and sees keys at positions <= its own (and, with a sliding window,
//   > its own - window: an item's keys start at its first query's window, and rows of a tile
//   that reaches past a row's window start have the keys before it masked). With a softcap
//   (Gemma 2), each tile's scores become softcap tanh(s / softcap) before any mask (cap_scores).
// A quantized cache (int8, e4m3, with per-(token, head) scales) holds K and V rotated by the
// Hadamard matrix H (vec.h: hadamard): q is rotated as it is loaded and each row's result
// rotated back, so q and out are as for a float cache.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "micro.h"
#include "pagedkv_abi.h"
#include "vec.h"

namespace {

using namespace pk;

// How a query row meets key rows. FloatDot: keys converted to float, q stored as scaled
// float. Bf16Dot (bf16 keys on CPUs with AVX512_BF16): pairs of bf16 multiplied straight from
// memory, q stored as raw bf16 and the scale applied to the scores.
template <typename T>
struct FloatDot {
  using Q = float;
  using K = Vec;
  using M = Mask;
  static constexpr int kElems = W;  // elements of a row per step
  static constexpr bool kPrescaled = true;
  static M tail(int n) { return first_lanes(n); }
  static M full() { return kFull; }
  using QV = Vec;
  static K load_k(const T* k, M m) { return load(k, m); }
  static QV load_q(const Q* q) { return load(q, kFull); }
  static Vec step(Vec a, QV q, K k) { return fma(q, k, a); }
};

#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__)
struct Bf16Dot {
  using Q = bf16;
  using K = __m512bh;
  using M = __mmask32;
  static constexpr int kElems = 32;
  static constexpr bool kPrescaled = false;
  static M tail(int n) { return static_cast<M>((uint64_t(1) << n) - 1u); }
  static M full() { return ~M(0); }
  using QV = __m512bh;
  static K load_k(const bf16* k, M m) { return (K)_mm512_maskz_loadu_epi16(m, k); }  // a bit cast
  static QV load_q(const Q* q) { return (QV)_mm512_loadu_si512(q); }
  static Vec step(Vec a, QV q, K k) { return _mm512_dpbf16_ps(a, q, k); }
};
template <typename T> struct DotFor { using type = FloatDot<T>; };
template <> struct DotFor<bf16> { using type = Bf16Dot; };
#else
template <typename T> struct DotFor { using type = FloatDot<T>; };
#endif

// ---------------------------------------------------------------------------------------

// Memory. Decode reads each sequence's K/V once, in runs of one block and head (4 KiB of float32
// with 16-token blocks of 64 dims) scattered through the pool. On one core of this AMD EPYC a
// plain read of such runs (sequential: 35 GB/s) reached 21 GB/s one run after the other and 31
// GB/s four at a time, where the hardware prefetcher follows four streams. Between the kernel's
// loads there is arithmetic, so that prefetcher falls behind; what keeps the misses in flight is
// software prefetch, spread out (a burst of prefetches stalls the core until the misses drain).
// bench_attention.py times the kernel beside a plain read of its own runs in its order
// (benchmarks/read_runs.cpp): about as fast. Hence:
// - a tile of kTile keys visits its keys as kStripes interleaved runs (four blocks at a time);
// - the next tile's rows (at an item's last tile, the next item's first) are prefetched a few
//   keys at a time while this tile's rows are used.
// bench_attention.py --cpu-time, this CPU: float32 3.8 -> 2.6 ms, bfloat16 2.2 -> 1.3 ms a layer.
constexpr int kTile = 64;       // keys per online-softmax step (a multiple of kStripes * W)
constexpr int kStripes = 4;
static_assert(kTile % (kStripes * W) == 0, "whole stripes, whole vectors of scores");
constexpr int kRowBlock = kRegisters >= 32 ? 4 : 3;  // query rows whose accumulators stay in registers
constexpr int kMaxRows = 32;    // query rows (tokens x group heads) per item, when G allows
constexpr int kPanelItemRows = 64;  // the same where many rows take the panel path (bench: 1.1x 32)
constexpr int kSplitMin = 128;  // fewest keys worth a split-K part of their own
// Most query rows (members x group heads) per shared-prefix item: larger items reuse each K/V
// tile more while it is in L1 (measured on one core: 32 rows 1.17x plain, 64 1.22x, 96 1.31x).
constexpr int kSharedRows = 128;
// Fewest query rows for which an item takes the panel path (Attend::panel_tile): a second panel at
// least half full. With fewer, padding costs more than the panels save (one half-full panel: 0.4-
// 0.6x the dot products; 96 rows of a shared prefix: 1.1-1.2x).
constexpr int kPanelMinRows = kColsF * 3 / 2;
constexpr int kAmxMinRows = 16;  // fewest query rows for which an item takes AMX tiles
constexpr int kSpan = 512;       // keys per softmax step of such an item (Attend::amx_item)
// Elements between the rows of a span's scores and transposed keys (4 bytes each) and of its bf16
// probabilities: a line past kSpan's, so that the 16 rows a tile loads or stores fall in 16
// cache sets, not 2 or 4 (2 KiB apart, they missed L1).
constexpr int kSpanPitch = kSpan + 16, kProbPitch = kSpan + 32;
// Query rows per item where a sequence's items take tiles (kMaxRows elsewhere): each item
// transposes and interleaves its keys once, for more rows.
constexpr int kAmxItemRows = 128;

struct Problem {
  const void* q; const void* k; const void* v; void* out;
  const int32_t* qsl; const int32_t* seq_lens; const int32_t* block_tables;
  int64_t T, B, max_blocks, num_blocks, Hq, Hkv, bs, D, q_stride, out_stride;
  float scale;
  const float* k_scales; const float* v_scales;  // [num_blocks * Hkv * bs] for a quantized cache, else null
  // Cascade (else null): sequence b's first pre[b] blocks are shared with the other members of
  // its group, before any of their queries; group g's members are members[gstart[g] ..
  // gstart[g + 1]). stok: the groups' query tokens, member by member (run_cascade makes it).
  const int32_t* pre = nullptr; const int32_t* gstart = nullptr; const int32_t* members = nullptr;
  int64_t ngroups = 0;
  const int32_t* stok = nullptr;
  int64_t window = 0;  // sliding window (0: none)
  float softcap = 0.f;  // scores s become softcap tanh(s / softcap) (0: none; Gemma 2)
  int G() const { return static_cast<int>(Hq / Hkv); }
  // The first key a query at position pos sees.
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  int64_t qstart(int64_t b) const { return qsl ? qsl[b] : b; }
  int64_t qlen(int64_t b) const { return qsl ? qsl[b + 1] - qsl[b] : 1; }
};

// One unit of work: query tokens [q0, q1) of sequence b on KV head h, keys [k0, k1).
// part >= 0 marks a split-K piece whose unnormalised result goes to the partials buffer.
// A shared-prefix item (cascade) serves the query tokens stok[q0 .. q1) of a group's members
// instead, all of which see every key in [k0, k1); b is one of them (its table holds the shared
// blocks).
struct Item {
  int32_t b, h, q0, q1, k0, k1, part;
  int64_t cost;
  bool shared = false;
};

// One tile's keys: their K/V row addresses (and a quantized cache's per-key scales) in the
// order the tile visits them (see Attend::locate).
struct TileRows {
  const void* kp[kTile];
  const void* vp[kTile];
  float ks[kTile];
  float vs[kTile];
  int n = 0;  // keys
};

// The K and V rows of the next tile, prefetched a few keys at a time (in its visiting order)
// while the present tile is computed.
struct Upcoming {
  const TileRows* tile = nullptr;
  int bytes = 0;  // of a row
  int done = 0;   // keys prefetched
  void fetch_to(int keys) {
    for (const int end = std::min(keys, tile->n); done < end; ++done) {
      span(tile->kp[done]);
      span(tile->vp[done]);
    }
  }
  void span(const void* row) const {
    const uintptr_t p = reinterpret_cast<uintptr_t>(row);
    for (uintptr_t line = p & ~uintptr_t(63); line < p + uintptr_t(bytes); line += 64)
      prefetch(reinterpret_cast<const void*>(line));
  }
};

// Per-thread scratch, kept across calls (OpenMP's threads live on) and grown to what a call's
// items need: allocating and zeroing it per call cost a W2 decode step ~2% (memset, ~0.7 MB a
// thread with tiles). Nothing reads what it did not write this call but padding rows and keys
// that a zero probability (or a row never stored) keeps out of every result. Scores and
// probabilities sit in s row by row (s[r * kTile + t]), or key by key (s[t * rp + r]) for an
// item taken in panels (Attend::panel_tile).
struct Scratch {
  int dp = 0;                   // D rounded up to whole vectors
  int rp = 0;                   // rows rounded up to whole panels (kColsF)
  std::vector<float> qf, acc, s, m, l;
  // Panels (sized only where a call's items may take them): query panels [rp / kColsF][D][kColsF],
  // the tile's keys and values in float [kTile][dp], the rows' accumulators transposed [D][rp].
  std::vector<float> qt, kt, vf, acct;
  std::vector<uint16_t> vt;     // the tile's (span's) V rows as bf16 pairs (tile_values_pairs, amx_item)
  // AMX tiles (Attend::amx_item; sized only where a call's items may take them, as are s and vt
  // for a span): the span's K transposed into pairs of dims [D / 2][kSpanPitch][2], its
  // probabilities in bf16 [rp][kProbPitch]; s is then [rp][kSpanPitch]
  std::vector<uint16_t> kpairs, pb;
  TileRows tiles[2];  // the tile in use (tiles[cur]) and the next one
  int cur = 0;
  Upcoming ahead;     // of tiles[cur ^ 1]
  bool primed = false;  // tiles[cur] holds the first tile of the thread's next item, prefetched

  // This thread's scratch, fit for a call's items of up to `rows` rows (with tiles, qf and acc
  // hold rp rows: tiles take whole blocks of 32).
  static Scratch& of_thread(int rows, int dp, bool panels, bool tiles) {
    thread_local Scratch ws;
    ws.dp = dp;
    ws.rp = (rows + kColsF - 1) / kColsF * kColsF;
    const size_t q = size_t(tiles ? ws.rp : rows) * dp;
    for (auto* v : {&ws.qf, &ws.acc}) grow(*v, q);
    grow(ws.s, size_t(ws.rp) * (tiles ? kSpanPitch : kTile));
    for (auto* v : {&ws.m, &ws.l}) grow(*v, size_t(ws.rp));
    for (auto* v : {&ws.qt, &ws.acct}) grow(*v, panels ? size_t(ws.rp) * dp : 0);
    for (auto* v : {&ws.kt, &ws.vf}) grow(*v, panels ? size_t(kTile) * dp : 0);
    grow(ws.vt, size_t(tiles ? kSpan : kTile) * dp);
    grow(ws.kpairs, tiles ? size_t(kSpanPitch) * dp : 0);
    grow(ws.pb, tiles ? size_t(ws.rp) * kProbPitch : 0);
    ws.cur = 0;
    ws.primed = false;
    return ws;
  }
  template <typename V>
  static void grow(V& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};

// Scores for rows [0, NR) of a row block against the tile's keys: s[i][t] = q_i . k_t, for
// whole groups of W keys (kp is padded to a multiple of W with valid addresses). q holds the
// rows qstride Dot::Q apart; NS steps of Dot::kElems cover the head dimension. Prefetches half
// a tile of `ahead` rows as it goes (unless null).
template <int NR, int NS, typename Dot, typename T>
inline void tile_scores(const typename Dot::Q* q, int qstride, const void* const* kp, const float* kscale, int nt,
                        int ns, typename Dot::M tail, float scale, float* s, Upcoming* ahead) {
  static_assert(kTile % W == 0 && W % 4 == 0, "groups of four keys make whole vectors of scores");
  const int nsv = NS ? NS : ns;
  // Small known shapes keep the query rows in registers; others read them from L1 each time.
  constexpr bool kHold = NS > 0 && NR * NS <= 12;
  typename Dot::QV held[kHold ? NR : 1][kHold ? NS : 1];
  if constexpr (kHold)
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < NS; ++c) held[i][c] = Dot::load_q(q + i * qstride + c * Dot::kElems);
  const auto query = [&](int i, int c) {
    if constexpr (kHold) return held[i][c];
    else return Dot::load_q(q + i * qstride + c * Dot::kElems);
  };
  for (int t0 = 0; t0 < nt; t0 += W) {
    if (ahead) ahead->fetch_to((t0 + W) / 2);
    Vec part[NR][kGroups];
    for (int g = 0; g < kGroups; ++g) {
      Vec a[NR][4];
      for (int i = 0; i < NR; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = zero();
      for (int c = 0; c < nsv; ++c) {
        // (a known shape has whole steps: no tail, no masked load)
        const typename Dot::M mk = NS > 0 || c + 1 < nsv ? Dot::full() : tail;
        for (int j = 0; j < 4; ++j) {
          const typename Dot::K kv = Dot::load_k(static_cast<const T*>(kp[t0 + 4 * g + j]) + c * Dot::kElems, mk);
          for (int i = 0; i < NR; ++i) a[i][j] = Dot::step(a[i][j], query(i, c), kv);
        }
      }
      for (int i = 0; i < NR; ++i) part[i][g] = reduce4(a[i][0], a[i][1], a[i][2], a[i][3]);
    }
    for (int i = 0; i < NR; ++i) {
      Vec sc = finish(part[i]);
      if (kscale) sc = mul(sc, load(kscale + t0, kFull));
      store(s + i * kTile + t0, Dot::kPrescaled ? sc : mul(sc, set1(scale)), kFull);
    }
  }
}

// acc[i][c0 .. c0+CB) += sum_t p[i][t] * v_t[c0 .. c0+CB) for rows [0, NR) of a row block.
// NR * CB independent accumulators keep the FMA pipes busy. Inlined by force: out of line, GCC
// 12 stored every accumulator to the stack after each key (bf16 hot loop 10.2 ns a key and head
// against 7.7 inlined). Halves (bf16 V in whole pairs of vectors, where the backend has
// load_halves): V read two vectors at a time, the sums held in that order meanwhile.
template <int NR, int CB, typename T, bool Halves = false>
__attribute__((always_inline)) inline void tile_values_cols(const float* p, const void* const* vp, int nt, int c0,
                                                            Mask last, float* acc, int dp, Upcoming* ahead) {
  static_assert(!Halves || (CB % 2 == 0 && std::is_same_v<T, bf16>), "whole pairs of bf16 vectors");
  Vec a[NR][CB];
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < CB; ++c) a[i][c] = load(acc + i * dp + (c0 + c) * W, kFull);
    if constexpr (Halves)
      for (int c = 0; c < CB; c += 2) to_halves(a[i][c], a[i][c + 1]);
  }
  Upcoming up = ahead ? *ahead : Upcoming{};  // a local copy stays in registers
  for (int t = 0; t < nt; ++t) {
    if (up.tile) up.fetch_to((nt + t + 1) / 2);
    const T* v = static_cast<const T*>(vp[t]) + c0 * W;
    for (int c = 0; c < CB; c += Halves ? 2 : 1) {
      Vec vv[2];
      if constexpr (Halves) load_halves(v + c * W, vv[0], vv[1]);
      else vv[0] = load(v + c * W, c + 1 < CB ? kFull : last);
      for (int i = 0; i < NR; ++i)
        for (int h = 0; h < (Halves ? 2 : 1); ++h) a[i][c + h] = fma(set1(p[i * kTile + t]), vv[h], a[i][c + h]);
    }
  }
  if (ahead) *ahead = up;
  for (int i = 0; i < NR; ++i) {
    if constexpr (Halves)
      for (int c = 0; c < CB; c += 2) from_halves(a[i][c], a[i][c + 1]);
    for (int c = 0; c < CB; ++c) store(acc + i * dp + (c0 + c) * W, a[i][c], kFull);
  }
}

// acc[i] += sum_t p[i][t] * v_t, four vectors of the head dimension at a time (the first four
// prefetching the other half tile of `ahead` rows, unless null).
template <int NR, int NC, typename T>
inline void tile_values(const float* p, const void* const* vp, int nt, int nc, Mask tail, float* acc, int dp,
                        Upcoming* ahead) {
  const int ncv = NC ? NC : nc;
  if (NC) tail = kFull;  // a known shape has whole vectors: no masked load
  constexpr bool kHalves = kBf16Halves && std::is_same_v<T, bf16> && NC > 0 && NC % 2 == 0;
  int c0 = 0;
  for (; c0 + 4 <= ncv; c0 += 4, ahead = nullptr)
    tile_values_cols<NR, 4, T, kHalves>(p, vp, nt, c0, c0 + 4 == ncv ? tail : kFull, acc, dp, ahead);
  switch (ncv - c0) {
    case 3: tile_values_cols<NR, 3, T>(p, vp, nt, c0, tail, acc, dp, ahead); break;
    case 2: tile_values_cols<NR, 2, T, kHalves>(p, vp, nt, c0, tail, acc, dp, ahead); break;
    case 1: tile_values_cols<NR, 1, T>(p, vp, nt, c0, tail, acc, dp, ahead); break;
    default: break;
  }
}

#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__)
// bf16 V with AVX512_BF16: p and V meet as bf16 pairs of consecutive keys in one dot product
// (vdpbf16ps), half the multiply-adds of V converted to float and no conversion per row block;
// the cascade's items of up to 128 rows spend most of their time here. Each tile's V rows are
// interleaved once into scratch (keys 2u and 2u + 1 side by side, per dimension), and each row's
// p rounded to bf16 pairs, as flash attention rounds P to the cache's type. unpacklo/hi_epi16
// interleave within 128-bit lanes, so of a 32-dimension chunk the `lo` accumulator holds dims
// 0-3, 8-11, 16-19, 24-27 and `hi` the others; kToLo/kToHi and kBack* move acc between orders.
constexpr bool kPairValues = true;
alignas(64) constexpr int32_t kToLo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) constexpr int32_t kToHi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
alignas(64) constexpr int32_t kBackX[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kBackY[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

// The tile's nt V rows (D a multiple of 32) as pairs: vt[((u * chunks + c) * 2 + half) * 32].
// An odd last key pairs with itself (its partner's p is 0).
inline void interleave_values(const void* const* vp, int nt, int chunks, uint16_t* vt) {
  for (int u = 0; 2 * u < nt; ++u) {
    const uint16_t* a = static_cast<const uint16_t*>(vp[2 * u]);
    const uint16_t* b = static_cast<const uint16_t*>(vp[2 * u + 1 < nt ? 2 * u + 1 : 2 * u]);
    for (int c = 0; c < chunks; ++c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
      uint16_t* dst = vt + size_t(u * chunks + c) * 64;
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// Row p[0 .. kTile) rounded to bf16, in place over its first half: 32-bit word u holds keys 2u
// (low half) and 2u + 1.
inline void pair_probs(float* p) {
  for (int t = 0; t < kTile; t += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + t + 16), _mm512_loadu_ps(p + t));
    _mm512_storeu_si512(reinterpret_cast<uint16_t*>(p) + t, (__m512i)h);
  }
}

// acc[i][32 c0 .. 32 (c0 + CC)) += sum_t p[i][t] * v_t over the tile's pairs, for rows [0, NR).
template <int NR, int CC>
__attribute__((always_inline)) inline void pair_values_cols(const float* p, const uint16_t* vt, int nt, int chunks,
                                                            int c0, float* acc, int dp, Upcoming* ahead) {
  const __m512i to_lo = _mm512_load_si512(kToLo), to_hi = _mm512_load_si512(kToHi);
  __m512 a[NR][CC][2];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < CC; ++c) {
      const float* src = acc + i * dp + (c0 + c) * 32;
      const __m512 x = _mm512_loadu_ps(src), y = _mm512_loadu_ps(src + 16);
      a[i][c][0] = _mm512_permutex2var_ps(x, to_lo, y);
      a[i][c][1] = _mm512_permutex2var_ps(x, to_hi, y);
    }
  Upcoming up = ahead ? *ahead : Upcoming{};  // a local copy stays in registers
  for (int u = 0; 2 * u < nt; ++u) {
    if (up.tile) up.fetch_to((nt + 2 * u + 2) / 2);
    __m512bh pv[NR];
    for (int i = 0; i < NR; ++i) {
      int32_t word;
      std::memcpy(&word, reinterpret_cast<const uint16_t*>(p + i * kTile) + 2 * u, sizeof word);
      pv[i] = (__m512bh)_mm512_set1_epi32(word);
    }
    for (int c = 0; c < CC; ++c) {
      const uint16_t* v = vt + size_t(u * chunks + c0 + c) * 64;
      const __m512bh lo = (__m512bh)_mm512_loadu_si512(v), hi = (__m512bh)_mm512_loadu_si512(v + 32);
      for (int i = 0; i < NR; ++i) {
        a[i][c][0] = _mm512_dpbf16_ps(a[i][c][0], pv[i], lo);
        a[i][c][1] = _mm512_dpbf16_ps(a[i][c][1], pv[i], hi);
      }
    }
  }
  if (ahead) *ahead = up;
  const __m512i back_x = _mm512_load_si512(kBackX), back_y = _mm512_load_si512(kBackY);
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < CC; ++c) {
      float* dst = acc + i * dp + (c0 + c) * 32;
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a[i][c][0], back_x, a[i][c][1]));
      _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(a[i][c][0], back_y, a[i][c][1]));
    }
}

// Two chunks (64 dimensions) at a time: NR x 4 accumulators.
template <int NR>
inline void tile_values_pairs(const float* p, const uint16_t* vt, int nt, int chunks, float* acc, int dp,
                              Upcoming* ahead) {
  int c0 = 0;
  for (; c0 + 2 <= chunks; c0 += 2, ahead = nullptr) pair_values_cols<NR, 2>(p, vt, nt, chunks, c0, acc, dp, ahead);
  if (c0 < chunks) pair_values_cols<NR, 1>(p, vt, nt, chunks, c0, acc, dp, ahead);
}
#else
constexpr bool kPairValues = false;
#endif

// T: the queries' and output's type; C: the cache's (T itself, or a quantized i8 / e4m3 whose
// blocks carry scales).
template <int NC, typename T, typename C>
struct Attend {
  using Dot = typename DotFor<C>::type;
  static constexpr bool kQuantized = std::is_same_v<C, i8> || std::is_same_v<C, e4m3>;
  using Q = typename Dot::Q;
  static constexpr int kQPerFloat = int(sizeof(float) / sizeof(Q));  // q row stride unit
  static constexpr int NS = NC * W % Dot::kElems ? 0 : NC * W / Dot::kElems;
  // bf16 V as pairs with p (tile_values_pairs): a known head size of whole 32-dim chunks
  static constexpr bool kPairs = kPairValues && std::is_same_v<C, bf16> && NC > 0 && NC * W % 32 == 0;
  // Scores of many rows through query panels: float dot products only (bf16 pairs with
  // AVX512_BF16 keep their own form, at twice the multiply-adds an instruction).
  static constexpr bool kPanels = std::is_same_v<Dot, FloatDot<C>>;

  const Problem& P;
  const int D, nc, G, ns;
  const Mask tail;
  const typename Dot::M dot_tail;
  const int row_bytes;  // of one K or V row in the cache

  explicit Attend(const Problem& p)
      : P(p), D(int(p.D)), nc(int((p.D + W - 1) / W)), G(p.G()), ns(int((p.D + Dot::kElems - 1) / Dot::kElems)),
        tail(first_lanes(int(p.D - (nc - 1) * W))), dot_tail(Dot::tail(int(p.D - (ns - 1) * Dot::kElems))),
        row_bytes(int(p.D * int64_t(sizeof(C)))) {}

  // Whether an item of this many query rows takes the panel path (panel_tile).
  static bool takes_panels(int rows) { return kPanels && rows >= kPanelMinRows; }

  // bf16 queries against a bf16 cache on a CPU with AMX: an item of many rows (a cascade's shared
  // prefix, a prompt chunk) meets its keys as tile GEMMs (amx_item).
#ifdef PAGEDKV_AMX
  static constexpr bool kTiles = std::is_same_v<T, bf16> && std::is_same_v<C, bf16> && NC > 0 && NC * W % 32 == 0;
#else
  static constexpr bool kTiles = false;
#endif
  static bool takes_tiles(int rows) {
#ifdef PAGEDKV_AMX
    return kTiles && rows >= kAmxMinRows && amx_ready();
#else
    (void)rows;
    return false;
#endif
  }

  // Most query rows of a sequence's item (whole groups of G heads, at least one).
  static int item_rows(int G) {
    const int most = kPanels ? kPanelItemRows : takes_tiles(kAmxItemRows) ? kAmxItemRows : kMaxRows;
    return std::max(G, most / G * G);
  }

  // Calls f(R, r) for the row blocks of [r0, rows): kRowBlock rows each, the last one fewer.
  template <typename F>
  static void row_blocks(int r0, int rows, F&& f) {
    by_row_blocks<kRowBlock>(rows - r0, [&](auto R, int64_t i) { f(R, r0 + int(i)); });
  }

  // Scores of rows [r0, rows) against the tile's keys; the first row block also prefetches half
  // the next tile's rows.
  void scores(Scratch& ws, int nt, int r0, int rows) const {
    const int qstride = ws.dp * kQPerFloat;
    const TileRows& cur = ws.tiles[ws.cur];
    row_blocks(r0, rows, [&](auto R, int r) {
      tile_scores<R, NS, Dot, C>(reinterpret_cast<const Q*>(ws.qf.data()) + size_t(r) * qstride, qstride, cur.kp,
                                 kQuantized ? cur.ks : nullptr, nt, ns, dot_tail, P.scale,
                                 ws.s.data() + size_t(r) * kTile, r == r0 ? &ws.ahead : nullptr);
    });
  }

  // Position of the item's first query row (shared-prefix rows see all of [k0, k1)).
  int64_t first_pos(const Item& it) const {
    return it.shared ? it.k1 : P.seq_lens[it.b] - P.qlen(it.b) + it.q0;
  }

  // The item's query rows from which on the tile at t0 is seen: earlier positions see none of it.
  int first_row(const Item& it, int64_t t0) const {
    return int(std::clamp<int64_t>((t0 - first_pos(it)) * G, 0, (it.q1 - it.q0) * G));
  }

  // The item's query rows before which the tile [t0, t0 + nt) is seen: with a sliding window,
  // later positions' windows start after it.
  int end_row(const Item& it, int64_t t0, int nt) const {
    const int rows = (it.q1 - it.q0) * G;
    if (P.window <= 0 || it.shared) return rows;
    return int(std::clamp<int64_t>((t0 + nt + P.window - 1 - first_pos(it)) * G, 0, rows));
  }

  // Soft-capping (Gemma 2): s <- softcap tanh(s / softcap) over n scores, before any mask.
  void cap_scores(float* s, int n) const {
    const Vec inv = set1(1.f / P.softcap), cap = set1(P.softcap);
    for (int c = 0; c < n; c += W) {
      const Mask m = lanes(n, c);
      store(s + c, mul(cap, vtanh(mul(load(s + c, m), inv))), m);
    }
  }

  // Sliding window: scores of keys before row r's window become -inf (rows [r0, r1); the tile at
  // t0 visited in order). `col`: scores key by key (panel layout) instead of row by row.
  void mask_window(Scratch& ws, const Item& it, int64_t t0, int nt, int r0, int r1, bool col) const {
    if (P.window <= 0 || it.shared) return;
    const float ninf = -std::numeric_limits<float>::infinity();
    const int64_t first = first_pos(it);
    for (int r = r0; r < r1; ++r) {
      const int lo = int(std::min<int64_t>(P.first_key(first + r / G) - t0, nt));
      for (int t = 0; t < lo; ++t) ws.s[col ? size_t(t) * ws.rp + r : size_t(r) * kTile + t] = ninf;
    }
  }

  // Fills `tile` with the rows of the item's keys [t0, t0 + kTile) (fewer at its end). A whole
  // tile that all its rows see is visited in kStripes interleaved runs, key i at slot
  // (i % run) * kStripes + i / run; any other in order (the causal cut needs that), with kp
  // padded to whole vectors of keys (whose extra scores are computed and never used).
  void locate(const Item& it, int64_t t0, TileRows& tile) const {
    constexpr int kRun = kTile / kStripes;
    const int nt = int(std::min<int64_t>(it.k1 - t0, kTile));
    const int64_t last_pos = first_pos(it) + (it.q1 - it.q0) - 1;
    const bool mixed = nt == kTile && first_pos(it) + first_row(it, t0) / G >= t0 + kTile - 1 &&
                       (it.shared || P.first_key(last_pos) <= t0);
    const C* k = static_cast<const C*>(P.k);
    const C* v = static_cast<const C*>(P.v);
    const int32_t* table = P.block_tables + it.b * P.max_blocks + t0 / P.bs;
    int t = 0;
    for (int64_t off = t0 % P.bs; t < nt; off = 0) {  // one run of rows per block
      const int64_t row = int64_t(*table++) * P.Hkv + it.h;
      const int64_t base = (row * P.bs + off) * P.D;
      const int n = int(std::min<int64_t>(nt - t, P.bs - off));
      for (int i = 0; i < n; ++i, ++t) {
        const int at = mixed ? (t % kRun) * kStripes + t / kRun : t;
        tile.kp[at] = k + base + i * P.D;
        tile.vp[at] = v + base + i * P.D;
        if constexpr (kQuantized) {
          tile.ks[at] = P.k_scales[row * P.bs + off + i];
          tile.vs[at] = P.v_scales[row * P.bs + off + i];
        }
      }
    }
    tile.n = nt;
    for (; t % W; ++t) {
      tile.kp[t] = tile.kp[nt - 1];
      if constexpr (kQuantized) tile.ks[t] = tile.ks[nt - 1];
    }
  }

  // The query token of the item's row r.
  int64_t token(const Item& it, int r) const {
    return it.shared ? P.stok[it.q0 + r / G] : P.qstart(it.b) + it.q0 + r / G;
  }

  // Copies the item's query rows into scratch in the form Dot wants, zero-padded.
  void load_queries(const Item& it, Scratch& ws, int rows) const {
    const T* q = static_cast<const T*>(P.q);
    const Vec scale = set1(P.scale);
    for (int r = 0; r < rows; ++r) {
      const T* src = q + token(it, r) * P.q_stride + (it.h * G + r % G) * P.D;
      float* dst = ws.qf.data() + size_t(r) * ws.dp;
      if constexpr (Dot::kPrescaled) {
        for (int c = 0; c < nc; ++c) store(dst + c * W, mul(load(src + c * W, c + 1 < nc ? kFull : tail), scale), kFull);
        if constexpr (kQuantized) hadamard(dst, D);  // into the space the cache holds K and V in
      } else {
        std::fill(dst, dst + ws.dp, 0.f);
        std::memcpy(dst, src, size_t(D) * sizeof(T));
      }
    }
  }

  // The item's query rows as panels of kColsF rows, [panel][d][kColsF] (zero rows after the last),
  // scaled as load_queries scales them.
  void load_query_panels(const Item& it, Scratch& ws, int rows) const {
    load_queries(it, ws, rows);
    for (int p = 0; p * kColsF < rows; ++p)
      for (int d = 0; d < D; ++d)
        for (int j = 0; j < kColsF; ++j) {
          const int r = p * kColsF + j;
          ws.qt[(size_t(p) * D + d) * kColsF + j] = r < rows ? ws.qf[size_t(r) * ws.dp + d] : 0.f;
        }
  }

  // Row r = token index within the item * G + group head; rows are ordered by position. `then`:
  // the item this thread runs next, if any. `starts` (a cascade's suffix items): see resume.
  void run(const Item& it, const Item* then, Scratch& ws, float* partial, const float* const* starts) const {
    const int rows = (it.q1 - it.q0) * G;
    const int64_t first_pos = this->first_pos(it);
    const bool panels = takes_panels(rows), tiles = !panels && takes_tiles(rows);
    if (panels) {
      load_query_panels(it, ws, rows);
      std::fill(ws.acct.begin(), ws.acct.begin() + size_t(D) * ws.rp, 0.f);
    } else {
      load_queries(it, ws, rows);
    }
    const int acc_rows = tiles ? (rows + 31) / 32 * 32 : rows;  // (tiles store whole row blocks)
    std::fill(ws.acc.begin(), ws.acc.begin() + size_t(acc_rows) * ws.dp, 0.f);
#ifdef PAGEDKV_AMX
    if (tiles) amx_configure();
#endif
    const int stats = panels ? (rows + kColsF - 1) / kColsF * kColsF : rows;  // panel_softmax takes whole panels
    std::fill(ws.m.begin(), ws.m.begin() + stats, -std::numeric_limits<float>::infinity());
    std::fill(ws.l.begin(), ws.l.begin() + stats, 0.f);
    if (starts) resume(it, ws, rows, panels, starts);
    if (tiles) {
      ws.primed = false;  // (a tile the last item located for this one goes unused)
      amx_item(it, ws, rows);
      finish(it, ws, rows, partial);
      return;
    }

    // Each tile locates the next one (in this item, else the thread's next item's first), whose
    // rows it prefetches as it goes; only an item not so prepared prefetches its first tile here.
    if (!ws.primed) {
      locate(it, it.k0, ws.tiles[ws.cur]);
      Upcoming{&ws.tiles[ws.cur], row_bytes}.fetch_to(kTile);
    }
    ws.primed = false;
    for (int64_t t0 = it.k0; t0 < it.k1; t0 += kTile) {
      const TileRows& cur = ws.tiles[ws.cur];
      TileRows& next = ws.tiles[ws.cur ^ 1];
      const int nt = cur.n;
      if (t0 + kTile < it.k1) locate(it, t0 + kTile, next);
      else if (then) locate(*then, then->k0, next);
      else next.n = 0;
      ws.ahead = Upcoming{&next, row_bytes};
      const int r0 = first_row(it, t0);
      if (panels) {  // (rows past their window get only -inf scores: p = 0, see panel_softmax)
        panel_tile(ws, it, t0, cur, nt, r0, rows, first_pos - t0);
      } else {
        const int r1 = end_row(it, t0, nt);
        scores(ws, nt, r0, r1);
        if (P.softcap > 0)
          for (int r = r0; r < r1; ++r) cap_scores(ws.s.data() + size_t(r) * kTile, nt);
        mask_window(ws, it, t0, nt, r0, r1, false);
        for (int r = r0; r < r1; ++r) softmax_step(ws, r, int(std::min<int64_t>(nt, first_pos + r / G - t0 + 1)));
        if constexpr (kQuantized) {  // sum_t p_t (v_t * scale_t): fold each key's V scale into p_t
          for (int r = r0; r < r1; ++r) {
            float* p = ws.s.data() + size_t(r) * kTile;
            for (int t = 0; t < nt; ++t) p[t] *= cur.vs[t];
          }
        }
        values(ws, cur, nt, r0, r1);
      }
      ws.ahead.fetch_to(kTile);  // what a shorter tile left
      ws.cur ^= 1;
      ws.primed = t0 + kTile >= it.k1 && then;
    }
    if (panels)  // acct back to rows
      for (int r = 0; r < rows; ++r)
        for (int d = 0; d < D; ++d) ws.acc[size_t(r) * ws.dp + d] = ws.acct[size_t(d) * ws.rp + r];
    if constexpr (kQuantized)  // out of the rotated space (linear: partials merge the same after)
      for (int r = 0; r < rows; ++r) hadamard(ws.acc.data() + size_t(r) * ws.dp, D);
    finish(it, ws, rows, partial);
  }

#ifdef PAGEDKV_AMX
  // An item of many rows by AMX tiles, kSpan keys at a time: the span's scores for all rows as one
  // tile GEMM (the raw bf16 queries against K transposed into pairs of dims, AMX's B layout), a
  // softmax step per row over the whole span, then acc += p V as another (p rounded to bf16, V as
  // pairs of keys), the rows' sums held in tiles across the span. Against 64-key tiles this
  // rescales and rereads each row's acc once a span, not once a tile. Rows from `rows` up to whole
  // blocks of 32 are computed on padding and never stored.
  void amx_item(const Item& it, Scratch& ws, int rows) const {
    const int64_t first = first_pos(it);
    const int rp = (rows + 31) / 32 * 32;
    const auto* q = reinterpret_cast<const char*>(ws.qf.data());
    const int qstride = ws.dp * 4;  // bytes between query rows (raw bf16 at the start of each)
    const auto* kt = reinterpret_cast<const uint32_t*>(ws.kpairs.data());  // [D / 2][kSpanPitch]
    float* s = ws.s.data();                                                // [rp][kSpanPitch]
    uint16_t* pb = ws.pb.data();                                           // [rp][kProbPitch]
    const uint16_t* vt = ws.vt.data();                                     // [kSpan / 2][D][2]
    for (int64_t s0 = it.k0; s0 < it.k1; s0 += kSpan) {
      const int n = int(std::min<int64_t>(kSpan, it.k1 - s0)), n32 = (n + 31) / 32 * 32;
      const int r0 = first_row(it, s0);  // rows before it see none of the span (causal)
      if (r0 >= rows) break;
      span_rows(it, s0, n, n32, ws);
      const int rb0 = r0 / 32 * 2;  // row tiles of 16, in pairs
      // blocks of 32 rows x 32 keys: four sums at once (a tile multiply's latency is ~3x its
      // throughput), each operand tile used twice
      for (int rb = rb0; rb * 16 < rows; rb += 2)
        for (int kb = 0; kb * 16 < n32; kb += 2) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int d = 0; d < D; d += 32) {
            _tile_loadd(4, q + size_t(rb) * 16 * qstride + d * 2, qstride);
            _tile_loadd(5, q + size_t(rb + 1) * 16 * qstride + d * 2, qstride);
            _tile_loadd(6, kt + size_t(d / 2) * kSpanPitch + kb * 16, kSpanPitch * 4);
            _tile_loadd(7, kt + size_t(d / 2) * kSpanPitch + kb * 16 + 16, kSpanPitch * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          float* out = s + size_t(rb) * 16 * kSpanPitch + kb * 16;
          _tile_stored(0, out, kSpanPitch * 4);
          _tile_stored(1, out + 16, kSpanPitch * 4);
          _tile_stored(2, out + 16 * kSpanPitch, kSpanPitch * 4);
          _tile_stored(3, out + 16 * kSpanPitch + 16, kSpanPitch * 4);
        }
      for (int r = rb0 * 16; r < rp; ++r) span_softmax(it, ws, r, r >= r0 && r < rows, s0, n, n32, first);
      for (int rb = rb0; rb * 16 < rows; rb += 2)  // 32 rows x 32 dims: four sums, as above
        for (int d = 0; d < D; d += 32) {
          float* c = ws.acc.data() + size_t(rb) * 16 * ws.dp + d;
          const int64_t down = 16 * int64_t(ws.dp);
          const int astride = ws.dp * 4;
          _tile_loadd(0, c, astride);
          _tile_loadd(1, c + 16, astride);
          _tile_loadd(2, c + down, astride);
          _tile_loadd(3, c + down + 16, astride);
          for (int t = 0; t < n32; t += 32) {
            _tile_loadd(4, pb + size_t(rb) * 16 * kProbPitch + t, kProbPitch * 2);
            _tile_loadd(5, pb + size_t(rb + 1) * 16 * kProbPitch + t, kProbPitch * 2);
            _tile_loadd(6, vt + (size_t(t / 2) * D + d) * 2, D * 4);
            _tile_loadd(7, vt + (size_t(t / 2) * D + d + 16) * 2, D * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c, astride);
          _tile_stored(1, c + 16, astride);
          _tile_stored(2, c + down, astride);
          _tile_stored(3, c + down + 16, astride);
        }
    }
  }

  // The span's K transposed into pairs of dims (kpairs[i][t]: dims 2i, 2i + 1 of key t) and its V
  // as pairs of keys (vt[u][d][2]: keys 2u, 2u + 1), keys from n to n32 zero. K goes 16 keys at a
  // time through a 16 x 16 transpose of 32-bit pairs.
  void span_rows(const Item& it, int64_t s0, int n, int n32, Scratch& ws) const {
    const auto* k = static_cast<const uint16_t*>(P.k);
    const auto* v = static_cast<const uint16_t*>(P.v);
    const uint16_t* kr[32];
    const uint16_t* vr[32];
    auto* kt = reinterpret_cast<uint32_t*>(ws.kpairs.data());
    alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
    for (int t0 = 0; t0 < n32; t0 += 32) {  // 32 keys: their rows' addresses (null past n)
      for (int i = 0; i < 32; ++i) {
        const int64_t pos = s0 + t0 + i;
        if (t0 + i >= n) {
          kr[i] = vr[i] = nullptr;
          continue;
        }
        const int64_t row = int64_t(P.block_tables[it.b * P.max_blocks + pos / P.bs]) * P.Hkv + it.h;
        const int64_t at = (row * P.bs + pos % P.bs) * P.D;
        kr[i] = k + at;
        vr[i] = v + at;
      }
      for (int half = 0; half < 2; ++half)
        for (int d = 0; d < D; d += 32) {  // 16 keys x 16 dim pairs
          __m512i x[16];
          for (int i = 0; i < 16; ++i) {
            const uint16_t* row = kr[half * 16 + i];
            x[i] = row ? _mm512_loadu_si512(row + d) : _mm512_setzero_si512();
          }
          transpose16(x);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + size_t(d / 2 + i) * kSpanPitch + t0 + half * 16, x[i]);
        }
      for (int u = 0; u < 16; ++u)
        for (int d = 0; d < D; d += 32) {
          const uint16_t* a = vr[2 * u];
          const uint16_t* b = vr[2 * u + 1];
          const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
          const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
          uint16_t* dst = ws.vt.data() + (size_t(t0 / 2 + u) * D + d) * 2;
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo, y));
          _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
  }

  // Transposes 16 rows of 16 32-bit words in place.
  static void transpose16(__m512i* x) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // x[i]: in each 128-bit lane L, column 4 L + i % 4 of rows 4 (i / 4) .. 4 (i / 4) + 3; then
    // the lanes of the four groups of rows come together column by column
    for (int i = 0; i < 16; i += 8)
      for (int j = 0; j < 4; ++j) {
        t[i + j] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0x88);
        t[i + j + 4] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0xdd);
      }
    for (int j = 0; j < 8; ++j) {
      x[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
      x[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
  }

  // Row r's softmax step over the span's scores s[r][0 .. n): the keys it sees (causal, window)
  // become p = exp(scale s - m) in bf16 (pb; 0 for the rest, up to n32), its max and sum move on
  // and its acc is rescaled. A row not `live` (or seeing no key of the span) gets p = 0.
  void span_softmax(const Item& it, Scratch& ws, int r, bool live, int64_t s0, int n, int n32, int64_t first) const {
    float* s = ws.s.data() + size_t(r) * kSpanPitch;
    uint16_t* pb = ws.pb.data() + size_t(r) * kProbPitch;
    const int64_t pos = first + r / G;
    const int hi = live ? int(std::min<int64_t>(n, pos - s0 + 1)) : 0;
    const int lo = live && P.window > 0 && !it.shared ? int(std::clamp<int64_t>(P.first_key(pos) - s0, 0, n)) : 0;
    if (lo >= hi) {
      for (int t = 0; t < n32; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), _mm256_setzero_si256());
      return;
    }
    const auto seen = [&](int t) {  // lanes of keys t .. t + 15 in [lo, hi)
      const int a = std::clamp(lo - t, 0, 16), b = std::clamp(hi - t, 0, 16);
      return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
    };
    float sc = P.scale;
    if (P.softcap > 0) {  // softcap tanh(scale s / softcap), then no further scale
      const Vec inv = set1(P.scale / P.softcap), cap = set1(P.softcap);
      for (int t = lo / 16 * 16; t < hi; t += 16) _mm512_storeu_ps(s + t, mul(cap, vtanh(mul(_mm512_loadu_ps(s + t), inv))));
      sc = 1.f;
    }
    const Vec ninf = set1(-std::numeric_limits<float>::infinity());
    Vec mx = ninf;
    for (int t = lo / 16 * 16; t < hi; t += 16) mx = _mm512_mask_max_ps(mx, seen(t), mx, _mm512_loadu_ps(s + t));
    const float m_new = std::max(ws.m[r], hmax(mx) * sc);
    const Vec scale = set1(sc * kLog2e), shift = set1(-m_new * kLog2e);
    Vec sum = zero();
    for (int t = 0; t < n32; t += 16) {
      const __mmask16 m = seen(t);
      const Vec e = m ? _mm512_maskz_mov_ps(m, vexp2_bf16(fma(_mm512_loadu_ps(s + t), scale, shift))) : zero();
      sum = add(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    advance_row(ws, r, m_new, hsum(sum));
  }
#else
  void amx_item(const Item&, Scratch&, int) const {}
#endif

  // acc += p V for rows [r0, rows) over the tile. Many rows of bf16 V (a cascade's shared items)
  // take the pair path: interleaving the tile once pays from two row blocks on (measured with
  // bench_cascade.py; a plain decode item's G rows would only pay for the interleave).
  void values(Scratch& ws, const TileRows& cur, int nt, int r0, int rows) const {
#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__)
    if constexpr (kPairs) {
      if (rows - r0 > kRowBlock) {
        interleave_values(cur.vp, nt, NC * W / 32, ws.vt.data());
        for (int r = r0; r < rows; ++r) pair_probs(ws.s.data() + size_t(r) * kTile);
        row_blocks(r0, rows, [&](auto R, int r) {
          tile_values_pairs<R>(ws.s.data() + size_t(r) * kTile, ws.vt.data(), nt, NC * W / 32,
                               ws.acc.data() + size_t(r) * ws.dp, ws.dp, r == r0 ? &ws.ahead : nullptr);
        });
        return;
      }
    }
#endif
    row_blocks(r0, rows, [&](auto R, int r) {
      tile_values<R, NC, C>(ws.s.data() + size_t(r) * kTile, cur.vp, nt, nc, tail, ws.acc.data() + size_t(r) * ws.dp,
                            ws.dp, r == r0 ? &ws.ahead : nullptr);
    });
  }

  // The tile for rows [r0, rows) of an item of many rows, as two small GEMMs over panels of kColsF
  // query rows with micro_f32 (the float32 GEMM's kernel): the scores key by key, s[t][r] = k_t .
  // q_r, each key element broadcast against a query panel; then, after the softmax, acc^T[d][r]
  // += sum_t v_t[d] p[t][r], each value element broadcast against a panel of p. Two vector loads
  // feed 2 kColsF FMAs, where a dot product (tile_scores) loads a query vector for each. The tile's
  // K and V rows are first copied to float (times a quantized cache's scales). The first panel of
  // each pass prefetches half the next tile's rows.
  void panel_tile(Scratch& ws, const Item& it, int64_t t0, const TileRows& cur, int nt, int r0, int rows,
                  int64_t first) const {
    to_float(cur.kp, cur.ks, nt, ws.kt.data(), ws.dp);
    to_float(cur.vp, cur.vs, nt, ws.vf.data(), ws.dp);
    const int p0 = r0 / kColsF, rp = ws.rp;
    for (int p = p0; p * kColsF < rows; ++p)
      by_row_blocks<kRowBlockF>(nt, [&](auto R, int64_t t) {
        if (p == p0) ws.ahead.fetch_to(int(t + R) / 2);
        micro_f32<R>({ws.kt.data() + t * ws.dp, ws.dp, 1, ws.qt.data() + size_t(p) * D * kColsF, kColsF, D, rp},
                     ws.s.data() + t * rp + p * kColsF, kColsF, nullptr);
      });
    if (P.softcap > 0)
      for (int t = 0; t < nt; ++t) cap_scores(ws.s.data() + size_t(t) * rp + p0 * kColsF, rows - p0 * kColsF);
    mask_window(ws, it, t0, nt, r0, rows, true);
    panel_softmax(ws, nt, r0, rows, first);
    for (int p = p0; p * kColsF < rows; ++p)
      by_row_blocks<kRowBlockF>(D, [&](auto R, int64_t d) {
        if (p == p0) ws.ahead.fetch_to(int((nt + 1) / 2 + (d + R) * (nt / 2) / D));
        micro_f32<R, true>({ws.vf.data() + d, 1, ws.dp, ws.s.data() + p * kColsF, rp, nt, rp},
                           ws.acct.data() + d * rp + p * kColsF, kColsF, nullptr);
      });
  }

  // The tile's n rows (K or V) in float, times their scales when the cache is quantized.
  void to_float(const void* const* rows, const float* scales, int n, float* dst, int dp) const {
    for (int t = 0; t < n; ++t) {
      const C* src = static_cast<const C*>(rows[t]);
      const Vec sc = set1(kQuantized ? scales[t] : 1.f);
      for (int c = 0; c < nc; ++c) {
        const Vec v = load(src + c * W, c + 1 < nc ? kFull : tail);
        store(dst + size_t(t) * dp + c * W, kQuantized ? mul(v, sc) : v, kFull);
      }
    }
  }

  // The softmax step of panel_tile's rows [r0, rows), W rows at a time across the keys: row r sees
  // the tile's keys t < first + r / G + 1 (first: the item's first query position less t0). A row
  // that has seen no key yet keeps max -FLT_MAX and sum 0, so it adds nothing when merged.
  void panel_softmax(Scratch& ws, int nt, int r0, int rows, int64_t first) const {
    const Vec ninf = set1(-std::numeric_limits<float>::infinity());
    const int v0 = r0 / kColsF * kColsF;  // the values pass takes whole panels: rows before r0 get p = 0
    const bool whole = first + v0 / G >= nt - 1;  // every row from v0 sees every key
    for (int j = v0; j < rows; j += W) {
      I32 seen;
      for (int i = 0; i < W; ++i) seen[i] = int32_t(std::clamp<int64_t>(first + (j + i) / G + 1, 0, nt));
      float* col = ws.s.data() + j;
      Vec mx = ninf;
      for (int t = 0; t < nt; ++t) {
        const Vec v = load(col + size_t(t) * ws.rp, kFull);
        mx = vmax(mx, whole ? v : (Vec)(seen > t ? (F32)v : (F32)ninf));
      }
      const Vec m_old = load(ws.m.data() + j, kFull);
      const Vec m_new = vmax(vmax(m_old, mx), set1(-std::numeric_limits<float>::max()));
      Vec sum = zero();
      for (int t = 0; t < nt; ++t) {
        float* at = col + size_t(t) * ws.rp;
        const Vec e = vexp(sub(load(at, kFull), m_new));
        const Vec p = whole ? e : (Vec)(seen > t ? (F32)e : F32{});
        store(at, p, kFull);
        sum = add(sum, p);
      }
      const Vec alpha = vexp(sub(m_old, m_new));  // 0 while the max was -inf or -FLT_MAX
      store(ws.l.data() + j, fma(load(ws.l.data() + j, kFull), alpha, sum), kFull);
      store(ws.m.data() + j, m_new, kFull);
      for (int d = 0; d < D; ++d) {
        float* acc = ws.acct.data() + size_t(d) * ws.rp + j;
        store(acc, mul(load(acc, kFull), alpha), kFull);
      }
    }
  }

  // Turns the first n scores of row r into probabilities under the row's running max and
  // rescales what the row has accumulated so far; scores from n on become 0.
  static void softmax_step(Scratch& ws, int r, int n) {
    if (n == kTile) softmax_tile<true>(ws, r, n);
    else softmax_tile<false>(ws, r, n);
  }
  // A bf16 output takes vexp2_bf16 (its error far under the output's rounding): half vexp's
  // operations, where the softmax was a seventh of AVX2 bf16 decode attention's arithmetic.
  template <bool kWhole>  // every score live: no masks
  static void softmax_tile(Scratch& ws, int r, int n) {
    float* s = ws.s.data() + size_t(r) * kTile;
    const Vec ninf = set1(-std::numeric_limits<float>::infinity());
    Vec mx = ninf;
    for (int t = 0; t < n; t += W) {
      const Vec v = load(s + t, kFull);
      mx = vmax(mx, kWhole ? v : masked(v, first_lanes(std::min(W, n - t)), ninf));
    }
    const float m_new = std::max(ws.m[r], hmax(mx));
    const Vec mv = set1(std::is_same_v<T, bf16> ? -m_new * kLog2e : m_new);
    Vec sum = zero();
    for (int t = 0; t < kTile; t += W) {
      Vec e = load(s + t, kFull);
      if constexpr (std::is_same_v<T, bf16>) e = vexp2_bf16(fma(e, set1(kLog2e), mv));
      else e = vexp(sub(e, mv));
      const Vec p = kWhole ? e : masked(e, first_lanes(std::clamp(n - t, 0, W)), zero());
      store(s + t, p, kFull);
      sum = add(sum, p);
    }
    advance_row(ws, r, m_new, hsum(sum));
  }

  // Row r's online softmax moves to max m_new with `sum` more of p: its sum and acc are scaled
  // by alpha = exp(m_old - m_new), 0 when the row had seen nothing (m_old = -inf), and left
  // alone (no exp call) when the max did not move.
  static void advance_row(Scratch& ws, int r, float m_new, float sum) {
    const float m_old = ws.m[r];
    const float alpha = m_new == m_old ? 1.f : std::exp(m_old - m_new);
    ws.l[r] = ws.l[r] * alpha + sum;
    ws.m[r] = m_new;
    if (alpha != 1.f) {
      float* acc = ws.acc.data() + size_t(r) * ws.dp;
      for (int c = 0; c < ws.dp; c += W) store(acc + c, mul(load(acc + c, kFull), set1(alpha)), kFull);
    }
  }

  // A grouped sequence's suffix item (run_cascade) starts where its shared prefix's item left each
  // row: the unnormalised sum of p v, the running max and the sum of p, taken up by the online
  // softmax as if the prefix's keys had been this item's first tiles. starts[token * Hkv + h]:
  // the token's G rows (dp + 2 floats each; null for a sequence in no group).
  void resume(const Item& it, Scratch& ws, int rows, bool panels, const float* const* starts) const {
    for (int r = 0; r < rows; ++r) {
      const float* src = starts[token(it, r) * P.Hkv + it.h];
      if (!src) continue;
      src += size_t(r % G) * (ws.dp + 2);
      ws.m[r] = src[ws.dp];
      ws.l[r] = src[ws.dp + 1];
      float* acc = ws.acc.data() + size_t(r) * ws.dp;  // (panels: a staging row, acct is theirs)
      std::copy(src, src + ws.dp, acc);
      if constexpr (kQuantized) hadamard(acc, D);  // back into the rotated space this item accumulates in
      if (panels)
        for (int d = 0; d < D; ++d) ws.acct[size_t(d) * ws.rp + r] = acc[d];
    }
  }

  // Writes normalised rows to the output, or, for a split-K piece, the unnormalised
  // accumulator followed by (max, sum) to its partials slot.
  void finish(const Item& it, const Scratch& ws, int rows, float* partial) const {
    for (int r = 0; r < rows; ++r) {
      const float* acc = ws.acc.data() + size_t(r) * ws.dp;
      if (it.part >= 0) {
        float* dst = partial + size_t(r) * (ws.dp + 2);
        std::memcpy(dst, acc, sizeof(float) * ws.dp);
        dst[ws.dp] = ws.m[r];
        dst[ws.dp + 1] = ws.l[r];
        continue;
      }
      const Vec inv = set1(ws.l[r] > 0.f ? 1.f / ws.l[r] : 0.f);
      T* dst = static_cast<T*>(P.out) + token(it, r) * P.out_stride + (it.h * G + r % G) * P.D;
      for (int c = 0; c < nc; ++c) store(dst + c * W, mul(load(acc + c * W, kFull), inv), c + 1 < nc ? kFull : tail);
    }
  }

  // Merges the split-K pieces [first, first + n) of one (sequence, head, query run).
  void merge(const Item& it, const float* partials, int n, int dp) const {
    const int rows = (it.q1 - it.q0) * G;
    const size_t slot = size_t(rows) * (dp + 2);
    std::vector<float> acc(dp);
    std::vector<const float*> src(n);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < n; ++j) src[j] = partials + j * slot + size_t(r) * (dp + 2);
      combine(src.data(), n, dp, acc.data(), static_cast<T*>(P.out) + token(it, r) * P.out_stride + (it.h * G + r % G) * P.D);
    }
  }

  // Writes to dst the normalised log-sum-exp combination of n partial rows (acc[dp], max, sum).
  void combine(const float* const* src, int n, int dp, float* acc, T* dst) const {
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) m = std::max(m, src[j][dp]);
    std::fill(acc, acc + dp, 0.f);
    float l = 0.f;
    for (int j = 0; j < n; ++j) {
      if (src[j][dp + 1] == 0.f) continue;
      const float w = std::exp(src[j][dp] - m);
      l += w * src[j][dp + 1];
      for (int c = 0; c < dp; c += W) store(acc + c, fma(load(src[j] + c, kFull), set1(w), load(acc + c, kFull)), kFull);
    }
    const Vec inv = set1(l > 0.f ? 1.f / l : 0.f);
    for (int c = 0; c < nc; ++c) store(dst + c * W, mul(load(acc + c * W, kFull), inv), c + 1 < nc ? kFull : tail);
  }
};

int fail(char* err, int errlen, const char* msg, long long a, long long b) {
  std::snprintf(err, size_t(errlen), msg, a, b);
  return 1;
}

// Checks everything that would otherwise read or write out of bounds.
int validate(const Problem& P, char* err, int errlen) {
  if (P.Hkv <= 0 || P.Hq % P.Hkv) return fail(err, errlen, "num_q_heads %lld is not a multiple of num_kv_heads %lld", P.Hq, P.Hkv);
  if (P.D <= 0 || P.bs <= 0) return fail(err, errlen, "head_dim %lld and block_size %lld must be positive", P.D, P.bs);
  if (P.qsl && (P.qsl[0] != 0 || P.qsl[P.B] != P.T))
    return fail(err, errlen, "query_start_loc must run from 0 to the number of query tokens %lld, ends at %lld", P.T, P.qsl[P.B]);
  if (!P.qsl && P.B != P.T) return fail(err, errlen, "decode wants one query per sequence: %lld queries, %lld sequences", P.T, P.B);
  for (int64_t b = 0; b < P.B; ++b) {
    const int64_t ctx = P.seq_lens[b], ql = P.qlen(b);
    if (ql < 0 || ql > ctx) return fail(err, errlen, "sequence %lld has %lld queries but fewer keys", b, ql);
    if (ctx > P.max_blocks * P.bs) return fail(err, errlen, "sequence %lld is longer (%lld) than its block table", b, ctx);
    for (int64_t j = 0; j < (ctx + P.bs - 1) / P.bs; ++j) {
      const int64_t blk = P.block_tables[b * P.max_blocks + j];
      if (blk < 0 || blk >= P.num_blocks) return fail(err, errlen, "sequence %lld refers to block %lld outside the cache", b, blk);
    }
  }
  return 0;
}

// Checks a cascade plan: each group's members (each in one group at most) share their first pre
// blocks, which end before their first query; a sequence with pre > 0 is in a group.
int validate_cascade(const Problem& P, char* err, int errlen) {
  if (P.ngroups < 0 || !P.gstart || !P.members || P.gstart[0] != 0)
    return fail(err, errlen, "cascade groups are malformed (%lld groups)%.0lld", P.ngroups, 0);
  std::vector<int> seen(size_t(P.B), 0);
  for (int64_t g = 0; g < P.ngroups; ++g) {
    const int64_t a = P.gstart[g], e = P.gstart[g + 1];
    if (e - a < 1 || a < 0 || e > P.B) return fail(err, errlen, "cascade group %lld is empty or out of order (ends at %lld)", g, e);
    for (int64_t m = a; m < e; ++m) {
      const int64_t b = P.members[m];
      if (b < 0 || b >= P.B || seen[b]++) return fail(err, errlen, "cascade group %lld names sequence %lld twice or outside the batch", g, b);
      const int64_t pre = P.pre[b], first = P.members[a];
      if (pre <= 0 || pre != P.pre[first] || pre * P.bs > P.seq_lens[b] - P.qlen(b))
        return fail(err, errlen, "sequence %lld: its shared prefix (%lld blocks) must be the group's and before its queries", b, pre);
      if (!std::equal(P.block_tables + b * P.max_blocks, P.block_tables + b * P.max_blocks + pre, P.block_tables + first * P.max_blocks))
        return fail(err, errlen, "sequence %lld does not share its first %lld blocks with its group", b, pre);
    }
  }
  for (int64_t b = 0; b < P.B; ++b)
    if (P.pre[b] && !seen[b]) return fail(err, errlen, "sequence %lld has a shared prefix (%lld blocks) but no group", b, P.pre[b]);
  return 0;
}

// Cuts the batch into items; long keys ranges are split when there are too few items to
// keep `threads` busy.
// Appends sequence b's items: per run of at most qchunk of its query tokens and per KV head, its
// keys from k0 up to the run's last query (part: as Item's).
void sequence_items(const Problem& P, int64_t b, int64_t qchunk, int64_t k0, int32_t part, std::vector<Item>& items) {
  const int64_t ql = P.qlen(b), ctx = P.seq_lens[b];
  for (int64_t q0 = 0; q0 < ql; q0 += qchunk) {
    const int64_t q1 = std::min(ql, q0 + qchunk), k1 = ctx - ql + q1;
    const int64_t from = std::max(k0, P.first_key(ctx - ql + q0));
    for (int64_t h = 0; h < P.Hkv; ++h)
      items.push_back({int32_t(b), int32_t(h), int32_t(q0), int32_t(q1), int32_t(from), int32_t(k1), part, (k1 - from) * (q1 - q0) * P.G()});
  }
}

std::vector<Item> plan(const Problem& P, int threads, int rows_per_item) {
  const int G = P.G();
  std::vector<Item> items;
  for (int64_t b = 0; b < P.B; ++b) sequence_items(P, b, rows_per_item / G, 0, -1, items);
  // Split-K only helps when items are few; each piece keeps at least kSplitMin keys.
  const int64_t want = int64_t(threads) * 4;
  if (threads > 1 && !items.empty() && int64_t(items.size()) < want) {
    std::vector<Item> split;
    const int64_t per = std::max<int64_t>(1, want / int64_t(items.size()));
    for (const Item& it : items) {
      const int64_t first_pos = P.seq_lens[it.b] - P.qlen(it.b) + it.q0;
      // Keys before the item's first query position are seen by its first row: only they split.
      const int64_t n = std::min<int64_t>(per, (first_pos - it.k0) / kSplitMin);
      if (n < 2) { split.push_back(it); continue; }
      const int64_t step = ((first_pos - it.k0) / n + kTile - 1) / kTile * kTile;
      int32_t part = 0;
      for (int64_t k0 = it.k0; k0 < it.k1; k0 += step) {
        Item piece = it;
        piece.k0 = int32_t(k0);
        piece.k1 = int32_t(k0 + step >= first_pos ? it.k1 : k0 + step);
        piece.part = part++;
        piece.cost = (piece.k1 - piece.k0) * (it.q1 - it.q0) * G;
        split.push_back(piece);
        if (piece.k1 == it.k1) break;
      }
    }
    items.swap(split);
  }
  return items;
}

// Gives each item with part >= 0 a slot of (rows x (dp + 2)) floats in one buffer; returns the
// slots' offsets (by item) and fills `partials`.
std::vector<size_t> partial_slots(const std::vector<Item>& items, int G, int dp, std::vector<float>& partials) {
  std::vector<size_t> slot(items.size(), 0);
  size_t total = 0;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].part >= 0) { slot[i] = total; total += size_t((items[i].q1 - items[i].q0) * G) * (dp + 2); }
  partials.assign(total, 0.f);
  return slot;
}

// Runs the items on up to `threads` OpenMP threads: those before `split` first, then (after a
// barrier) the rest, each phase longest first; the second phase's items may start from the
// first's results (`starts`, see Attend::resume).
template <typename A>
void execute(const A& attend, const std::vector<Item>& items, size_t split, float* partials,
             const std::vector<size_t>& slot, int threads, int rows_max, int dp,
             const float* const* starts = nullptr) {
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto longest_first = [&](size_t a, size_t b) { return items[a].cost > items[b].cost; };
  std::stable_sort(order.begin(), order.begin() + std::ptrdiff_t(split), longest_first);
  std::stable_sort(order.begin() + std::ptrdiff_t(split), order.end(), longest_first);
  struct alignas(64) Counter { std::atomic<size_t> next{0}; };  // a cache line each
  Counter counters[2];
  const int nthreads = int(std::min<size_t>(size_t(threads), items.size()));
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    Scratch& ws = Scratch::of_thread(rows_max, dp, A::takes_panels(rows_max), A::takes_tiles(rows_max));
    for (int phase = 0; phase < 2; ++phase) {
      const size_t begin = phase ? split : 0, end = phase ? order.size() : split;
      if (begin == end) continue;
      if (phase && split) {
#pragma omp barrier
      }
      // Each thread claims its next item before running the present one, whose last tile then
      // prefetches the next one's first.
      const auto claim = [&] { return begin + counters[phase].next.fetch_add(1, std::memory_order_relaxed); };
      for (size_t i = claim(); i < end;) {
        const size_t j = order[i], then = claim();
        attend.run(items[j], then < end ? &items[order[then]] : nullptr, ws, partials + slot[j],
                   phase ? starts : nullptr);
        i = then;
      }
    }
  }
}

template <int NC, typename T, typename C>
void run_problem(const Problem& P, int threads) {
  const Attend<NC, T, C> attend(P);
  const int G = P.G();
  const int rows_max = Attend<NC, T, C>::item_rows(G);
  const int dp = attend.nc * W;
  std::vector<Item> items = plan(P, threads, rows_max);
  if (items.empty()) return;
  std::vector<float> partials;
  const std::vector<size_t> slot = partial_slots(items, G, dp, partials);
  execute(attend, items, items.size(), partials.data(), slot, threads, rows_max, dp);
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].part != 0) continue;
    int n = 1;
    while (i + n < items.size() && items[i + n].part == n) ++n;
    attend.merge(items[i], partials.data() + slot[i], n, dp);
  }
}

// Cascade: per (sequence, KV head, run of its query tokens) one item for the keys after the
// sequence's shared prefix, and per (group, KV head, run of the group's query tokens) one item
// reading the group's prefix once for all of them, which leaves its rows' unnormalised results
// for the suffix items to start from (Attend::resume): no merge pass, no partials per sequence.
template <int NC, typename T, typename C>
void run_cascade(const Problem& given, int threads) {
  Problem P = given;
  std::vector<int32_t> stok, tstart{0};  // the groups' query tokens; group g's from tstart[g]
  for (int64_t g = 0; g < P.ngroups; ++g) {
    for (int64_t m = P.gstart[g]; m < P.gstart[g + 1]; ++m)
      for (int64_t t = P.qstart(P.members[m]), e = t + P.qlen(P.members[m]); t < e; ++t) stok.push_back(int32_t(t));
    tstart.push_back(int32_t(stok.size()));
  }
  P.stok = stok.data();
  using A = Attend<NC, T, C>;
  const A attend(P);
  const int G = P.G();
  // Each group's tokens are cut into runs of equal size, enough of them for two items per thread
  // over all groups and heads, of at most kSharedRows rows.
  const int64_t slots = P.Hkv * std::max<int64_t>(P.ngroups, 1);
  const int64_t want = (2 * int64_t(threads) + slots - 1) / slots;
  const auto run_of = [&](int64_t n) {  // tokens a shared item of a group of n serves
    const int64_t pieces = std::max<int64_t>(std::min(want, n), (n * G + kSharedRows - 1) / kSharedRows);
    return int32_t((n + pieces - 1) / pieces);
  };
  int32_t per = 1;
  for (int64_t g = 0; g < P.ngroups; ++g) per = std::max(per, run_of(tstart[g + 1] - tstart[g]));
  // a sequence's suffix: runs of query tokens as plan() cuts them
  const int64_t qchunk = A::item_rows(G) / G;
  int64_t qmax = 1;
  for (int64_t b = 0; b < P.B; ++b) qmax = std::max(qmax, P.qlen(b));
  const int rows_max = int(std::max<int64_t>(per, std::min(qmax, qchunk))) * G;
  const int dp = attend.nc * W;
  // First the groups' shared items and the items of sequences in no group; then, each starting from
  // its prefix's result, the grouped sequences' suffixes (per run of query tokens, as plan() cuts
  // them), which write the output.
  std::vector<Item> items;
  for (int64_t b = 0; b < P.B; ++b)
    if (!P.pre[b]) sequence_items(P, b, qchunk, 0, -1, items);
  for (int64_t g = 0; g < P.ngroups; ++g) {
    const int32_t leader = P.members[P.gstart[g]], keys = int32_t(P.pre[leader] * P.bs);
    const int32_t step = run_of(tstart[g + 1] - tstart[g]);
    for (int32_t h = 0; h < int32_t(P.Hkv); ++h)
      for (int32_t t0 = tstart[g]; t0 < tstart[g + 1]; t0 += step) {
        const int32_t t1 = std::min(tstart[g + 1], t0 + step);
        items.push_back({leader, h, t0, t1, 0, keys, 0, int64_t(keys) * (t1 - t0) * G, true});
      }
  }
  const size_t split = items.size();
  for (int64_t b = 0; b < P.B; ++b)
    if (P.pre[b]) sequence_items(P, b, qchunk, P.pre[b] * P.bs, -1, items);
  if (items.empty()) return;
  std::vector<float> partials;
  const std::vector<size_t> slot = partial_slots(items, G, dp, partials);
  // Each grouped (query token, KV head): its G rows of the shared item that serves it.
  std::vector<const float*> starts(size_t(P.T * P.Hkv), nullptr);
  for (size_t i = 0; i < split; ++i) {
    const Item& it = items[i];
    if (!it.shared) continue;
    for (int32_t q = it.q0; q < it.q1; ++q)
      starts[size_t(stok[q] * P.Hkv + it.h)] = partials.data() + slot[i] + size_t((q - it.q0) * G) * (dp + 2);
  }
  execute(attend, items, split, partials.data(), slot, threads, rows_max, dp, starts.data());
}

template <typename T, typename C>
void dispatch_dim(const Problem& P, int threads) {
  if (P.pre) {
    if (P.D == 64) run_cascade<64 / W, T, C>(P, threads);
    else if (P.D == 128) run_cascade<128 / W, T, C>(P, threads);
    else run_cascade<0, T, C>(P, threads);
  } else if (P.D == 64) run_problem<64 / W, T, C>(P, threads);
  else if (P.D == 128) run_problem<128 / W, T, C>(P, threads);
  else run_problem<0, T, C>(P, threads);
}

// T: the queries' type; the cache is of T itself or quantized (int8 / e4m3 with scales).
template <typename T>
int dispatch_cache(const Problem& P, pagedkv_dtype dtype, pagedkv_dtype kv_dtype, int threads) {
  if (kv_dtype == dtype) {
    dispatch_dim<T, T>(P, threads);
    return 0;
  }
  switch (kv_dtype) {
    case PAGEDKV_DTYPE_INT8: dispatch_dim<T, i8>(P, threads); return 0;
    case PAGEDKV_DTYPE_FLOAT8_E4M3FN: dispatch_dim<T, e4m3>(P, threads); return 0;
    default: return 1;
  }
}

}  // namespace

extern "C" {

// See pagedkv_abi.h. A cascade plan (pre not null) reads each group's prefix K/V once for all its
// members; without one, every sequence reads its own blocks.
int pagedkv_paged_attention(const pagedkv_paged_attention_params* p, char* err, int errlen) {
  Problem P{p->q, p->k, p->v, p->out, p->query_start_loc, p->seq_lens, p->block_tables,
            p->num_tokens, p->num_seqs, p->max_blocks, p->num_blocks, p->num_q_heads,
            p->num_kv_heads, p->block_size, p->head_dim, p->q_stride, p->out_stride, p->scale,
            p->k_scales, p->v_scales};
  P.pre = p->pre; P.gstart = p->group_start; P.members = p->group_members; P.ngroups = p->num_groups;
  P.window = p->window;
  P.softcap = p->softcap;
  if (P.window < 0 || (P.window && P.pre))
    return fail(err, errlen, "window %lld: negative, or given with a cascade plan (%lld groups)", P.window, P.ngroups);
  if (!(P.softcap >= 0) || std::isinf(P.softcap)) {
    std::snprintf(err, size_t(errlen), "softcap %g: negative or not finite", double(P.softcap));
    return 1;
  }
  if (validate(P, err, errlen) || (P.pre && validate_cascade(P, err, errlen))) return 1;
  const bool quantized = p->kv_dtype != p->dtype;
  if (quantized && !(p->k_scales && p->v_scales))
    return fail(err, errlen, "cache dtype code %lld needs k_scales and v_scales%.0lld", p->kv_dtype, 0);
  const int threads = std::max(1, int(p->threads));
  int rc = 1;
  switch (p->dtype) {
    case PAGEDKV_DTYPE_FLOAT32: rc = dispatch_cache<float>(P, p->dtype, p->kv_dtype, threads); break;
    case PAGEDKV_DTYPE_BFLOAT16: rc = dispatch_cache<bf16>(P, p->dtype, p->kv_dtype, threads); break;
    case PAGEDKV_DTYPE_FLOAT16: rc = dispatch_cache<fp16>(P, p->dtype, p->kv_dtype, threads); break;
    default: break;
  }
  return rc ? fail(err, errlen, "unsupported dtype codes %lld / %lld", p->dtype, p->kv_dtype) : 0;
}

// Lanes per vector: 16 with AVX-512, 8 with AVX2 or the portable backend, 4 with NEON.
int pagedkv_vector_width() { return W; }

// The vector backend this library was built with (vec.h).
const char* pagedkv_isa() {
#if defined(PAGEDKV_ISA_AVX512)
  return "avx512";
#elif defined(PAGEDKV_ISA_AVX2)
  return "avx2";
#elif defined(PAGEDKV_ISA_NEON)
  return "neon";
#else
  return "portable";
#endif
}

}  // extern "C"
