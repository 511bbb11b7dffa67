"""The flags bench_attention.py and bench_cascade.py share: the attention shape, the dtypes,
and how each way is timed. Defaults are the W1/W2 shape of the default model (9 query heads,
3 KV heads, head dim 64, 16-token blocks)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def add_attention_args(p: argparse.ArgumentParser, *, rounds: int, dtypes: str) -> None:
    """Shape, repetition and timing flags; each script keeps its own rounds and dtypes."""
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=6, help="distinct layer caches cycled through")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--dtypes", default=dtypes)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time: steadier while other work shares the machine",
    )


def parse_timed(p: argparse.ArgumentParser) -> tuple[argparse.Namespace, Callable[[], float]]:
    """Parse, set torch's threads (one under --cpu-time) and pick the clock the flags ask for."""
    args = p.parse_args()
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, time.thread_time if args.cpu_time else time.perf_counter
