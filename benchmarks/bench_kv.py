"""Micro-benchmark of the KV block manager: microseconds per operation (best of several repeats).

python benchmarks/bench_kv.py [--block-size 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable

from pagedkv.kv import BlockPool, KVCacheManager


def best_us(fn: Callable[[], int], repeats: int) -> float:
    """fn runs a loop and returns how many operations it did; best µs/op over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        n = fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


def pool_alloc_free(n: int = 200_000) -> Callable[[], int]:
    pool = BlockPool(1024)

    def run() -> int:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(n):
            free(get(1))
        return n

    return run


def request_alloc_free(bs: int, caching: bool, n: int = 100_000) -> Callable[[], int]:
    """Admit a one-block request (block not full, so no hashing) and free it."""
    m = KVCacheManager(1024, bs, enable_prefix_caching=caching, watermark=0.0)
    tokens = list(range(bs - 1))

    def run() -> int:
        alloc, free = m.allocate_slots, m.free
        for _ in range(n):
            alloc("r", tokens, bs - 1)
            free("r")
        return n

    return run


def append_token(bs: int, caching: bool, n: int = 8192) -> Callable[[], int]:
    """Decode: one token per call, a new block every bs tokens, hashing each full block if caching."""

    def run() -> int:
        m = KVCacheManager(n // bs + 2, bs, enable_prefix_caching=caching, watermark=0.0)
        tokens = list(range(n + 1))
        m.allocate_slots("r", tokens, 1)
        alloc = m.allocate_slots
        for _ in range(n):
            alloc("r", tokens, 1)
        return n

    return run


def prefix_lookup(bs: int, num_blocks: int = 1024) -> Callable[[], int]:
    """lookup_prefix over a fully cached prompt of num_blocks blocks: µs per block."""
    m = KVCacheManager(num_blocks + 1, bs, watermark=0.0)
    tokens = list(range(num_blocks * bs + 1))
    m.allocate_slots("r", tokens, len(tokens))
    m.free("r")
    assert len(m.lookup_prefix(tokens)) == num_blocks

    def run() -> int:
        m.lookup_prefix(tokens)
        return num_blocks

    return run


def prefix_admit(bs: int, num_blocks: int = 1024) -> Callable[[], int]:
    """lookup + admission re-using the whole cached prefix, then free: µs per block."""
    m = KVCacheManager(num_blocks + 2, bs, watermark=0.0)
    tokens = list(range(num_blocks * bs + 1))
    m.allocate_slots("r", tokens, len(tokens))
    m.free("r")

    def run() -> int:
        prefix = m.lookup_prefix(tokens)
        m.allocate_slots("r", tokens, len(tokens) - len(prefix) * bs, prefix_blocks=prefix)
        m.free("r")
        return num_blocks

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bs, r = args.block_size, args.repeats
    rows = [
        ("pool: get_new_blocks(1) + free_blocks", best_us(pool_alloc_free(), r)),
        ("manager: admit 1-block request + free", best_us(request_alloc_free(bs, True), r)),
        ("manager: append 1 token (prefix caching on)", best_us(append_token(bs, True), r)),
        ("manager: append 1 token (prefix caching off)", best_us(append_token(bs, False), r)),
        ("manager: lookup_prefix, per cached block", best_us(prefix_lookup(bs), r)),
        (
            "manager: lookup + admit with full prefix hit + free, per block",
            best_us(prefix_admit(bs), r),
        ),
    ]
    print(
        f"# pagedkv KV block manager, block size {bs}, Python {platform.python_version()} "
        f"({platform.machine()}), best of {r}"
    )
    width = max(len(name) for name, _ in rows)
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.3f} µs/op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
