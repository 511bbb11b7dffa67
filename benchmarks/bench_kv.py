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
    hashes = m.block_hashes(list(range(bs - 1)))

    def run() -> int:
        alloc, free = m.allocate_slots, m.free
        for _ in range(n):
            alloc("r", hashes, bs - 1)
            free("r")
        return n

    return run


def append_token(bs: int, caching: bool, n: int = 8192) -> Callable[[], int]:
    """Decode: one token per call, a new block every bs tokens, hashing each full block if caching
    (the sequence's BlockHashes.update as the token arrives, then the manager's append)."""

    def run() -> int:
        m = KVCacheManager(n // bs + 2, bs, enable_prefix_caching=caching, watermark=0.0)
        tokens = list(range(n + 1))
        hashes = m.block_hashes(tokens, 1)
        m.allocate_slots("r", hashes, 1)
        alloc, update = m.allocate_slots, hashes.update
        for i in range(2, n + 2):
            update(tokens, i)
            alloc("r", hashes, 1)
        return n

    return run


def prefix_lookup(bs: int, num_blocks: int = 1024) -> Callable[[], int]:
    """lookup_prefix over a fully cached prompt of num_blocks blocks, hashed once before (a request
    waiting at the head of the queue looks up again every step): µs per block."""
    m = KVCacheManager(num_blocks + 1, bs, watermark=0.0)
    hashes = m.block_hashes(list(range(num_blocks * bs + 1)))
    m.allocate_slots("r", hashes, hashes.num_tokens)
    m.free("r")
    assert len(m.lookup_prefix(hashes).block_ids) == num_blocks

    def run() -> int:
        m.lookup_prefix(hashes)
        return num_blocks

    return run


def prefix_admit(bs: int, num_blocks: int = 1024) -> Callable[[], int]:
    """A new request: hash its prompt, lookup + admission re-using the whole cached prefix, then
    free: µs per block."""
    m = KVCacheManager(num_blocks + 2, bs, watermark=0.0)
    tokens = list(range(num_blocks * bs + 1))
    m.allocate_slots("r", m.block_hashes(tokens), len(tokens))
    m.free("r")

    def run() -> int:
        hashes = m.block_hashes(tokens)
        prefix = m.lookup_prefix(hashes)
        m.allocate_slots("r", hashes, len(tokens) - prefix.num_blocks * bs, prefix=prefix)
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
        ("manager: lookup_prefix (hashed before), per cached block", best_us(prefix_lookup(bs), r)),
        (
            "manager: hash + lookup + admit with full prefix hit + free, per block",
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
