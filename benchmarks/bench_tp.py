"""What tensor parallelism's communication costs per step on this machine (gloo on CPU).

    python benchmarks/bench_tp.py [--world 2] [--tokens 1 64 512 2048] [--hidden 576 --layers 30]

Every layer all-reduces the o_proj and the down_proj outputs, [tokens, hidden] float32 each:
2 x layers all-reduces a step, plus one broadcast of the step's inputs. This times those on
`--world` local ranks and prints microseconds per all-reduce and milliseconds per step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEATS = 50


def _rank(
    rank: int, world: int, init: str, tokens: list[int], hidden: int, layers: int, out
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rows = []
    for n in tokens:
        t = torch.randn(n, hidden)
        for _ in range(5):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(t)
        per = (time.perf_counter() - start) / REPEATS
        rows.append((n, per * 1e6, per * 2 * layers * 1e3))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 2048])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_rank, args=(r, args.world, init, args.tokens, args.hidden, args.layers, out)
            )
            for r in range(args.world)
        ]
        for proc in procs:
            proc.start()
        rows = out.get()
        for proc in procs:
            proc.join()
    print(
        f"gloo all-reduce, {args.world} ranks, float32 [tokens, {args.hidden}], "
        f"{2 * args.layers} per step:"
    )
    print("| tokens in the step | us per all-reduce | ms per step |")
    print("|---:|---:|---:|")
    for n, us, ms in rows:
        print(f"| {n} | {us:.0f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
