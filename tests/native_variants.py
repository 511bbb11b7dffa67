"""A fixture that runs a kernel test once per vector ISA this CPU executes (native.runnable_isas():
avx512 / avx2 / portable on x86, neon / portable on Arm), each through its own build of the library."""

from __future__ import annotations

import pytest

from pagedkv import native

ISAS = native.runnable_isas()


@pytest.fixture(params=ISAS)
def kernel_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes native.library() (what every call site asks for) the library built for one ISA."""
    lib = native.variant(request.param)
    monkeypatch.setattr(native, "_lib", lib)
    monkeypatch.setattr(native, "_loaded", True)
    return request.param
