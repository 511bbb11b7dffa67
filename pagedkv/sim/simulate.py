"""The seeds' static experiment: how many requests fit under each KV policy.

Pure arithmetic (no torch, no block manager) so the dashboard's Play panel can
call `simulate` on every slider move. Requests are admitted in trace order,
cycling back to the first after the last, until the next reservation no
longer fits in the pool of floor(kv_memory / bytes_per_token) token slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from pagedkv.config import ConfigError, is_digits, parse_size
from pagedkv.sim.trace import TraceRequest

DEFAULT_POLICIES = ("reserve-max", "reserve-output", "paged:16", "paged:256")
RESERVATION_KINDS = ("reserve-max", "reserve-output")


@dataclass(frozen=True, slots=True)
class Policy:
    """`reserve-max`, `reserve-output`, or `paged` with a block size."""

    kind: str
    block_size: int = 0

    @property
    def name(self) -> str:
        return f"paged:{self.block_size}" if self.kind == "paged" else self.kind

    def reservation(self, req: TraceRequest, max_model_len: int, max_output: int) -> int:
        """Token slots the request holds for its whole life under this policy."""
        if self.kind == "reserve-max":
            return max_model_len
        if self.kind == "reserve-output":
            return req.prompt_tokens + max_output
        return -(-req.total_tokens // self.block_size) * self.block_size


def parse_policy(text: str) -> Policy:
    name = text.strip()
    if name in RESERVATION_KINDS:
        return Policy(name)
    kind, _, size = name.partition(":")
    if kind == "paged" and is_digits(size) and int(size) >= 1:
        return Policy("paged", int(size))
    raise ConfigError(
        f"unknown policy {text!r} (use reserve-max, reserve-output or paged:B with B >= 1)"
    )


def parse_policies(policies: str | Iterable[str | Policy]) -> list[Policy]:
    """'reserve-max,paged:16' or a list of names/Policy objects -> [Policy]."""
    items = policies.split(",") if isinstance(policies, str) else list(policies)
    parsed = [p if isinstance(p, Policy) else parse_policy(p) for p in items]
    if not parsed:
        raise ConfigError("--policies must name at least one policy")
    return parsed


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    requests_fit: int
    real_tokens: int
    reserved_tokens: int
    token_utilization: float


@dataclass(frozen=True, slots=True)
class SimResult:
    pool_tokens: int
    policies: list[PolicyResult]

    def get(self, policy: str) -> PolicyResult | None:
        return next((r for r in self.policies if r.policy == policy), None)

    def to_dict(self) -> dict:
        """The `--json` shape fixed by DESIGN.md."""
        return {"pool_tokens": self.pool_tokens, "policies": [asdict(r) for r in self.policies]}


def validate_trace(trace: Sequence[TraceRequest], max_model_len: int, max_output: int) -> None:
    """Every request must be servable under the limits, or the arithmetic would lie."""
    if not trace:
        raise ConfigError("the trace has no requests")
    for i, req in enumerate(trace, 1):
        if req.prompt_tokens < 1 or req.output_tokens < 0:
            raise ConfigError(f"request {i}: prompt_tokens must be >= 1 and output_tokens >= 0")
        if req.output_tokens > max_output:
            raise ConfigError(
                f"request {i}: output_tokens {req.output_tokens} exceeds --max-output {max_output}"
            )
        if req.total_tokens > max_model_len:
            raise ConfigError(
                f"request {i}: prompt + output = {req.total_tokens} tokens exceeds "
                f"--max-model-len {max_model_len}"
            )


def fit_policy(
    trace: Sequence[TraceRequest],
    pool_tokens: int,
    policy: Policy,
    max_model_len: int,
    max_output: int,
) -> PolicyResult:
    """Admit in trace order, cycling, until the next reservation does not fit.

    Whole passes over the trace are counted in one division, so the cost is
    O(len(trace)) however large the pool is; the result is the same as
    admitting one request at a time.
    """
    reserve = [policy.reservation(r, max_model_len, max_output) for r in trace]
    passes, room = divmod(pool_tokens, sum(reserve))
    fit = passes * len(trace)
    real = passes * sum(r.total_tokens for r in trace)
    reserved = pool_tokens - room
    for req, slots in zip(trace, reserve):
        if slots > room:
            break
        room -= slots
        fit += 1
        real += req.total_tokens
        reserved += slots
    return PolicyResult(policy.name, fit, real, reserved, real / reserved if reserved else 0.0)


def pool_tokens_for(kv_memory: int | str, bytes_per_token: int) -> int:
    """floor(kv_memory / bytes_per_token), with the inputs checked."""
    memory = parse_size(kv_memory)
    if memory is None or memory < 1:
        raise ConfigError(f"--kv-memory must be a positive size, got {kv_memory!r}")
    if (
        isinstance(bytes_per_token, bool)
        or not isinstance(bytes_per_token, int)
        or bytes_per_token < 1
    ):
        raise ConfigError(f"--bytes-per-token must be a positive integer, got {bytes_per_token!r}")
    return memory // bytes_per_token


def simulate(
    trace: Sequence[TraceRequest],
    *,
    pool_tokens: int | None = None,
    kv_memory: int | str = "64GiB",
    bytes_per_token: int = 131072,
    max_model_len: int = 8192,
    max_output: int = 2048,
    policies: str | Iterable[str | Policy] = DEFAULT_POLICIES,
) -> SimResult:
    """Requests that fit, real and reserved tokens per policy.

    The pool comes from `pool_tokens` or from memory."""
    if max_model_len < 1 or max_output < 1:
        raise ConfigError("--max-model-len and --max-output must be >= 1")
    if pool_tokens is None:
        pool_tokens = pool_tokens_for(kv_memory, bytes_per_token)
    elif pool_tokens < 0:
        raise ConfigError(f"pool_tokens must be >= 0, got {pool_tokens}")
    validate_trace(trace, max_model_len, max_output)
    parsed = parse_policies(policies)
    return SimResult(
        pool_tokens, [fit_policy(trace, pool_tokens, p, max_model_len, max_output) for p in parsed]
    )


def fit_ratio(
    result: SimResult, numerator: str = "paged:16", denominator: str = "reserve-output"
) -> float | None:
    """How many times as many requests fit under one policy as under another.

    None if either is absent or zero."""
    a, b = result.get(numerator), result.get(denominator)
    if a is None or b is None or b.requests_fit == 0:
        return None
    return a.requests_fit / b.requests_fit
