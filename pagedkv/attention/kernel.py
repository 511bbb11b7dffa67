"""Paged attention through block tables with a C++ kernel, built on first use.

Decode attention decides this engine's speed on a CPU (see shared/bench/README.md): torch can only
gather the scattered blocks first, which costs 10-20x the memory bound. The kernel in
csrc/paged_attention.cpp reads the blocks in place instead. It is compiled once per machine with
``torch.utils.cpp_extension.load`` into ~/.cache/pagedkv/ext (keyed by a hash of the source, the
flags, torch's version and the CPU's features) and called through ctypes, which drops the GIL for
the call. When it cannot be built, one warning is logged and a plain torch path gives the same
results, only slower. ``PAGEDKV_ATTENTION_KERNEL=0`` chooses the torch path on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERR_LEN = 512

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False
build_seconds: float | None = None
"""Seconds this process spent compiling the kernel (None when it came from the cache or failed)."""


def available() -> bool:
    """True when the C++ kernel is compiled and loaded (building it now if needed)."""
    return _library() is not None


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (q: [B, Hq, D]) at position seq_lens[b] - 1; returns [B, Hq, D]."""
    return _attend(q, k_cache, v_cache, None, seq_lens, block_tables, scale, out)


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries q[query_start_loc[b]:query_start_loc[b+1]] of sequence b are its last tokens and
    attend causally to its seq_lens[b] keys in the cache (chunked prefill, speculative decode)."""
    return _attend(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or out.stride(1) != q.shape[2]:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with contiguous heads, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    lib = _library()
    code = _DTYPE_CODES.get(q.dtype)
    if lib is None or code is None:
        return _torch_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out)
    seq_lens = _int32(seq_lens)
    block_tables = _int32(block_tables)
    qsl = None if query_start_loc is None else _int32(query_start_loc)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    err = ctypes.create_string_buffer(_ERR_LEN)
    rc = lib.pagedkv_paged_attention(
        code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        None if qsl is None else qsl.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        q.shape[0], seq_lens.shape[0], block_tables.shape[1], num_blocks, q.shape[1], num_kv_heads,
        block_size, head_dim, q.stride(0), out.stride(0), float(scale), torch.get_num_threads(),
        err, _ERR_LEN,
    )
    if rc:
        raise ValueError(err.value.decode())
    return out


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Checks what the kernel cannot see for itself; it checks every index it reads."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and the caches [blocks, Hkv, block_size, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and seq_lens.is_cpu and block_tables.is_cpu):
        raise ValueError("paged attention here runs on CPU tensors only")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B] and block_tables [B, max_blocks], got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    if query_start_loc is not None and (query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1):
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


def _torch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The same attention in plain torch: gather each sequence's blocks, then SDPA (GQA)."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    lens = seq_lens.tolist()
    starts = list(range(len(lens) + 1)) if query_start_loc is None else query_start_loc.tolist()
    for b, ctx in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        if first == last:
            continue
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        v = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        qlen = last - first
        mask = None
        if qlen > 1:
            query_pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= query_pos
        o = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[first:last] = o.transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Building and loading


def _library() -> ctypes.CDLL | None:
    global _lib, _loaded
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            _lib = _open()
            _loaded = True
    return _lib


def _open() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDKV_ATTENTION_KERNEL", "1") == "0":
        logger.info("PAGEDKV_ATTENTION_KERNEL=0: paged attention runs on the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch path
        logger.warning("the C++ paged attention kernel could not be built (%s); using the slower "
                       "torch path", str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)
        return None
    fn = lib.pagedkv_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10
        + [ctypes.c_float, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    )
    return lib


def cache_dir() -> Path:
    """Where compiled kernels live: $PAGEDKV_EXT_DIR, else $XDG_CACHE_HOME/pagedkv/ext (~/.cache)."""
    if "PAGEDKV_EXT_DIR" in os.environ:
        return Path(os.environ["PAGEDKV_EXT_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "ext"


def _build_key() -> str:
    """Everything that changes the binary: the source, flags, torch, and (for -march=native) the CPU."""
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, _cpu_features())).encode())
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return os.uname().machine


def _build() -> Path:
    """Compiles the kernel unless a finished build for this key exists; safe across threads and
    processes (an exclusive flock around the build, a marker written only after success)."""
    global build_seconds
    name = f"pagedkv_paged_attention_{_build_key()}"
    build_dir = cache_dir() / name
    library, done = build_dir / f"{name}.so", build_dir / "built"
    if done.exists() and library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir / "build.lock"):
        if done.exists() and library.exists():
            return library
        # torch's own build lock is a plain file that a killed build leaves behind; holding the
        # flock means nobody else is building, so any such file is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        from torch.utils import cpp_extension

        start = time.perf_counter()
        # (load() appends to the flag lists it is given: hand it copies.)
        cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=list(_CFLAGS),
                           extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
        build_seconds = time.perf_counter() - start
        done.touch()
        logger.info("compiled the paged attention kernel in %.1f s into %s", build_seconds, build_dir)
    return library


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
