#!/bin/bash
# Issue 13 item 5 on an AVX-512 machine standing in for an AVX2-only one: both engines held to
# AVX2. torch, oneDNN and MKL capped; pagedkv's kernels built for AVX2 (PAGEDKV_CPU_ISA); vLLM
# told by sitecustomize.py (this folder) that torch sees no AVX-512, so it loads its own _C_AVX2.
# Default model; vLLM in float32 (its best on AVX2 for W1 and W2) and bfloat16 (best for W3).
#   bash benchmarks/avx2_only/rounds.sh OUT_DIR [ROUNDS]     (from the repository root)
OUT=${1:?output folder}; ROUNDS=${2:-2}; HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
CAP="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
VL="VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4
    VLLM_CACHE_ROOT=/tmp/peers/cache/vllm-avx2 TORCHINDUCTOR_CACHE_DIR=/tmp/peers/cache/inductor-avx2
    FAKE_AVX2=1 PYTHONPATH=$HERE PEERS_RESULTS=$OUT"
VLLM="/tmp/peers/venvs/vllm/bin/python ../shared/bench/peers/run_vllm.py --prefix-caching"
for r in $(seq "$ROUNDS"); do
  env $CAP PAGEDKV_CPU_ISA=avx2 pagedkv bench --workloads W3,W1,W2 --kv-cache-memory 1GiB \
    --no-progress > "$OUT/pagedkv_$r.txt" 2>&1
  env $CAP $VL $VLLM --dtype float32 --workloads W3,W2,W1 --tag avx2_fp32_r$r > "$OUT/vllm_fp32_$r.log" 2>&1
  env $CAP $VL $VLLM --dtype bfloat16 --workloads W3,W2 --tag avx2_bf16_r$r > "$OUT/vllm_bf16_$r.log" 2>&1
  grep -h "tok/s" "$OUT/pagedkv_$r.txt" | head -3
  grep -h "^{'workload" "$OUT"/vllm_*_$r.log | cut -c1-120
done
