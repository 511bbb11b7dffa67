"""Cascade against plain decode attention when sequences share leading blocks (W2-like).

`--batch` sequences in groups of `--group` share a `--shared-prefix`-token prefix (whole blocks:
the same block ids at the start of their tables), each followed by its own suffix of
`--min-suffix`..`--max-suffix` tokens in blocks scattered through the pool, of which the last
`--queries` attend (1: a decode step; 4: a token and three drafts; 38: W2's prompt chunks after its
cached prefix). The default is W2 of
shared/bench/README.md on the default model: 64 requests, one 384-token prefix, 9 query heads,
3 KV heads, head dim 64, 16-token blocks. Each way cycles through several layers' caches so
that K/V come from memory; medians of `--rounds`, the ways taking turns within each round.

    python benchmarks/bench_cascade.py [--batch 64 --group 64 --shared-prefix 384] [--queries 4]
    python benchmarks/bench_cascade.py --sweep --cpu-time      # the grid behind cascade.pays()
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from attention_args import add_attention_args, parse_timed  # same folder

from pagedkv import native
from pagedkv.attention import cascade, kernel


def make_case(
    args: argparse.Namespace, group: int, prefix: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple]]:
    """q, seq_lens, block_tables and per-layer (k, v) caches for one shape."""
    bs = args.block_size
    pre_blocks = prefix // bs
    suffix = torch.randint(
        args.min_suffix, args.max_suffix + 1, (args.batch,), generator=gen
    ).tolist()
    lens = [pre_blocks * bs + n for n in suffix]
    groups = -(-args.batch // group)
    total = groups * pre_blocks + sum(-(-n // bs) for n in suffix)
    pool = torch.randperm(int(total * 1.25) + 1, generator=gen).to(torch.int32)
    tables = torch.zeros(args.batch, max(-(-n // bs) for n in lens), dtype=torch.int32)
    shared = [pool[g * pre_blocks : (g + 1) * pre_blocks] for g in range(groups)]
    used = groups * pre_blocks
    for b, n in enumerate(suffix):
        tables[b, :pre_blocks] = shared[b // group]
        own = -(-n // bs)
        tables[b, pre_blocks : pre_blocks + own] = pool[used : used + own]
        used += own
    shape = (pool.numel(), args.kv_heads, bs, args.head_dim)
    layers = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(args.layers)
    ]
    q = torch.randn(args.batch * args.queries, args.q_heads, args.head_dim, generator=gen)
    return q.to(dtype), torch.tensor(lens, dtype=torch.int32), tables, layers


def measure(
    args: argparse.Namespace,
    group: int,
    prefix: int,
    dtype: torch.dtype,
    clock: Callable[[], float],
) -> tuple[float, ...]:
    """Median ms per layer of the plain kernel and of the cascade, and of planning the cascade
    (once per step for all layers in the engine)."""
    q, seq_lens, tables, layers = make_case(
        args, group, prefix, dtype, torch.Generator().manual_seed(args.seed)
    )
    lens = seq_lens.tolist()
    scale = args.head_dim**-0.5
    qlens = [args.queries] * args.batch
    qsl = torch.arange(0, args.batch * args.queries + 1, args.queries, dtype=torch.int32)

    def attend(k: torch.Tensor, v: torch.Tensor, plan=None) -> torch.Tensor:
        if args.queries == 1:
            return kernel.paged_attention_decode(q, k, v, seq_lens, tables, scale, cascade=plan)
        return kernel.paged_attention_varlen(q, k, v, qsl, seq_lens, tables, scale, cascade=plan)

    def plain(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(k, v)

    plan = cascade.plan(tables, lens, args.block_size, forced=True, query_lens=qlens)

    def cascaded(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(k, v, plan)

    torch.testing.assert_close(
        cascaded(*layers[0]).float(), plain(*layers[0]).float(), atol=2e-2, rtol=2e-2
    )
    times: dict[str, list[float]] = {"plain": [], "cascade": [], "plan": []}
    for _ in range(args.rounds):
        start = clock()
        cascade.plan(tables, lens, args.block_size, forced=True, query_lens=qlens)
        times["plan"].append((clock() - start) * 1e3)
        for name, fn in (("plain", plain), ("cascade", cascaded)):
            start = clock()
            for k, v in layers:
                fn(k, v)
            times[name].append((clock() - start) * 1e3 / len(layers))
    return tuple(statistics.median(times[name]) for name in ("plain", "cascade", "plan"))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--group", type=int, default=64, help="sequences sharing one prefix")
    p.add_argument(
        "--shared-prefix", type=int, default=384, help="tokens (rounded down to whole blocks)"
    )
    p.add_argument("--min-suffix", type=int, default=16)
    p.add_argument("--max-suffix", type=int, default=128)
    p.add_argument("--queries", type=int, default=1, help="query tokens a sequence (its last)")
    add_attention_args(p, rounds=7, dtypes="bfloat16,float32")
    p.add_argument("--sweep", action="store_true", help="group sizes x prefix lengths")
    args, clock = parse_timed(p)
    if not 1 <= args.queries <= args.min_suffix:
        p.error("--queries must be between 1 and --min-suffix (the queries follow the prefix)")
    assert kernel.available(), "the C++ kernel did not build"
    print(
        f"ISA={native.selected_isa()} threads={torch.get_num_threads()} batch={args.batch} "
        f"suffix {args.min_suffix}..{args.max_suffix} queries {args.queries}"
        f"{' (CPU time)' if args.cpu_time else ''}"
    )
    shapes = (
        [(g, n) for g in (2, 4, 8, 64) for n in (32, 64, 128, 384)]
        if args.sweep
        else [(args.group, args.shared_prefix)]
    )
    print(
        "| dtype | group | shared prefix (tokens) | plain (ms) | cascade (ms) | plain / cascade "
        "| plan, per step (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        for group, prefix in shapes:
            plain, casc, planning = measure(args, group, prefix, getattr(torch, name), clock)
            print(
                f"| {name} | {group} | {prefix} | {plain:.3f} | {casc:.3f} | {plain / casc:.2f}x "
                f"| {planning:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
