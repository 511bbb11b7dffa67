// The decode kernel's reads without its arithmetic: every (sequence, KV head)'s K and V runs
// (one block and head each: 4 KiB of float32 with 16-token blocks of 64 dims), four blocks at a
// time, line i of each of the four before line i + 1, K then V: the order the kernel's tiles
// visit them (pagedkv/csrc/paged_attention.cpp, kTile and kStripes). bench_attention.py times it
// beside the kernel, so that the kernel can be set against what its access pattern alone costs
// as well as against the sequential read.
//
// Built by bench_attention.py as the kernels are (torch's cpp_extension, -fopenmp), so that its
// threads are torch's OpenMP threads, as the kernel's are: threads of its own would compete with
// torch's, which spin for a while after each parallel region.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// Half a cache line: the vector width of every x86-64 CPU with AVX2. (A 64-byte GCC vector, one
// line, was lowered through the stack on AVX2 and read these runs 1.4x slower than this, so that the
// column overstated what the access pattern costs.)
typedef float Half __attribute__((vector_size(32)));
inline Half at(const char* p, size_t o) { return *reinterpret_cast<const Half*>(p + o); }

// Sums `nb` (1..4) runs of `bytes`, line by line across them (both halves of each line).
Half read_group(const char* const* runs, int nb, size_t bytes, Half acc) {
  Half w{}, x{}, y{}, z{};
  for (size_t o = 0; o < bytes; o += 64) {
    w += at(runs[0], o) + at(runs[0], o + 32);
    if (nb > 1) x += at(runs[1], o) + at(runs[1], o + 32);
    if (nb > 2) y += at(runs[2], o) + at(runs[2], o + 32);
    if (nb > 3) z += at(runs[3], o) + at(runs[3], o + 32);
  }
  return acc + w + x + y + z;
}

}  // namespace

// k, v: [num_blocks, heads, block_size, D] caches; tables [seqs, max_blocks]; nblocks[s]: blocks
// of sequence s; run: bytes of one (block, head). Items (sequence, head), longest first as the
// kernel runs them, are claimed from a counter by the OpenMP threads. Returns a sum of what was
// read, so that nothing is optimised away.
extern "C" float pk_read_runs(const char* k, const char* v, const int32_t* tables, int max_blocks,
                              const int32_t* nblocks, int seqs, int heads, int64_t run) {
  std::vector<int> order(static_cast<size_t>(seqs) * heads);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return nblocks[a / heads] > nblocks[b / heads]; });
  std::atomic<size_t> next{0};
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    Half acc{};
    for (size_t i; (i = next.fetch_add(1)) < order.size();) {
      const int s = order[i] / heads, h = order[i] % heads;
      const int32_t* table = tables + static_cast<int64_t>(s) * max_blocks;
      for (int j = 0; j < nblocks[s]; j += 4) {
        const int nb = std::min(4, nblocks[s] - j);
        const char* kr[4];
        const char* vr[4];
        for (int b = 0; b < nb; ++b) {
          const int64_t off = (static_cast<int64_t>(table[j + b]) * heads + h) * run;
          kr[b] = k + off;
          vr[b] = v + off;
        }
        acc = read_group(vr, nb, run, read_group(kr, nb, run, acc));
      }
    }
    for (int e = 0; e < 8; ++e) total += acc[e];
  }
  return total;
}
