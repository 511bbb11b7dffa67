"""Shared fixtures. Tests run on CPU with few threads: the machine has two cores."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random-weight Llama as a Hugging Face folder (written once per session)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
