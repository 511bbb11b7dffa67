// How fast can the decode kernel's K/V be read at all, in which order? The W1 layout of
// bench_attention.py (64 sequences of 100..900 tokens, 3 KV heads, 16-token blocks of 64 dims,
// blocks scattered through a pool with 25% to spare, 6 layers' caches in turn, 2 MiB pages), read
// with no arithmetic in several orders, on the OpenMP threads, sequences longest first:
//   runs N    each (sequence, KV head)'s runs of one block and head, N at a time, line i of each
//             before line i + 1 (the kernel visits 4: paged_attention.cpp, kStripes);
//   blocks N  each sequence's whole blocks (all heads side by side: 3x longer runs), N at a time;
//   +pf       also software-prefetching the next N runs while reading these, as the kernel does.
// A plain sequential read of 1 GiB follows each variant's rounds: the host's read rate swings
// between about 35 and 66 GB/s from one minute to the next on this VM, so each line says which.
//
//   g++ -O2 -march=native -fopenmp benchmarks/read_orders.cpp -o /tmp/read_orders
//   OMP_NUM_THREADS=2 /tmp/read_orders [element bytes: 4 | 2] [seconds: 120]
//
// Prints one line per variant and pass ("order ms GB/s-of-K/V sequential-GB/s"), then per variant
// the median ms over passes where the sequential read ran above 45 GB/s and below.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

typedef float Line __attribute__((vector_size(64)));  // one cache line
inline Line at(const char* p, size_t o) { return *reinterpret_cast<const Line*>(p + o); }

char* huge_buffer(size_t bytes) {
  const size_t size = (bytes + (size_t(1) << 21) - 1) >> 21 << 21;
  void* p = std::aligned_alloc(size_t(1) << 21, size);
  madvise(p, size, MADV_HUGEPAGE);
  std::memset(p, 1, size);
  return static_cast<char*>(p);
}

struct Order {
  std::string name;
  int streams;    // runs read at once
  bool blocks;    // whole blocks (every head) instead of one head's run
  bool prefetch;  // software-prefetch the next `streams` runs
};

// Reads every run of `items` (each a list of run offsets) in k and v, `o.streams` at a time.
float read_all(const std::vector<std::vector<int64_t>>& items, size_t run, const char* k, const char* v,
               const Order& o) {
  std::atomic<size_t> next{0};
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    Line acc{};
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      const std::vector<int64_t>& runs = items[i];
      const int n = int(runs.size());
      for (int j = 0; j < n; j += o.streams) {
        const int m = std::min(o.streams, n - j), ahead = o.prefetch ? std::max(0, std::min(o.streams, n - j - m)) : 0;
        for (const char* base : {k, v}) {
          Line w[16] = {};
          for (size_t off = 0; off < run; off += 64) {
            for (int b = 0; b < m; ++b) w[b] += at(base + runs[j + b], off);
            for (int b = 0; b < ahead; ++b) __builtin_prefetch(base + runs[j + m + b] + off, 0, 2);
          }
          for (const Line& x : w) acc += x;
        }
      }
    }
    for (int e = 0; e < 16; ++e) total += acc[e];
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const int elem = argc > 1 ? std::atoi(argv[1]) : 4;
  const int seconds = argc > 2 ? std::atoi(argv[2]) : 120;
  const int seqs = 64, heads = 3, bs = 16, dim = 64, layers = 6;
  const size_t run = size_t(bs) * dim * elem;
  std::mt19937 gen(0);
  std::vector<int> nblocks(seqs);
  int total = 0;
  for (int& n : nblocks) {
    n = (100 + int(gen() % 801) + bs - 1) / bs;
    total += n;
  }
  const int pool_blocks = int(total * 1.25) + 1;
  std::vector<int> pool(pool_blocks);
  for (int i = 0; i < pool_blocks; ++i) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), gen);
  std::vector<int> order(seqs);
  for (int i = 0; i < seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return nblocks[a] > nblocks[b]; });
  std::vector<std::vector<int>> table(seqs);
  for (int s = 0, used = 0; s < seqs; ++s)
    for (int j = 0; j < nblocks[s]; ++j) table[s].push_back(pool[used++]);
  std::vector<std::vector<int64_t>> per_head, per_block;  // items, longest first
  for (int s : order) {
    per_block.emplace_back();
    for (int b : table[s]) per_block.back().push_back(int64_t(b) * heads * int64_t(run));
    for (int h = 0; h < heads; ++h) {
      per_head.emplace_back();
      for (int b : table[s]) per_head.back().push_back((int64_t(b) * heads + h) * int64_t(run));
    }
  }
  const size_t pool_bytes = size_t(pool_blocks) * heads * run, kv_bytes = size_t(total) * heads * run * 2;
  std::vector<std::pair<char*, char*>> caches;
  for (int l = 0; l < layers; ++l) caches.emplace_back(huge_buffer(pool_bytes), huge_buffer(pool_bytes));
  const size_t probe_bytes = size_t(1) << 30;
  const char* probe = huge_buffer(probe_bytes);
  const std::vector<Order> orders = {
      {"runs 4", 4, false, false},   {"runs 8", 8, false, false},   {"runs 16", 16, false, false},
      {"runs 4 +pf", 4, false, true}, {"blocks 4", 4, true, false}, {"blocks 8", 8, true, false},
  };
  using Clock = std::chrono::steady_clock;
  const auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  std::map<std::string, std::vector<double>> fast, slow;
  float sink = 0;
  for (const auto end = Clock::now() + std::chrono::seconds(seconds); Clock::now() < end;) {
    for (const Order& o : orders) {
      double best = 1e30;
      for (int r = 0; r < 3; ++r) {
        const auto t = Clock::now();
        for (const auto& [k, v] : caches) sink += read_all(o.blocks ? per_block : per_head, o.blocks ? run * heads : run, k, v, o);
        best = std::min(best, ms_since(t) / layers);
      }
      const auto t = Clock::now();
      float s = 0;
#pragma omp parallel for reduction(+ : s)
      for (size_t off = 0; off < probe_bytes; off += 256) s += (at(probe, off) + at(probe, off + 64) + at(probe, off + 128) + at(probe, off + 192))[0];
      sink += s;
      const double rate = double(probe_bytes) / ms_since(t) / 1e6;
      std::printf("%-11s %.3f %.1f %.1f\n", o.name.c_str(), best, double(kv_bytes) / best / 1e6, rate);
      (rate > 45 ? fast : slow)[o.name].push_back(best);
    }
  }
  std::printf("# K/V %.1f MiB a layer (%d-byte elements); median ms where the sequential read ran > 45 GB/s | below\n",
              double(kv_bytes) / (1 << 20), elem);
  const auto median = [](std::vector<double> x) { return x.empty() ? 0.0 : (std::sort(x.begin(), x.end()), x[x.size() / 2]); };
  for (const Order& o : orders)
    std::printf("# %-11s %.3f (%zu) | %.3f (%zu)\n", o.name.c_str(), median(fast[o.name]), fast[o.name].size(),
                median(slow[o.name]), slow[o.name].size());
  return sink == 12345.f;  // (keeps the reads)
}
