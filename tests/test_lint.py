"""The package passes its linter and its type checker (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True, timeout=900
    )


def test_ruff_is_clean():
    r = run("ruff", "check", "pagedkv")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = run("mypy", "pagedkv")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr


def test_ruff_format_is_clean():
    r = run("ruff", "format", "--check", "pagedkv")
    assert r.returncode == 0, r.stdout + r.stderr
