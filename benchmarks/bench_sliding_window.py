"""Decode attention with and without a sliding window (the kernel reads only each query's window),
and with Gemma 2's soft-capped scores.

32 requests with contexts 1000..4000, 9 query heads, 3 KV heads, head dim 64, 16-token blocks
scattered through the pool, four layers' caches cycled so that K/V come from memory. Best of five
passes per (window, softcap), the pairs taking turns twice.

    python benchmarks/bench_sliding_window.py [--windows 0,2047,512] [--softcaps 0,50]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.attention import kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", default="0,2047,512", help="0: none")
    p.add_argument("--softcaps", default="0", help="0: none (Gemma 2: 50)")
    p.add_argument("--requests", type=int, default=32)
    args = p.parse_args()
    rules = [(int(w), float(c)) for w in args.windows.split(",") for c in args.softcaps.split(",")]
    gen = torch.Generator().manual_seed(0)
    bs, dim = 16, 64
    lens = torch.randint(1000, 4001, (args.requests,), generator=gen, dtype=torch.int32)
    blocks = (lens + bs - 1) // bs
    num_blocks = int(blocks.sum() * 1.25)
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(args.requests, int(blocks.max()), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks.tolist()):
        tables[b, :n] = pool[used : used + n]
        used += n
    print("| KV dtype | window | softcap | keys read | kernel (ms a layer) |")
    print("|---|---|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        shape = (num_blocks, 3, bs, dim)
        layers = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(4)]
        q = torch.randn(args.requests, 9, dim).to(dtype)
        best = dict.fromkeys(rules, float("inf"))
        for _ in range(2):
            for window, cap in rules:
                for _ in range(5):
                    t = time.perf_counter()
                    for k, v in layers:
                        kernel.paged_attention_decode(
                            q, k, v, lens, tables, 0.125, window=window, softcap=cap
                        )
                    took = (time.perf_counter() - t) / len(layers)
                    best[window, cap] = min(best[window, cap], took)
        for window, cap in rules:
            keys = int(lens.clamp(max=window).sum()) if window else int(lens.sum())
            name = str(dtype).removeprefix("torch.")
            ms = best[window, cap] * 1e3
            print(f"| {name} | {window or 'none'} | {cap or 'none'} | {keys} | {ms:.2f} |")


if __name__ == "__main__":
    main()
