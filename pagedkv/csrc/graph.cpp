// A decode graph's replay (model/decode_graph.py): the kernel calls a forward made, recorded once
// with their parameter structs, run again in order in one call from Python. A decode step of the
// default model makes ~300 kernel calls; from Python each costs 10-55 us of interpreter and ctypes
// work around it (BENCHMARKS.md), here a function-pointer call.

#include <cstdio>
#include <cstring>

#include "pagedkv_abi.h"

namespace {
using Kernel = int (*)(const void* params, char* err, int err_len);
}

extern "C" int pagedkv_run_graph(const pagedkv_run_graph_params* p, char* err, int errlen) {
  const auto* kernels = static_cast<const Kernel*>(p->kernels);
  const auto* params = static_cast<const void* const*>(p->params);
  if (p->count < 0 || (p->count > 0 && (kernels == nullptr || params == nullptr))) {
    std::snprintf(err, size_t(errlen), "need count >= 0 and both arrays (count = %lld)",
                  static_cast<long long>(p->count));
    return 1;
  }
  for (int64_t i = 0; i < p->count; ++i) {
    const int status = kernels[i](params[i], err, errlen);
    if (status != 0) {  // the kernel's message, prefixed with where in the graph it stopped
      char message[512];
      std::snprintf(message, sizeof(message), "call %lld of %lld: %s", static_cast<long long>(i),
                    static_cast<long long>(p->count), err);
      std::snprintf(err, size_t(errlen), "%s", message);
      return status;
    }
  }
  return 0;
}
