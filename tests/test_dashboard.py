"""The dashboard page in real headless Chromium, loaded while requests run.

Needs Debian's chromium (`apt-get install -y chromium`) and the `playwright`
Python package; never `playwright install` (no downloads). The screenshot is
kept as artifacts/dashboard.png.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest
from server_process import REPO, ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
playwright_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian's chromium is not installed (apt-get install -y chromium)", allow_module_level=True
    )

SHARED = "Paged attention keeps the KV cache in blocks handed out on demand. " * 3


class Traffic:
    """Streaming requests that share a prompt prefix (and n=2 forks), kept running until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(3)
        ]

    def _loop(self, i: int) -> None:
        body = {
            "prompt": SHARED + f"Request {i}.",
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
            "n": 2 if i == 0 else 1,
            "temperature": 0.8,
            "seed": i,
        }
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if self.stop.is_set():
                            break  # leaving the block closes the stream: the server aborts it

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "1024",
        "--served-model-name",
        "tiny",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_dashboard_shows_the_live_pool(server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with Traffic(server.url):
        page.goto(server.url + "/")
        # the grid shows blocks in use and blocks shared between requests (prefix hits and n=2 forks)
        page.wait_for_function(
            "() => +document.getElementById('grid').dataset.used > 0 && "
            "+document.getElementById('grid').dataset.shared > 0",
            timeout=30_000,
        )
        page.wait_for_function("() => window.pagedkv.state.history.length >= 3", timeout=30_000)
        counts = page.evaluate("() => ({...document.getElementById('grid').dataset})")
        assert int(counts["used"]) > int(counts["shared"]) > 0
        assert int(counts["used"]) + int(counts["cached"]) + int(counts["free"]) == 1024
        # a used block is drawn in its request's colour, not the free colour
        pixel = page.evaluate("""() => {
            const s = window.pagedkv.state, lay = s.layout;
            const i = s.snapshot.blocks.findIndex(b => b.state === 'used' && b.fill === s.snapshot.block_size);
            const dpr = window.devicePixelRatio || 1;
            const x = (i % lay.cols) * lay.cell + 2, y = Math.floor(i / lay.cols) * lay.cell + lay.cell - lay.gap - 2;
            return Array.from(document.getElementById('grid').getContext('2d')
                .getImageData(Math.round(x * dpr), Math.round(y * dpr), 1, 1).data);
        }""")
        assert pixel[:3] != [0xE8, 0xEB, 0xF0], "a used block is painted like a free one"
        # the requests list and the charts follow
        assert page.locator("#requests li").count() >= 3
        assert page.locator("#card-usage").inner_text().endswith("%")
        points = page.eval_on_selector("#chart-usage polyline", "p => p.getAttribute('points')")
        assert len(points.split()) >= 3
        # the Play panel: the seeds' experiment
        page.wait_for_function(
            "() => document.querySelectorAll('#play-table tbody tr').length === 3"
        )
        rows = page.locator("#play-table tbody tr").all_inner_texts()
        assert [r.split()[0] for r in rows] == ["reserve-max", "reserve-output", "paged:16"]
        assert int(page.locator("#play-fit").inner_text().replace(",", "")) > 0
        artifacts = REPO / "artifacts"
        artifacts.mkdir(exist_ok=True)
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
    server.wait_idle(timeout=30)
    assert errors == []


def test_play_panel_reacts_to_the_policy(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("() => document.querySelectorAll('#play-table tbody tr').length === 3")
    paged = int(page.locator("#play-fit").inner_text().replace(",", ""))
    page.check("input[value=reserve-max]")
    page.wait_for_function(
        "() => document.querySelector('#play-table tr.selected td').textContent === 'reserve-max'"
    )
    reserved = int(page.locator("#play-fit").inner_text().replace(",", ""))
    assert paged > reserved > 0
    want = server.http.get("/v1/simulate", params={"policies": "reserve-max"}).json()["policies"][0]
    assert reserved == want["requests_fit"]
    page.fill("#play-mem", "not a size")
    page.wait_for_selector("#play-error:not([hidden])")
    assert "size" in page.locator("#play-error").inner_text()


def test_dashboard_asks_for_the_api_key(tiny_model_dir, browser):
    with ServerProcess(tiny_model_dir, "--num-gpu-blocks-override", "64", api_key="k3y") as srv:
        page = browser.new_page()
        page.goto(srv.url + "/")
        page.wait_for_selector("#key-form:not([hidden])")
        assert page.locator("#status").inner_text() == "API key required"
        page.fill("#key", "k3y")
        page.click("#key-form button")
        page.wait_for_function(
            "() => +document.getElementById('grid').dataset.frame > 0", timeout=15_000
        )
        assert page.locator("#count-free").inner_text() == "64"
        page.wait_for_function(
            "() => document.querySelectorAll('#play-table tbody tr').length === 3"
        )
