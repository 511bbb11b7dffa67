"""Benchmark workloads: the shared W1/W2/W3 and JSON-lines traces, as token-id prompts.

W1-W3 come from `shared/bench/workloads.py` when it is found (the file every
peer runner imports, so all engines see the same requests); otherwise from the
copy of its generator below, which draws the same numbers in the same order
(same checksums). Requests are greedy with EOS ignored, so each yields exactly
its max_tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedkv.config import ConfigError

SEED = 20261129
VOCAB_LO, VOCAB_HI = 1000, 40000  # the shared workloads draw token ids from [VOCAB_LO, VOCAB_HI)
WORKLOAD_KEYS = ("W1", "W2", "W3")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    key: str  # "W1", or the trace file's stem
    name: str  # "W1-mixed"
    requests: list[BenchRequest]
    shared_prefix_len: int = 0
    source: str = "builtin"  # "shared:<path>", "builtin" or "trace:<path>"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def checksum(self) -> str:
        """The shared module's checksum: sha256 over json [prompt, max_tokens] per request."""
        h = hashlib.sha256()
        for r in self.requests:
            h.update(json.dumps([r.prompt, r.max_tokens]).encode())
        return h.hexdigest()[:16]

    def summary(self) -> dict:
        return {
            "key": self.key,
            "name": self.name,
            "requests": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "shared_prefix_len": self.shared_prefix_len,
            "checksum": self.checksum(),
            "source": self.source,
        }


# ---------------------------------------------------------------- built-in copy of the shared
# generator


def _draw(rng: random.Random, n: int, lo: int = VOCAB_LO, hi: int = VOCAB_HI) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def _w1(seed: int) -> Workload:
    rng = random.Random(seed + 1)
    sigma = 0.8
    mu = math.log(128) - sigma * sigma / 2  # lognormal with mean 128
    reqs = []
    for _ in range(64):
        plen = rng.randint(64, 512)
        olen = max(1, min(512, int(round(rng.lognormvariate(mu, sigma)))))
        reqs.append(BenchRequest(_draw(rng, plen), olen))
    return Workload("W1", "W1-mixed", reqs)


def _w2(seed: int) -> Workload:
    rng = random.Random(seed + 2)
    prefix = _draw(rng, 384)
    reqs = [BenchRequest(prefix + _draw(rng, rng.randint(16, 64)), 64) for _ in range(64)]
    return Workload("W2", "W2-shared-prefix", reqs, shared_prefix_len=384)


def _w3(seed: int) -> Workload:
    rng = random.Random(seed + 3)
    return Workload("W3", "W3-single", [BenchRequest(_draw(rng, 128), 256)])


_BUILTIN = {"W1": _w1, "W2": _w2, "W3": _w3}


def builtin_workload(key: str, seed: int = SEED) -> Workload:
    return _BUILTIN[key](seed)


# ---------------------------------------------------------------- the shared file


def find_shared_file(explicit: str | None = None) -> Path | None:
    """`--workloads-file`, else ../shared/bench/workloads.py beside the repository, else None."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"--workloads-file {explicit}: no such file")
        return path
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent, repo):
        path = base / "shared" / "bench" / "workloads.py"
        if path.is_file():
            return path
    return None


def _shared_workload(path: Path, key: str) -> Workload:
    name = "pagedkv_shared_workloads"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always gets both
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        wl = module.get(key)
    except Exception as e:  # noqa: BLE001 - a broken shared file is a user-facing problem
        raise ConfigError(f"cannot load workload {key} from {path}: {e}") from None
    reqs = [BenchRequest(list(r.prompt), int(r.max_tokens)) for r in wl.requests]
    return Workload(key, wl.name, reqs, getattr(wl, "shared_prefix_len", 0), f"shared:{path}")


def load_workloads(keys: list[str], workloads_file: str | None = None) -> list[Workload]:
    """W1/W2/W3 by key, from the shared file when there is one."""
    unknown = [k for k in keys if k not in WORKLOAD_KEYS]
    if unknown:
        raise ConfigError(
            f"unknown workload {unknown[0]!r} (choose from {', '.join(WORKLOAD_KEYS)})"
        )
    path = find_shared_file(workloads_file)
    return [_shared_workload(path, k) if path else builtin_workload(k) for k in keys]


# ---------------------------------------------------------------- traces


def token_range(vocab_size: int) -> tuple[int, int]:
    """Where random prompt ids come from: the shared range, shrunk to fit a small vocabulary."""
    hi = min(VOCAB_HI, vocab_size)
    return min(VOCAB_LO, hi // 2), hi


@dataclass(frozen=True)
class Trace:
    """A JSON-lines trace ({"prompt_tokens": P, "output_tokens": O} per line): checked, but
    not yet tokens.

    Prompts are drawn once the model's vocabulary is known. With shared_prefix N every prompt starts
    with the same N tokens (or is all prefix when shorter): requests that share a system prompt."""

    path: str
    lines: list
    shared_prefix: int = 0
    seed: int = SEED

    @property
    def key(self) -> str:
        return Path(self.path).stem

    def workload(self, vocab_size: int) -> Workload:
        lo, hi = token_range(vocab_size)
        rng = random.Random(self.seed)
        prefix = _draw(rng, self.shared_prefix, lo, hi)
        reqs = []
        for t in self.lines:
            head = prefix[: t.prompt_tokens]
            reqs.append(
                BenchRequest(
                    head + _draw(rng, t.prompt_tokens - len(head), lo, hi), t.output_tokens
                )
            )
        return Workload(
            self.key, f"trace-{self.key}", reqs, self.shared_prefix, f"trace:{self.path}"
        )


def read_trace(path: str, shared_prefix: int = 0, seed: int = SEED) -> Trace:
    """Read and check a trace (ConfigError naming the file and line on any mistake)."""
    from pagedkv.sim.trace import load_trace

    if shared_prefix < 0:
        raise ConfigError(f"--shared-prefix must be >= 0, got {shared_prefix}")
    lines = load_trace(path)
    for n, t in enumerate(lines, 1):
        if t.output_tokens < 1:
            raise ConfigError(f"{path} request {n}: output_tokens must be >= 1 to benchmark it")
    return Trace(str(path), lines, shared_prefix, seed)
