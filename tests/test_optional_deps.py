"""The server, the engine and the CLI import without the optional extras (matplotlib)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# a stand-in for an environment without matplotlib: its import raises ImportError
BLOCK = "import sys; sys.modules['matplotlib'] = None; "


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )


def test_runtime_imports_without_matplotlib():
    r = run_python(
        "import pagedkv.server.app, pagedkv.engine.llm, pagedkv.cli, pagedkv.sim.cli, "
        "pagedkv.bench.cli; print('ok')"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_plot_without_matplotlib_is_one_line_and_exit_2(tmp_path):
    r = run_python(
        "from pagedkv.cli import main; "
        f"sys.exit(main(['simulate', '--requests', '5', '--plot', {str(tmp_path / 'p.png')!r}]))"
    )
    assert r.returncode == 2, r.stderr
    assert 'pip install "pagedkv[plot]"' in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "p.png").exists()
