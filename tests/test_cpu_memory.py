"""The KV pool asks Linux for 2 MiB pages (pagedkv/cpu_memory.py): the advice must reach the kernel
for the pool's memory, and the memory must still read as zeros."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedkv import cpu_memory
from pagedkv.kvstore.storage import KVStorage

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists(),
    reason="transparent huge pages are a Linux feature this kernel lacks",
)


def advised_bytes(t: torch.Tensor) -> int:
    """Bytes of t's storage inside mappings whose VmFlags carry `hg` (MADV_HUGEPAGE), read from
    /proc/self/smaps."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    total, lo, hi = 0, 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
        elif head == "VmFlags:" and " hg" in f" {line}":
            total += max(0, min(hi, end) - max(lo, start))
    return total


@linux_thp
def test_large_tensors_are_advised_and_small_ones_left_alone():
    big = cpu_memory.zeros(3, 5 << 20, dtype=torch.float32)  # 60 MiB
    assert big.shape == (3, 5 << 20) and big.dtype == torch.float32 and big.is_contiguous()
    assert not big.any()
    # every whole 2 MiB page of the storage is advised (the edges fall outside them)
    assert advised_bytes(big) >= big.nbytes - 2 * (2 << 20)

    small = torch.empty(1024)
    assert not cpu_memory.advise(small)


@linux_thp
def test_the_kv_pool_is_advised_and_zeroed():
    storage = KVStorage(4, 256, 3, 16, 64, torch.float32)  # 24 MiB
    assert not storage.data.any()
    assert advised_bytes(storage.data) >= storage.data.nbytes - 2 * (2 << 20)
    k, v = storage.layer(0)
    k[7, 1].fill_(1.0)
    assert storage.data[0, 0, 7, 1].eq(1.0).all() and not v.any()  # still views of one tensor


def test_large_tensors_start_on_a_huge_page_boundary():
    """The pool's 4 KiB runs must not straddle pages: a large tensor starts 2 MiB-aligned, whatever
    its dtype, is contiguous, holds exactly its elements and writes through; a small one is
    plain."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = cpu_memory.zeros(3000, 3, 16, 64, dtype=dtype)  # 9-36 MiB
        assert t.data_ptr() % (2 << 20) == 0 and t.is_contiguous() and t.dtype == dtype
        assert t.shape == (3000, 3, 16, 64) and t.nbytes == 3000 * 3 * 16 * 64 * dtype.itemsize
        assert not t.view(torch.uint8).any()
        t.view(torch.uint8)[-1, -1, -1, -1] = 1
        assert t.view(torch.uint8).sum() == 1
    storage = KVStorage(4, 256, 3, 16, 64, torch.bfloat16)
    assert storage.data.data_ptr() % (2 << 20) == 0
    assert all(k.data_ptr() % 4096 == 0 and v.data_ptr() % 4096 == 0 for k, v in storage.kv_caches)
    small = cpu_memory.empty(2, 3, dtype=torch.float32)
    assert small.storage_offset() == 0 and small.untyped_storage().nbytes() == 24


def test_only_cpu_tensors_are_advised():
    meta = torch.empty(3, 5 << 20, device="meta")  # large, but no memory of ours to advise
    assert not cpu_memory.advise(meta)
    t = cpu_memory.empty(2, 3, dtype=torch.bfloat16)
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16


def test_zeros_clears_every_chunk(monkeypatch):
    """zeros writes a chunk at a time (so a signal's handler need not wait for the whole pool):
    every element is cleared, the last, shorter chunk too, whatever the memory held."""
    monkeypatch.setattr(cpu_memory, "_ZERO_CHUNK", 1000)  # 250 float32s: 7 chunks, the last short
    monkeypatch.setattr(
        cpu_memory, "empty", lambda *shape, dtype: torch.full(shape, 7, dtype=dtype)
    )
    t = cpu_memory.zeros(3, 4, 130, dtype=torch.float32)
    assert t.shape == (3, 4, 130) and t.dtype == torch.float32 and not t.any()
    b = cpu_memory.zeros(5, 3, dtype=torch.bfloat16)
    assert b.shape == (5, 3) and not b.any()
