"""The vector-ISA variants of the C++ kernels (csrc/vec.h): choosing one with PAGEDKV_CPU_ISA, one
build per ISA side by side, and the C++ harness (tests/native_harness/harness.cpp) comparing every
kernel with a scalar reference, natively for each x86 variant and for AArch64 NEON under qemu-user.
The torch-level comparisons per variant are the kernel tests that take the kernel_isa fixture."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from native_variants import ISAS

from pagedkv import native

HARNESS = Path(__file__).parent / "native_harness" / "harness.cpp"
CSRC = Path(native.__file__).parent / "csrc"  # the kernels and pagedkv_abi.h, which both sides use
LANES = {"avx512": 16, "avx2": 8, "portable": 8, "neon": 4}
CROSS_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"


def run_harness(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and " 0 failed" in done.stdout, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("isa", ISAS)
def test_each_variant_is_its_own_library(isa: str) -> None:
    lib = native.variant(isa)
    assert lib.isa == isa
    assert lib.vector_width == LANES[isa]
    assert f"pagedkv_kernels_{isa}_" in lib.path.name  # one file per ISA: variants coexist


def test_the_environment_chooses_the_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    assert native.selected_isa() == ISAS[0] and ISAS[-1] == "portable"
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "Portable")
    assert native.selected_isa() == "portable"
    assert "-DPAGEDKV_ISA_PORTABLE" in native.isa_cflags("portable")
    assert "-march=native" in native.isa_cflags(ISAS[0])
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="not one of avx512, avx2, neon, portable"):
        native.selected_isa()
    foreign = "avx2" if ISAS[0] == "neon" else "neon"
    monkeypatch.setenv("PAGEDKV_CPU_ISA", foreign)
    with pytest.raises(ValueError, match="this CPU runs only"):
        native.selected_isa()


@pytest.mark.parametrize("isa", ISAS)
def test_harness_against_each_native_variant(isa: str, tmp_path: Path) -> None:
    """The harness linked against the very library that variant(isa) loads."""
    lib = native.variant(isa).path
    exe = tmp_path / "harness"
    subprocess.run(
        [
            "g++",
            "-O1",
            "-std=c++17",
            "-Wno-psabi",
            f"-I{CSRC}",
            str(HARNESS),
            f"-L{lib.parent}",
            f"-l:{lib.name}",
            f"-Wl,-rpath,{lib.parent}",
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert f"ISA {isa}" in run_harness([str(exe)])


@pytest.mark.skipif(os.uname().machine == "aarch64", reason="on Arm the native variants cover NEON")
@pytest.mark.skipif(
    not (shutil.which(CROSS_CXX) and shutil.which(QEMU)),
    reason=f"needs {CROSS_CXX} and {QEMU} (scripts/install.sh --test installs them: "
    "apt-get install g++-aarch64-linux-gnu qemu-user)",
)
def test_harness_on_aarch64_neon_under_qemu(tmp_path: Path) -> None:
    """The kernels cross-compiled for AArch64 (vec.h picks NEON there) and run under qemu-user."""
    exe = tmp_path / "harness"
    sources = [str(HARNESS)] + [str(p) for p in native.SOURCES]
    subprocess.run(
        [
            CROSS_CXX,
            "-O2",
            "-std=c++17",
            "-fopenmp",
            "-static",
            "-Wno-psabi",
            f"-I{CSRC}",
            *sources,
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert "ISA neon" in run_harness([QEMU, str(exe)])
