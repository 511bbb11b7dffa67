"""The C++ kernels, compiled on first use and loaded through ctypes.

csrc/ holds paged attention (paged_attention.cpp), the fused ops around a
decoder layer's matmuls (layer_ops.cpp) and quantized KV writes (kv_quant.cpp).
Their interface is csrc/pagedkv_abi.h alone: one parameter struct per kernel and
a dtype enum, which native_abi.py reads to build the ctypes side, checked against
the compiled layout whenever a library is loaded. Callers fill a kernel's struct
by field name, ``library().call("rms_norm", dtype=..., x=..., ...)``, and a
nonzero status raises KernelError with the kernel's message.

They build into one library, once per machine and vector ISA, with
``torch.utils.cpp_extension.load`` into ~/.cache/pagedkv/ext (keyed by the ISA
and a hash of the sources, the flags, torch's version and the CPU's features).
ctypes drops the GIL for each call. When the library cannot be built or does not
match the header, one warning is logged and every caller takes its plain torch
path (same results, slower). ``PAGEDKV_KERNELS=0`` chooses the torch paths on
purpose.

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

from pagedkv import native_abi

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    _CSRC / f"{name}.cpp"
    for name in ("paged_attention", "layer_ops", "kv_quant", "gemm", "argmax", "graph")
)
# everything else the binary depends on: the headers, and the generator of its layout table
_INPUTS = (*sorted(_CSRC.glob("*.h")), Path(native_abi.__file__))
_CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
ISAS = ("avx512", "avx2", "neon", "portable")
# -march for an ISA built below the best this CPU runs (the best one gets -march=native)
_MARCH = {"avx2": ("-march=x86-64-v3",), "portable": ()}
# /proc/cpuinfo flags each x86 ISA needs
_X86_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma", "f16c"}}
_LDFLAGS = ("-fopenmp",)
ERR_LEN = 512

ABI = native_abi.parse(native_abi.HEADER.read_text())
# torch dtype -> pagedkv_dtype code (PAGEDKV_DTYPE_<NAME> is torch.<name>)
DTYPES: dict[torch.dtype, int] = {
    getattr(torch, name.removeprefix("PAGEDKV_DTYPE_").lower()): code
    for name, code in ABI.enums["pagedkv_dtype"].items()
}
# what activations, queries and float caches may be; the one-byte types are quantized caches
FLOAT_DTYPES = frozenset(d for d in DTYPES if d.itemsize > 1)
QUANT_DTYPES = frozenset(DTYPES) - FLOAT_DTYPES


class KernelError(ValueError):
    """A kernel refused its arguments (nonzero status); the message is the kernel's."""


class Library:
    """One build of the kernels, loaded and checked against pagedkv_abi.h (AbiMismatch if not)."""

    def __init__(self, path: Path, abi: native_abi.Abi) -> None:
        self.path = path
        dll = ctypes.CDLL(str(path))
        native_abi.verify(abi, dll)
        for name in abi.functions:
            fn = getattr(dll, name)
            fn.restype, fn.argtypes = abi.signature(name)
        # kernel -> (function, its parameter struct, the struct's field names)
        self._kernels = {
            kernel: (
                getattr(dll, f"pagedkv_{kernel}"),
                abi.structures[s],
                tuple(f for f, _ in abi.structs[s]),
            )
            for kernel, s in abi.kernels().items()
        }
        # where a recording goes (record()): the recording thread and its list; None: nowhere
        self._recording: tuple[int, list[tuple[str, ctypes.Structure]]] | None = None
        self.isa: str = dll.pagedkv_isa().decode()
        self.vector_width: int = dll.pagedkv_vector_width()
        self.bf16_gemm: bool = bool(dll.pagedkv_bf16_gemm())
        self.amx: bool = bool(dll.pagedkv_amx())  # gemm_bf16 uses AMX tiles from 8 rows on

    def call(self, kernel: str, **fields: object) -> None:
        """Runs `kernel` with its parameter struct filled from `fields`, every one named; raises
        KernelError with the kernel's message when it refuses."""
        self.run(kernel, self.params(kernel, **fields))

    def params(self, kernel: str, **fields: object) -> ctypes.Structure:
        """`kernel`'s parameter struct filled from `fields`, every one named: kept by a caller
        that runs the kernel often with a few fields changed (ctypes costs ~1.5 us a call less)."""
        _, struct, names = self._kernels[kernel]
        params = struct(**fields)  # an unknown name raises AttributeError
        if len(fields) != len(names):
            missing = [f for f in names if f not in fields]
            raise TypeError(f"{kernel}: fields not given: {', '.join(missing)}")
        return params

    def run(self, kernel: str, params: ctypes.Structure) -> None:
        """Runs `kernel` on a filled parameter struct (params); KernelError when it refuses."""
        err = error_buffer()
        status = self._kernels[kernel][0](ctypes.byref(params), err, ERR_LEN)
        if status:
            message = err.value.decode(errors="replace") or f"failed with status {status}"
            err[0] = b"\0"  # (cleared after a failure, so a message is never a stale one)
            raise KernelError(f"{kernel}: {message}")
        recording = self._recording
        if recording is not None and recording[0] == threading.get_ident():
            recording[1].append((kernel, type(params).from_buffer_copy(params)))

    @contextlib.contextmanager
    def record(self) -> Iterator[list[tuple[str, ctypes.Structure]]]:
        """Meanwhile every kernel this thread runs is also recorded, as (kernel, a copy of its
        parameter struct), for a KernelGraph to run again. One recording at a time."""
        if self._recording is not None:
            raise RuntimeError("a recording of kernel calls is already under way")
        calls: list[tuple[str, ctypes.Structure]] = []
        self._recording = (threading.get_ident(), calls)
        try:
            yield calls
        finally:
            self._recording = None

    def graph(self, calls: list[tuple[str, ctypes.Structure]]) -> KernelGraph:
        return KernelGraph(self, calls)

    def address(self, kernel: str) -> int | None:
        """The kernel's function address (for graph.cpp to call)."""
        return ctypes.cast(self._kernels[kernel][0], ctypes.c_void_p).value


