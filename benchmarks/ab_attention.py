"""Two builds of the attention kernel timed against each other in one process, call by call.

Two runs of bench_attention.py one after the other compare two moments of a shared machine as
much as two builds: on the VMs of BENCHMARKS.md the same build moves by 15% from minute to
minute. Here this tree's build and another revision's take turns on the same batch in one process,
so both meet the same machine; the best of a few hundred calls each repeats to within ~1%, and
the same build against itself differs by 0.1% (session 43).

    python benchmarks/ab_attention.py --against REV [--resident] [--calls 400] [--dtypes ...]

REV (a commit or branch of this repository) is checked out into a temporary worktree and its
kernels built by a child process into the usual cache (PAGEDKV_CPU_ISA picks the variant for
both builds); it must share this tree's pagedkv_abi.h. The batch is bench_attention.py's (its
shape flags apply), streamed from memory over --layers caches, or with --resident every table
entry pointing at one of two blocks: K/V in cache, the kernel's arithmetic alone. Timed by the
wall clock, or with --cpu-time by the thread's CPU time (one thread: steadier still).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from attention_args import add_attention_args, parse_timed  # same folder
from bench_attention import Batch, Layer, add_batch_args, make_batch

from pagedkv import native, native_abi
from pagedkv.attention import kernel

REPO = Path(__file__).resolve().parent.parent
BUILD = "import pagedkv.native as n; lib = n.library(); print(lib.path if lib else '')"


def build_of(rev: str) -> Path:
    """The kernels of `rev`, built in its own worktree by a child process (into the usual cache:
    a second run finds them)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git = ["git", "-C", str(REPO), "worktree"]
        subprocess.run([*git, "add", "--quiet", "--detach", str(tree), rev], check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}  # (ahead of the installed pagedkv)
            done = subprocess.run(
                [sys.executable, "-c", BUILD], cwd=tree, env=env, capture_output=True, text=True
            )
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=True)
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode or not path:
        sys.exit(f"ab_attention.py: the kernels of {rev} did not build:\n{done.stderr[-2000:]}")
    return Path(path)


def call(lib: native.Library, batch: Batch, layer: Layer, tables: torch.Tensor) -> torch.Tensor:
    return kernel.attend(
        batch.q, layer.k, layer.v, None, batch.seq_lens, tables, batch.scale, lib=lib
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--against", required=True, help="the other build's git revision")
    p.add_argument("--resident", action="store_true", help="K/V in cache: the arithmetic alone")
    p.add_argument("--calls", type=int, default=400, help="calls of each build, taking turns")
    add_batch_args(p)
    add_attention_args(p, rounds=1, dtypes="float32,bfloat16")
    args, clock = parse_timed(p)
    commit = f"{args.against}^{{commit}}"
    known = ["git", "-C", str(REPO), "rev-parse", "-q", "--verify", commit]
    if subprocess.run(known, capture_output=True).returncode:
        p.error(f"--against {args.against}: not a commit of {REPO}")

    ours = native.library()
    assert ours is not None, "this tree's kernels did not build; see the warning above"
    try:
        theirs = native.Library(build_of(args.against), native.ABI)
    except native_abi.AbiMismatch as e:
        sys.exit(f"ab_attention.py: {args.against} has another kernel interface: {e}")
    builds = {"this tree": ours, args.against: theirs}
    print(
        f"ISA={ours.isa}, threads={torch.get_num_threads()}, "
        f"{'K/V in cache' if args.resident else f'K/V from memory over {args.layers} layers'}, "
        f"{args.calls} calls each{', timed by CPU time' if args.cpu_time else ''}"
    )
    print("| dtype | build | best (ms) | p10 | median | / this tree (best, median) |")
    print("|---|---|---:|---:|---:|---|")
    for name in args.dtypes.split(","):
        batch = make_batch(args, getattr(torch, name), torch.Generator().manual_seed(args.seed))
        tables = batch.block_tables % 2 if args.resident else batch.block_tables
        results = [call(lib, batch, batch.layers[0], tables).float() for lib in builds.values()]
        torch.testing.assert_close(results[1], results[0], atol=2e-2, rtol=2e-2)
        times: dict[str, list[float]] = {label: [] for label in builds}
        for i in range(args.calls):
            layer = batch.layers[i % len(batch.layers)]
            order = list(builds.items()) if i % 2 == 0 else list(builds.items())[::-1]
            for label, lib in order:
                start = clock()
                call(lib, batch, layer, tables)
                times[label].append((clock() - start) * 1e3)
        base = sorted(times["this tree"])
        for label, ts in times.items():
            ts.sort()
            best, p10, med = ts[0], ts[len(ts) // 10], statistics.median(ts)
            vs = f"{best / base[0]:.3f}, {med / statistics.median(base):.3f}"
            print(f"| {name} | {label} | {best:.3f} | {p10:.3f} | {med:.3f} | {vs} |")


if __name__ == "__main__":
    main()
