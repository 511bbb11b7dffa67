"""`pagedkv serve` as a real subprocess on a loopback port, for the server and dashboard tests.

The port is 0 (the OS picks a free one); the real port is read from uvicorn's
start-up line, so parallel test runs never collide.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "pagedkv.cli", "serve"]
# a small pool of small blocks, served as "tiny": the API tests' usual server
TINY_SERVER = (
    "--block-size",
    "4",
    "--num-gpu-blocks-override",
    "512",
    "--served-model-name",
    "tiny",
)


def serve_error(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """The stderr lines of a `pagedkv serve` that must refuse to start: exit 2, no traceback.
    `env`: variables set for it."""
    out = subprocess.run(
        [*SERVE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    return out.stderr.strip().splitlines()


class ServerProcess:
    def __init__(
        self,
        model: str | None,
        *args: str,
        api_key: str | None = None,
        start_timeout: float = 120.0,
        verify: ssl.SSLContext | bool = True,
        uds: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`verify`: the certificate an HTTPS server is checked against; `uds`: the server listens
        on that Unix socket (--uds), where clients reach it as http://localhost; `env`: variables
        set for it."""
        self.api_key = api_key
        self.uds, self.verify = uds, verify
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="pagedkv-serve-", suffix=".log", delete=False
        )
        cmd = [
            *SERVE,
            *(["--model", model] if model else []),
            *(["--uds", str(uds)] if uds else ["--port", "0"]),
            *args,
        ]  # None: the default model
        if api_key:
            cmd += ["--api-key", api_key]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )
        self.url = self._wait_for_port(start_timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=60, **self.client_options()
        )
        self._wait_healthy(start_timeout)

    # ---------------------------------------------------------------- start / stop
    def output(self) -> str:
        return Path(self.log.name).read_text()

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.uds and "Uvicorn running on unix socket" in self.output():
                return "http://localhost"
            m = re.search(
                r"Uvicorn running on (https?://(?:[\d.]+|\[[\da-f:]+\]):\d+)", self.output()
            )
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise TimeoutError(f"server did not start:\n{self.output()}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.http.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("server never became healthy")
            time.sleep(0.1)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.http.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- clients
    def client_options(self) -> dict:
        """How a client reaches this server: through its Unix socket, or checking its cert."""
        if self.uds:
            return {"transport": httpx.HTTPTransport(uds=str(self.uds))}
        return {"verify": self.verify}

    def openai(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        if self.uds or self.verify is not True:
            kwargs.setdefault("http_client", httpx.Client(timeout=60, **self.client_options()))
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, **kwargs)

    def async_openai(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, **kwargs)

    def kv(self) -> dict:
        r = self.http.get("/v1/kv")
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {name: value summed over label sets}."""
        values: dict[str, float] = {}
        for line in self.http.get("/metrics").text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", line)
            if m and not line.startswith("#"):
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll /v1/kv until no request holds a block; fail if that never happens (a leak)."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.kv()
            if snap["used"] == 0 and not snap["requests"]:
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"blocks still held after {timeout}s: used={snap['used']} "
                    f"requests={list(snap['requests'])}"
                )
            time.sleep(0.05)
