"""The C++ kernels, compiled on first use and loaded through ctypes.

csrc/ holds paged attention (paged_attention.cpp), the fused ops around a
decoder layer's matmuls (layer_ops.cpp) and quantized KV writes (kv_quant.cpp).
They build into one library, once per machine and vector ISA, with
``torch.utils.cpp_extension.load`` into ~/.cache/pagedkv/ext (keyed by the ISA
and a hash of the sources, the flags, torch's version and the CPU's features).
ctypes drops the GIL for each call. When the library cannot be built, one
warning is logged and every caller takes its plain torch path (same results,
slower). ``PAGEDKV_KERNELS=0`` chooses the torch paths on purpose.

The kernels are written once against csrc/vec.h, whose backends are AVX-512,
AVX2 (+FMA, F16C), AArch64 NEON and a portable one. The best this CPU runs is
built with -march=native; ``PAGEDKV_CPU_ISA=avx512|avx2|neon|portable`` forces
one (a lower one is built for that ISA's baseline, so an AVX-512 machine can
test and time the AVX2 code). ``variant(isa)`` loads any runnable one beside
the default, for tests.
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

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "layer_ops.cpp", _CSRC / "kv_quant.cpp")
_HEADERS = tuple(sorted(_CSRC.glob("vec*.h")))
_CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
ISAS = ("avx512", "avx2", "neon", "portable")
# -march for an ISA built below the best this CPU runs (the best one gets -march=native)
_MARCH = {"avx2": ("-march=x86-64-v3",), "portable": ()}
# /proc/cpuinfo flags each x86 ISA needs
_X86_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma", "f16c"}}
_LDFLAGS = ("-fopenmp",)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUANT_CODES = {torch.int8: 3, torch.float8_e4m3fn: 4}  # quantized KV caches (scales beside them)
ERR_LEN = 512

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name -> argument types; every function returns an int status (0 = done)
_SIGNATURES = {
    "pagedkv_paged_attention": [_INT, _INT, _P, _P]
    + [_P] * 7
    + [_I64] * 10
    + [_F32, _INT, ctypes.c_char_p, _INT],
    "pagedkv_cascade_attention": (
        [_INT, _INT, _P, _P]
        + [_P] * 7
        + [_I64] * 10
        + [_F32, _P, _P, _P, _I64, _INT]
        + [ctypes.c_char_p, _INT]
    ),
    "pagedkv_rms_norm": [_INT, _P, _I64, _P, _P, _P, _I64, _I64, _F32, _INT],
    "pagedkv_silu_mul": [_INT, _P, _I64, _P, _I64, _I64, _INT],
    "pagedkv_rope_cache": (
        [_INT, _P]
        + [_I64] * 5
        + [_P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _INT]
        + [ctypes.c_char_p, _INT]
    ),
    "pagedkv_quant_write": [_INT, _P]
    + [_I64] * 3
    + [_P, _P, _P, _I64, _I64, ctypes.c_char_p, _INT],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False
_variants: dict[str, ctypes.CDLL] = {}
build_seconds: float | None = None
"""Seconds this process spent compiling the library (None when it came from the cache or failed)."""


_errors = threading.local()


def error_buffer() -> ctypes.Array:
    """This thread's buffer for a kernel's error message (ERR_LEN bytes, reused across calls)."""
    buf = getattr(_errors, "buf", None)
    if buf is None:
        buf = _errors.buf = ctypes.create_string_buffer(ERR_LEN)
    return buf


def available() -> bool:
    """True when the library is compiled and loaded (building it now if needed)."""
    return library() is not None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when it cannot be built (the torch paths serve then)."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            _lib = _open()
            _loaded = True
    return _lib


def _open() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDKV_KERNELS", "1") == "0":
        logger.info(
            "PAGEDKV_KERNELS=0: the C++ kernels are off; everything runs on the torch paths"
        )
        return None
    try:
        return _load(_build())
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch paths
        logger.warning(
            "the C++ kernels could not be built (%s); using the slower torch path",
            str(exc).strip().splitlines()[-1] if str(exc).strip() else exc,
        )
        return None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    lib.pagedkv_isa.restype, lib.pagedkv_isa.argtypes = ctypes.c_char_p, []
    return lib


def variant(isa: str) -> ctypes.CDLL:
    """The library built for `isa` (one of runnable_isas()), loaded beside the default one; raises
    when it cannot be built. Each ISA has its own file, so several live in one process."""
    with _lock:
        if isa not in _variants:
            _variants[isa] = _load(_build(isa))
        return _variants[isa]


def runnable_isas() -> list[str]:
    """The vector ISAs this CPU executes, best first (portable always last)."""
    machine = os.uname().machine
    if machine in ("aarch64", "arm64"):
        return ["neon", "portable"]
    flags = set(_cpu_features().split())
    return [isa for isa, need in _X86_FLAGS.items() if need <= flags] + ["portable"]


def selected_isa() -> str:
    """$PAGEDKV_CPU_ISA when set (checked), else the best ISA this CPU runs."""
    runnable = runnable_isas()
    isa = os.environ.get("PAGEDKV_CPU_ISA", "").strip().lower() or runnable[0]
    if isa not in ISAS:
        raise ValueError(f"PAGEDKV_CPU_ISA={isa!r} is not one of {', '.join(ISAS)}")
    if isa not in runnable:
        raise ValueError(f"PAGEDKV_CPU_ISA={isa}: this CPU runs only {', '.join(runnable)}")
    return isa


def isa_cflags(isa: str) -> tuple[str, ...]:
    """Compiler flags for one ISA's build: the best one for this very CPU, a lower one for that
    ISA's baseline; the define picks vec.h's backend."""
    march = ("-march=native",) if isa == runnable_isas()[0] else _MARCH.get(isa, ("-march=native",))
    return _CFLAGS + march + (f"-DPAGEDKV_ISA_{isa.upper()}",)


def cache_dir() -> Path:
    """Where compiled kernels live: $PAGEDKV_EXT_DIR, else $XDG_CACHE_HOME/pagedkv/ext (~/.cache)."""
    if "PAGEDKV_EXT_DIR" in os.environ:
        return Path(os.environ["PAGEDKV_EXT_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "ext"


def _build_key(cflags: tuple[str, ...] | None = None) -> str:
    """Everything that changes the binary: the sources, flags (default: the selected ISA's), torch,
    and (for -march=native) the CPU."""
    cflags = cflags if cflags is not None else isa_cflags(selected_isa())
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    digest.update(repr((cflags, _LDFLAGS, torch.__version__, _cpu_features())).encode())
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return os.uname().machine


def _build(isa: str | None = None) -> Path:
    """Compiles the kernels for `isa` (default: selected_isa()) unless a finished build for this
    key exists; safe across threads and processes (an exclusive flock around the build, a marker
    written only after success)."""
    global build_seconds
    isa = isa or selected_isa()
    cflags = isa_cflags(isa)
    name = f"pagedkv_kernels_{isa}_{_build_key(cflags)}"
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
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=list(cflags),
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        build_seconds = time.perf_counter() - start
        done.touch()
        logger.info(
            "compiled the C++ kernels (%s) in %.1f s into %s", isa, build_seconds, build_dir
        )
    return library


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
