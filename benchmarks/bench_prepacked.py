"""A decode step's matmuls with plain weights (F.linear) and with weights prepacked once in each
form this CPU runs (pagedkv/model/prepacked.py; bfloat16: oneDNN's layout, our GEMM's "pairs";
float32: our GEMM's "panels"), by the step's row count.

The default model's shapes: `--layers` layers of distinct q/k/v, o, gate/up and down weights plus
the lm_head, each multiplied once per pass as in a real step (weights come from memory, not from
a cache that repeated calls on one matrix would keep warm). The forms alternate within each
round; best of `--rounds`.

    python benchmarks/bench_prepacked.py [--dtype float32] [--rows 1,8,64,256,1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedkv.model.prepacked import PrepackedWeight, _probe

HIDDEN, INTERMEDIATE, QKV, VOCAB = 576, 1536, 960, 49152  # SmolLM2-135M


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,64,256,1024")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    forms = ("panels",) if dtype == torch.float32 else ("onednn", "pairs")
    kinds = [k for k in forms if _probe(k)]
    assert kinds, f"no prepacked form of {args.dtype} runs on this CPU"
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    plain = [torch.randn(s, generator=gen).to(dtype) for _ in range(args.layers) for s in shapes]
    plain.append(torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype))
    packed = {k: [PrepackedWeight.of(w, k) for w in plain] for k in kinds}
    print(
        f"{args.dtype}, threads={torch.get_num_threads()}, {args.layers} layers + lm_head, "
        f"best of {args.rounds}"
    )
    print(
        "| rows | F.linear (ms) | " + " | ".join(f"{k} (ms)" for k in kinds) + " | best GFLOP/s |"
    )
    print("|---:|---:|" + "---:|" * len(kinds) + "---:|")
    flops_per_row = 2 * sum(w.numel() for w in plain)
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
        ways = {"plain": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in plain]}
        for k in kinds:
            ways[k] = lambda ws=packed[k], xs=xs: [w.mm(xs[w.shape[1]]) for w in ws]
        best = dict.fromkeys(ways, float("inf"))
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, run in ways.items():
                start = time.perf_counter()
                run()
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
        cells = " | ".join(f"{best[k] * 1e3:.2f}" for k in ways)
        print(f"| {rows} | {cells} | {flops_per_row * rows / min(best.values()) / 1e9:.0f} |")


if __name__ == "__main__":
    main()
