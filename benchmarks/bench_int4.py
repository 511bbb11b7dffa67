"""A decode step's 4-bit matmuls in aten's int4 layout (torch's kernel) and in our panels
(csrc/gemm.cpp's gemm_int4: AVX512_BF16, or AVX2 builds dequantizing into float32), by the
step's row count.

The default model's int4 shapes (or `--shapes NxK,...`: a mixture's experts, 1536x2048,2048x768
for Qwen3-30B-A3B's), `--layers` layers of distinct random codes (weights come from memory, as in
a step), group 32; the two layouts alternate within each round; best of `--rounds`. The last
column is the rate at which the panels' kernel reads the packed weights.

    python benchmarks/bench_int4.py [--rows 1,2,4,5,8,16,32] [--rounds 7] [--shapes NxK,...]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pagedkv.model import prepacked
from pagedkv.model.quant_linear import Blocks, pack_int4

HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960  # SmolLM2-135M
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def packed(blocks: list[Blocks], setting: str) -> list:
    os.environ[prepacked.ENV] = setting
    prepacked.form.cache_clear()
    prepacked.int4_form.cache_clear()
    return [pack_int4(b) for b in blocks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,2,4,5,8,16,32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", help="NxK,... (default: SmolLM2-135M's)")
    args = p.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    blocks = [
        Blocks(
            torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            torch.rand(n, k // 32, generator=gen) * 0.01,
            torch.rand(n, k // 32, generator=gen) * 0.01 - 0.005,
            32,
            4,
        )
        for _ in range(args.layers)
        for n, k in shapes
    ]
    forms = {"aten": packed(blocks, "onednn"), "panels": packed(blocks, "")}
    assert all(w.panels for w in forms["panels"]), "gemm_int4 unused here (no AVX512_BF16/AVX2)"
    print(f"threads={torch.get_num_threads()}, {args.layers} layers, best of {args.rounds}")
    print("| rows | aten int4 (ms) | panels (ms) | speed-up | panels GB/s |")
    print("|---:|---:|---:|---:|---:|")
    nbytes = sum(w.packed.nbytes + w.scales_zeros.nbytes for w in forms["panels"])
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in shapes}
        best = dict.fromkeys(forms, float("inf"))
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, weights in forms.items():
                start = time.perf_counter()
                for w in weights:
                    w.packed_mm(xs[w.shape[1]])
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
        a, b = best["aten"], best["panels"]
        print(f"| {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x | {nbytes / b / 1e9:.1f} |")


if __name__ == "__main__":
    main()
