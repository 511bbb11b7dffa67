"""A short soak (benchmarks/soak.py) against a real server: no error, no leaked block, a clean exit."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_short_soak(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    soak = load_soak()
    server = soak.SpawnedServer(
        [
            "--model",
            tiny_model_dir,
            "--dtype",
            "float32",
            "--block-size",
            "4",
            "--num-gpu-blocks-override",
            "96",
            "--max-waiting",
            "64",
        ]
    )
    try:
        report = asyncio.run(
            soak.soak(
                server.url,
                requests=120,
                concurrency=8,
                burst=12,
                burst_every=40,
                max_seconds=600,
                seed=1,
                pid=server.proc.pid,
            )
        )
    finally:
        graceful = server.close()
    assert report.errors == [], report.errors[:5]
    assert report.requests == 120 + 3 * 12
    assert report.completed + report.vanished + sum(report.rejected.values()) == report.requests
    # at most 8 steady clients + 36 burst requests are ever in flight: the queue (64) never overflows,
    # however slow the machine, so every request is served or vanished on purpose (429s: test_server_load)
    assert report.rejected == {}
    assert report.completed > 0 and report.vanished > 0
    assert report.blocks_held_at_end == 0
    assert report.rss_start_mib and report.rss_end_mib
    assert graceful  # SIGTERM: the lifespan ran to its end
