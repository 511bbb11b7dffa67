// How fast one core reads the bytes decode attention needs, in the order the kernel reads them,
// against a plain sequential read: the yardstick for bench_attention.py's memory bound (which
// divides the bytes by the sequential rate). Nothing but loads and adds; one thread, timed by
// its CPU time, best of 5.
//
//   g++ -O2 -march=native -Wno-psabi -o /tmp/read_pattern benchmarks/read_pattern.cpp
//   /tmp/read_pattern [elem_bytes=4] [huge=0]    # 4: float32 K/V, 2: bfloat16; huge=1: THP pool
//
// The shape is bench_attention.py's W1 layer: 64 sequences of 100..900 tokens, 3 KV heads of 64
// dims, 16-token blocks drawn at random from a pool 25% larger, 6 layers' caches cycled. A
// (block, head) run is 4 KiB in float32, 2 KiB in bfloat16, each in its own place.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

namespace {

constexpr int kSeqs = 64, kLayers = 6, kBlock = 16, kHeads = 3, kDim = 64;

double now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// A 64-byte line of floats (one AVX-512 register, two AVX2 ones).
typedef float Line __attribute__((vector_size(64)));
inline Line line(const char* p) { return *reinterpret_cast<const Line*>(p); }

// Sums the lines [0, bytes) of one run, or of four runs, line i of each before line i + 1.
Line read1(const char* a, size_t bytes, Line acc) {
  Line x{}, y{};
  size_t o = 0;
  for (; o + 128 <= bytes; o += 128) {
    x += line(a + o);
    y += line(a + o + 64);
  }
  for (; o < bytes; o += 64) x += line(a + o);
  return acc + x + y;
}
Line read4(const char* a, const char* b, const char* c, const char* d, size_t bytes, Line acc) {
  Line w{}, x{}, y{}, z{};
  for (size_t o = 0; o < bytes; o += 64) {
    w += line(a + o);
    x += line(b + o);
    y += line(c + o);
    z += line(d + o);
  }
  return acc + w + x + y + z;
}

char* pool(size_t bytes, bool huge) {
  const size_t align = size_t(2) << 20;
  bytes = (bytes + align - 1) / align * align;
  char* p = static_cast<char*>(std::aligned_alloc(align, bytes));
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  std::fill(p, p + bytes, char(1));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int elem = argc > 1 ? std::atoi(argv[1]) : 4;
  const bool huge = argc > 2 && std::atoi(argv[2]);
  std::mt19937 gen(0);
  std::vector<int> blocks(kSeqs);
  int total = 0;
  for (int& n : blocks) total += n = (100 + int(gen() % 801) + kBlock - 1) / kBlock;
  std::vector<int> ids(size_t(total * 1.25) + 1);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int(i);
  std::shuffle(ids.begin(), ids.end(), gen);
  const size_t run = size_t(kBlock) * kDim * elem;  // one (block, head)
  std::vector<char*> k(kLayers), v(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    k[l] = pool(ids.size() * kHeads * run, huge);
    v[l] = pool(ids.size() * kHeads * run, huge);
  }
  const double bytes = double(total) * kHeads * run * 2;  // per layer
  // way 0: each (sequence, head) reads its blocks one after the other, K then V (the old order);
  // way 1: four blocks' K at once, then their V (the kernel's interleaved tiles).
  const char* names[2] = {"one run at a time (K, then V)", "four runs at a time (K, then V)"};
  volatile float sink = 0;
  for (int way = 0; way < 2; ++way) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = now();
      Line acc{};
      for (int l = 0; l < kLayers; ++l)
        for (int s = 0, first = 0; s < kSeqs; first += blocks[s++])
          for (int h = 0; h < kHeads; ++h) {
            const auto at = [&](char* base, int j) { return base + (size_t(ids[size_t(first + j)]) * kHeads + h) * run; };
            int j = 0;
            for (; way == 1 && j + 4 <= blocks[s]; j += 4) {
              acc = read4(at(k[l], j), at(k[l], j + 1), at(k[l], j + 2), at(k[l], j + 3), run, acc);
              acc = read4(at(v[l], j), at(v[l], j + 1), at(v[l], j + 2), at(v[l], j + 3), run, acc);
            }
            for (; j < blocks[s]; ++j) acc = read1(at(v[l], j), run, read1(at(k[l], j), run, acc));
          }
      best = std::min(best, (now() - t0) / kLayers);
      sink = sink + acc[0];
    }
    std::printf("%-34s %.3f ms a layer, %.1f GB/s\n", names[way], best * 1e3, bytes / best / 1e9);
  }
  const size_t n = size_t(1) << 30;
  char* seq = pool(n, huge);
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
    const Line acc = read1(seq, n, Line{});
    best = std::min(best, now() - t0);
    sink = sink + acc[0];
  }
  std::printf("%-34s %.1f GB/s (1 GiB)\n", "sequential", double(n) / best / 1e9);
  return 0;
}
