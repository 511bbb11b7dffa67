// AMX tiles (Intel Xeon from Sapphire Rapids on), for the kernels built for such a CPU
// (-march=native there): the bf16 GEMM (gemm.cpp) and attention items of many rows
// (paged_attention.cpp). PAGEDKV_AMX is defined where the build targets AMX-BF16.
#pragma once

#if defined(PAGEDKV_ISA_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDKV_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pk {

// Linux lends a process AMX's tile registers only once asked (any thread, once a process);
// $PAGEDKV_AMX=0 keeps the AVX-512 code (to time one against the other).
inline bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("PAGEDKV_AMX");
    if (env && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Every tile 16 rows of 64 bytes: float32 sums 16 x 16 (tmm0-3), bf16 operands 16 x 32 (tmm4-5)
// and 16 pairs x 16 columns (tmm6-7, AMX's VNNI layout). Loaded before each use: oneDNN, in the
// same threads, loads its own.
inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

}  // namespace pk
#endif
