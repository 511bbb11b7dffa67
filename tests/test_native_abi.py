"""csrc/pagedkv_abi.h as the one source of the native interface: the parser, the layout check a
library passes at load (and one whose layout differs is refused), and kernel statuses raised."""

from __future__ import annotations

import ctypes
import logging
import re

import pytest
import torch

from pagedkv import native, native_abi
from pagedkv.model import ops

HEADER = native_abi.HEADER.read_text()


def altered(old: str, new: str) -> str:
    assert HEADER.count(old) == 1, old
    return HEADER.replace(old, new)


@pytest.fixture(scope="module")
def dll() -> ctypes.CDLL:
    lib = native.library()
    assert lib is not None, "the compiler is installed here, so the library must build"
    return ctypes.CDLL(str(lib.path))


def test_the_header_declares_every_kernel_with_its_struct() -> None:
    abi = native_abi.parse(HEADER)
    assert abi.kernels() == {
        k: f"pagedkv_{k}_params"
        for k in (
            "paged_attention",
            "rms_norm",
            "silu_mul",
            "rope_cache",
            "lora",
            "quant_write",
            "gemm_bf16",
            "gemm_int4",
            "gemm_f32",
            "argmax",
            "run_graph",
        )
    }
    assert native.DTYPES == {
        torch.float32: 0,
        torch.bfloat16: 1,
        torch.float16: 2,
        torch.int8: 3,
        torch.float8_e4m3fn: 4,
    }
    assert native.QUANT_DTYPES == {torch.int8, torch.float8_e4m3fn}


def test_the_built_library_matches_the_header(dll: ctypes.CDLL) -> None:
    native_abi.verify(native_abi.parse(HEADER), dll)  # raises on any difference


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        # a field that changed type: its size and every later offset move
        (
            "  int64_t rows;\n  int64_t n;\n  float eps;",
            "  int32_t rows;\n  int64_t n;\n  float eps;",
            "pagedkv_rms_norm_params",
        ),
        # two fields swapped: sizes agree, offsets do not
        (
            "  const void* k;                    // [num_blocks, num_kv_heads, block_size, head_dim]"
            " contiguous\n  const void* v;                    // as k\n",
            "  const void* v;\n  const void* k;\n",
            "offsetof(pagedkv_paged_attention_params, k)",
        ),
        # a field Python does not know about
        (
            "  int32_t gelu;                     // 0: SiLU (Llama); 1: GELU, tanh approximation"
            " (Gemma)\n} pagedkv_silu_mul_params;",
            "} pagedkv_silu_mul_params;",
            "silu",
        ),
        # an enum value renumbered
        ("PAGEDKV_DTYPE_INT8 = 3,", "PAGEDKV_DTYPE_INT8 = 5,", "PAGEDKV_DTYPE_INT8"),
    ],
)
def test_a_layout_mismatch_is_detected(dll: ctypes.CDLL, old: str, new: str, named: str) -> None:
    with pytest.raises(native_abi.AbiMismatch, match=re.escape(named)):
        native_abi.verify(native_abi.parse(altered(old, new)), dll)


def test_a_mismatched_library_is_refused_for_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert native.library() is not None  # built (and cached) with the real header
    wrong = native_abi.parse(altered("  float eps;\n", "  int64_t eps;\n"))
    monkeypatch.setattr(native, "ABI", wrong)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_lib", None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.library() is None
    assert "does not match pagedkv_abi.h" in caplog.text and "torch path" in caplog.text
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    normed, _ = ops.rms_norm(x, w, 1e-6)  # the torch path serves
    want = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, want)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  float eps;\n", "  double eps;\n", "fields go one per line"),
        ("  int64_t n;\n  float eps;\n", "  int64_t n, m;\n  float eps;\n", "one per line"),
        ("#include <stdint.h>", "#include <stdint.h>\n#pragma pack(1)", "preprocessor"),
        ("PAGEDKV_DTYPE_FLOAT16 = 2,", "PAGEDKV_DTYPE_FLOAT16,", "NAME = value"),
        (
            "int pagedkv_silu_mul(const pagedkv_silu_mul_params* params, char* err, int err_len);",
            "",
            "needs its kernel",
        ),
        ("#endif  // PAGEDKV_ABI_H", "#endif  // PAGEDKV_ABI_H\nstatic int x = 1;", "line"),
    ],
)
def test_the_parser_refuses_what_it_does_not_read(old: str, new: str, message: str) -> None:
    with pytest.raises(native_abi.AbiFormatError, match=message):
        native_abi.parse(altered(old, new))


def test_a_failing_kernel_status_raises_its_message() -> None:
    lib = native.library()
    assert lib is not None
    x, weight, out = torch.randn(2, 4), torch.ones(4), torch.empty(2, 4)  # (alive while called)
    fields = dict(
        x=x.data_ptr(),
        x_stride=4,
        residual=None,
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        rows=2,
        n=4,
        eps=1e-6,
        threads=1,
        x_scale=1.0,
    )
    with pytest.raises(native.KernelError, match="rms_norm: unsupported dtype code 99"):
        lib.call("rms_norm", dtype=99, **fields)
    lib.call("rms_norm", dtype=native.DTYPES[torch.float32], **fields)  # the same, a known dtype
    assert torch.isfinite(out).all()
    with pytest.raises(TypeError, match="fields not given: threads"):
        lib.call("rms_norm", dtype=0, **{k: v for k, v in fields.items() if k != "threads"})
    with pytest.raises(AttributeError, match="thread"):
        lib.call(
            "rms_norm", dtype=0, thread=1, **{k: v for k, v in fields.items() if k != "threads"}
        )