class KernelGraph:
    """Recorded kernel calls (Library.record), run again in order by one C++ call (graph.cpp)
    with the same parameter structs, which the owner may change between runs (`structs`)."""

    def __init__(self, lib: Library, calls: list[tuple[str, ctypes.Structure]]) -> None:
        self.lib = lib
        self.calls = calls
        n = len(calls)
        self._functions = (ctypes.c_void_p * n)(*(lib.address(k) for k, _ in calls))
        self._params = (ctypes.c_void_p * n)(*(ctypes.addressof(p) for _, p in calls))
        self._run = lib.params(
            "run_graph",
            kernels=ctypes.addressof(self._functions),
            params=ctypes.addressof(self._params),
            count=n,
        )

    def structs(self, kernel: str) -> list[ctypes.Structure]:
        """The parameter structs of every recorded call of `kernel`, in order."""
        return [p for k, p in self.calls if k == kernel]

    def run(self) -> None:
        self.lib.run("run_graph", self._run)


_lock = threading.Lock()
_lib: Library | None = None
_loaded = False
_variants: dict[str, Library] = {}
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


def library() -> Library | None:
    """The loaded library, or None when it cannot be built (the torch paths serve then)."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _lock:
        if not _loaded:
            _lib = _open()
            _loaded = True
    return _lib


def library_for(*tensors: torch.Tensor) -> Library | None:
    """The library, when it serves these tensors as the layer ops and the store take them: CPU
    tensors of one float dtype, rows of unit stride."""
    dtype = tensors[0].dtype
    if dtype not in FLOAT_DTYPES:
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    return library()


def output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Where a kernel writes its result: `out`, a buffer the caller reuses, when it is a
    contiguous CPU tensor of this shape and dtype, else a new tensor."""
    if out is not None and out.shape == shape and out.dtype == dtype and out.is_contiguous():
        return out
    return torch.empty(shape, dtype=dtype)


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a pointer field (null for None)."""
    return None if t is None else t.data_ptr()


def kernels_wanted() -> bool:
    """$PAGEDKV_KERNELS (1, the default, or 0), checked."""
    value = os.environ.get("PAGEDKV_KERNELS", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"PAGEDKV_KERNELS={value!r} is not one of 0, 1")
    return value == "1"


def _open() -> Library | None:
    if not kernels_wanted():
        logger.info(
            "PAGEDKV_KERNELS=0: the C++ kernels are off; everything runs on the torch paths"
        )
        return None
    try:
        path = _build()
    except Exception as exc:  # noqa: BLE001 - any failure to build means the torch paths
        logger.warning(
            "the C++ kernels could not be built (%s); using the slower torch path",
            str(exc).strip().splitlines()[-1] if str(exc).strip() else exc,
        )
        return None
    try:
        return Library(path, ABI)
    except (OSError, AttributeError, native_abi.AbiMismatch) as exc:
        logger.warning("%s; using the slower torch path", exc)
        return None


def variant(isa: str) -> Library:
    """The library built for `isa` (one of runnable_isas()), loaded beside the default one; raises
    when it cannot be built. Each ISA has its own file, so several live in one process."""
    with _lock:
        if isa not in _variants:
            _variants[isa] = Library(_build(isa), ABI)
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
    """Where compiled kernels live: $PAGEDKV_EXT_DIR, else $XDG_CACHE_HOME/pagedkv/ext
    (~/.cache)."""
    if "PAGEDKV_EXT_DIR" in os.environ:
        return Path(os.environ["PAGEDKV_EXT_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "ext"


def _build_key(cflags: tuple[str, ...] | None = None) -> str:
    """Everything that changes the binary: the sources, flags (default: the selected ISA's), torch,
    and (for -march=native) the CPU."""
    cflags = cflags if cflags is not None else isa_cflags(selected_isa())
    digest = hashlib.sha256()
    for path in SOURCES + _INPUTS:
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
        layout = build_dir / "pagedkv_abi_layout.cpp"  # the compiler's view of the header
        layout.write_text(ABI.layout_source())
        # (load() appends to the flag lists it is given: hand it copies.)
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in (*SOURCES, layout)],
            extra_cflags=list(cflags),
            extra_include_paths=[str(_CSRC)],
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
