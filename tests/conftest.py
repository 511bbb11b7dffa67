"""Shared fixtures. Tests run on CPU with few threads: the machine has two cores."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# kernel_isa: a fixture that runs a kernel test once per vector ISA; imported here so that
# every test module gets it without importing a name its parameters would shadow
from native_variants import kernel_isa  # noqa: E402, F401
from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random-weight Llama as a Hugging Face folder (written once per session)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(params=["torch", "kernel"])
def decode_backend(request, monkeypatch):
    """Decodes through the torch path, or through the C++ kernel (over dequantized blocks when quantized)."""
    from pagedkv.attention import kernel, paged

    if request.param == "torch":
        monkeypatch.setattr(paged, "_use_kernel", lambda q, k_cache: False)
    elif not kernel.available():
        pytest.skip("the C++ attention kernel is not available here")
    return request.param


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Runs with the C++ library (attention and the fused layer ops), or with all of it off."""
    from pagedkv import native

    if request.param == "torch":
        monkeypatch.setattr(native, "_loaded", True)
        monkeypatch.setattr(native, "_lib", None)
    elif not native.available():
        pytest.skip("the C++ library is not available here")
    return request.param


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two shared cores: one torch thread is faster than two fighting other processes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_leaks(request):
    """After the test: the module's `server` holds no block (skipped by tests without one)."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()
