"""How the process uses CPU memory, through libc: malloc's reuse of freed memory, and large tensors
on 2 MiB pages.

Every CPU step allocates and frees tens of MB of activations per layer. By default glibc trims the
heap (or unmaps) on free, so the next step faults the same pages in again: on a 2048-token prefill
step that was 17% of the step (W1's prefill: 7.5 -> 6.2 s); `keep_freed_memory` stops that.

Decode reads the KV pool in runs of one block and head (4 KiB of float32 with 16-token blocks)
scattered through it. On 4 KiB pages nearly every such run costs a TLB miss and a page walk (two
levels of them in a VM); on 2 MiB pages the second-level TLB covers gigabytes. Measured on this
2-core EPYC VM (BENCHMARKS.md "Huge pages for the KV pool"): the decode kernel 4-8% faster, a
plain read of 1 GiB 1.0-1.25x. The matmul weights gained nothing measurable, so they stay put.
Debian's kernel gives anonymous memory huge pages only where asked (THP "madvise"), and only at the
first touch: hence `empty` advises before anything is written. Elsewhere (THP off, not Linux) the
advice is refused and the tensor keeps small pages; nothing else changes.

A large tensor also starts on a 2 MiB boundary. glibc puts a large allocation 64 bytes into its
mapping, so each 4 KiB run of the pool straddled two 4 KiB pages, which the hardware prefetcher
does not cross, and the pool's first huge page was lost to small ones. Aligned, the decode kernel
ran 1.08x faster on the AVX2 EPYC VM (BENCHMARKS.md, session 34). The few unused bytes before the
boundary are never touched, so they take no memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_MIN_BYTES = 4 * _HUGE  # smaller tensors gain nothing worth a call
_ZERO_CHUNK = 64 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tells glibc's malloc to keep freed memory for reuse instead of returning it to the system
    (see the module docstring). True when it took effect."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30) and mallopt(_M_MMAP_THRESHOLD, 32 << 20))


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux"):  # (MADV_HUGEPAGE's value is Linux's)
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise(t: Tensor) -> bool:
    """Asks for huge pages under the whole 2 MiB pages of t's storage; True when granted. Pages
    already touched keep their size until the kernel's khugepaged merges them."""
    nbytes = t.untyped_storage().nbytes()
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or nbytes < _MIN_BYTES:
        return False
    start = t.untyped_storage().data_ptr()
    first = -(-start // _HUGE) * _HUGE
    end = (start + nbytes) // _HUGE * _HUGE
    return end > first and fn(first, end - first, _MADV_HUGEPAGE) == 0


def empty(*shape: int, dtype: torch.dtype) -> Tensor:
    """torch.empty on the CPU; a large one starts on a 2 MiB boundary, on huge pages where granted
    (see the module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MIN_BYTES:
        return torch.empty(*shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HUGE
    t = raw[skip : skip + nbytes].view(dtype).view(shape)
    advise(t)
    return t


def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
    """`empty`, zeroed 64 MiB at a time: a signal's Python handler waits for the call it arrives
    in, and zeroing a 4 GiB pool in one call took 14 s with three tensor-parallel ranks on two
    cores (a SIGTERM then outlived a supervisor's 10 s grace: SIGKILL, the rendezvous folder left).
    Measured no slower than one call."""
    t = empty(*shape, dtype=dtype)
    for part in t.view(-1).split(max(1, _ZERO_CHUNK // t.element_size())):
        part.zero_()
    return t
