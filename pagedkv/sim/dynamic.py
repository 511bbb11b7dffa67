"""`pagedkv simulate --dynamic`: replay a trace over time through the real block manager.

Each step, every running request gets one more token (a prompt is one
prefill step), oldest first. When a request cannot grow, the youngest running
request is preempted by recompute: its blocks are freed and it goes back to
the head of the queue, to be re-prefilled with everything it had computed.
Waiting requests are admitted first come, first served (none in a step that
preempted). A request holding prompt + output tokens finishes and frees its
blocks. Reservation policies go through the same manager, so the comparison
with paging is like for like.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.config import ConfigError
from pagedkv.kv.hashing import BlockHashes
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sim.simulate import Policy
from pagedkv.sim.trace import TraceRequest

RESERVATION_BLOCK_SIZE = 16  # reservation policies still allocate in the engine's default blocks
SHARED_TOKEN_BASE = 1  # ids of the shared system prompt: 1 .. shared_prefix
UNIQUE_TOKEN_STRIDE = (
    10**7
)  # request i's own tokens start at (i + 1) * stride, so they never collide
MIN_ARRIVAL_RATE = 1e-9  # below this, arrival steps overflow


@dataclass(slots=True, eq=False)
class _Live:
    """A trace request while it is replayed."""

    req_id: str
    arrival: int
    prompt: int
    total: int  # prompt + output: it finishes when it holds this many tokens
    token_ids: list[int]
    resume: int  # tokens to prefill at the next admission (prompt, or more after preemption)
    held: int = 0
    full_blocks: list[int] = field(
        default_factory=list
    )  # blocks full at admission: the shareable ones
    # hashes of its first `held` tokens (set at admission)
    hashes: BlockHashes = field(default_factory=lambda: BlockHashes(None))


@dataclass(slots=True)
class DynamicResult:
    policy: str
    block_size: int
    steps: int
    completed: int
    peak_running: int
    mean_running: float
    preemptions: int
    token_utilization_mean: float
    token_utilization_min: float
    prefix_queries: int
    prefix_hits: int
    times: list[int]  # the steps sampled below: every step except idle gaps between arrivals
    utilization: list[float]  # tokens held / token slots allocated
    running: list[int]  # requests holding blocks

    def summary(self) -> dict:
        """JSON-able figures, without the per-step series."""
        return {
            k: getattr(self, k)
            for k in self.__dataclass_fields__
            if k not in ("times", "utilization", "running")
        }


def token_ids_for(index: int, req: TraceRequest, shared_prefix: int) -> list[int]:
    """A common system prompt of `shared_prefix` tokens, then tokens no other request has."""
    shared = min(shared_prefix, req.prompt_tokens)
    base = (index + 1) * UNIQUE_TOKEN_STRIDE
    return [SHARED_TOKEN_BASE + j for j in range(shared)] + list(
        range(base, base + req.total_tokens - shared)
    )


def arrival_steps(n: int, rate: float, seed: int) -> list[int]:
    """Poisson arrivals at `rate` requests per step; rate 0 puts every request at step 0."""
    if not (rate == 0 or MIN_ARRIVAL_RATE <= rate < math.inf):
        raise ConfigError(
            f"--arrival-rate must be 0 or between {MIN_ARRIVAL_RATE:g} and infinity, got {rate}"
        )
    if rate == 0:
        return [0] * n
    rng, t, steps = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        steps.append(int(t))
    return steps


class Replay:
    """One policy's replay; `step()` advances one scheduler step, `run()` goes to the end."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        *,
        pool_tokens: int,
        max_model_len: int,
        max_output: int,
        arrivals: Sequence[int],
        shared_prefix: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.policy = policy
        self.block_size = policy.block_size if policy.kind == "paged" else RESERVATION_BLOCK_SIZE
        self.max_output = max_output
        self.kv = KVCacheManager(
            max(pool_tokens // self.block_size, 1),
            self.block_size,
            enable_prefix_caching=enable_prefix_caching,
            allocation_policy=policy.kind,
            max_model_len=max_model_len,
        )
        self.pending = deque(
            sorted(
                (
                    _Live(
                        f"r{i}",
                        arrivals[i],
                        req.prompt_tokens,
                        req.total_tokens,
                        token_ids_for(i, req, shared_prefix),
                        req.prompt_tokens,
                    )
                    for i, req in enumerate(trace)
                ),
                key=lambda r: r.arrival,
            )
        )
        self._check_fits(trace, max_model_len)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.t = 0
        self.completed = 0
        self.preemptions = 0
        # tokens_held = sum(held) - block_size * (extra holders of shared blocks): the manager's own
        # stats() walks the whole pool, too slow to call every step
        self.tokens = 0
        self.holders: Counter[int] = Counter()
        self.extra_holders = 0
        self.times: list[int] = []
        self.utilization: list[float] = []
        self.running_series: list[int] = []

    def _check_fits(self, trace: Sequence[TraceRequest], max_model_len: int) -> None:
        """Every request fits the empty pool on its own, or the replay could never finish."""
        for i, r in enumerate(trace, 1):
            # the manager caps a reservation at max_model_len; paged sizes round up to blocks
            # either way
            need = min(self.policy.reservation(r, max_model_len, self.max_output), max_model_len)
            if not self.kv.can_fit(need):
                raise ConfigError(
                    f"request {i} needs {need} token slots under {self.policy.name} (plus the 1% "
                    f"watermark) but the pool holds {self.kv.num_blocks * self.block_size}; "
                    f"raise --kv-memory"
                )

    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def tokens_held(self) -> int:
        """Distinct tokens in device blocks, as KVStats counts them.

        A shared prefix block counts once."""
        return self.tokens - self.extra_holders * self.block_size

    def token_slots(self) -> int:
        return (self.kv.num_blocks - self.kv.num_free_blocks()) * self.block_size

    def step(self) -> None:
        if not (self.running or self.waiting) and self.pending:
            self.t = max(
                self.t, self.pending[0].arrival
            )  # skip idle steps: a slow arrival rate costs nothing
        while self.pending and self.pending[0].arrival <= self.t:
            self.waiting.append(self.pending.popleft())
        preempted = self._grow_running()
        if not preempted:
            self._admit_waiting()
        slots = self.token_slots()
        self.times.append(self.t)
        self.utilization.append(self.tokens_held() / slots if slots else 0.0)
        self.running_series.append(len(self.running))
        for r in [r for r in self.running if r.held == r.total]:
            self._release(r)
            self.running.remove(r)
            self.completed += 1
        self.t += 1

    def run(self) -> DynamicResult:
        while not self.done():
            self.step()
        busy = [u for u, n in zip(self.utilization, self.running_series) if n]
        return DynamicResult(
            self.policy.name,
            self.block_size,
            self.t,
            self.completed,
            max(self.running_series, default=0),
            sum(self.running_series) / self.t if self.t else 0.0,
            self.preemptions,
            sum(busy) / len(busy) if busy else 0.0,
            min(busy, default=0.0),
            self.kv.prefix_queries,
            self.kv.prefix_hits,
            self.times,
            self.utilization,
            self.running_series,
        )

    def _grow_running(self) -> bool:
        """One token for each running request, oldest first.

        The youngest is preempted when one cannot grow."""
        preempted, i = False, 0
        while i < len(self.running):
            r = self.running[i]
            r.hashes.update(r.token_ids, r.held + 1)
            if self.kv.allocate_slots(r.req_id, r.hashes, 1) is not None:
                r.held += 1
                self.tokens += 1
                i += 1
                continue
            victim = self.running.pop()  # may be r itself, which ends the loop
            self._release(victim)
            victim.resume = victim.held
            victim.held = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
            preempted = True
        return preempted

    def _admit_waiting(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            if r.hashes.num_tokens != r.resume:  # new, or preempted while it grew
                r.hashes = self.kv.block_hashes(r.token_ids, r.resume)
            prefix = self.kv.lookup_prefix(r.hashes)
            new = r.resume - prefix.num_blocks * self.block_size
            budget = self.max_output - (
                r.resume - r.prompt
            )  # reserve-output: the rest of the answer
            if (
                self.kv.allocate_slots(r.req_id, r.hashes, new, prefix=prefix, max_tokens=budget)
                is None
            ):
                return
            self.waiting.popleft()
            self.running.append(r)
            r.held = r.resume
            self.tokens += r.held
            # only blocks full at admission can be shared: later blocks hold this request's own
            # tokens
            r.full_blocks = self.kv.block_table(r.req_id)[: r.held // self.block_size]
            for block in r.full_blocks:
                self.holders[block] += 1
                if self.holders[block] > 1:
                    self.extra_holders += 1

    def _release(self, r: _Live) -> None:
        self.kv.free(r.req_id)
        self.tokens -= r.held
        for block in r.full_blocks:
            if self.holders[block] > 1:
                self.extra_holders -= 1
            self.holders[block] -= 1
        r.full_blocks = []


def replay(
    trace: Sequence[TraceRequest],
    policies: Sequence[Policy],
    *,
    pool_tokens: int,
    max_model_len: int,
    max_output: int,
    arrival_rate: float = 0.0,
    seed: int = 0,
    shared_prefix: int = 0,
    enable_prefix_caching: bool = True,
) -> list[DynamicResult]:
    """Replay the trace under each policy with the same arrivals."""
    if shared_prefix < 0:
        raise ConfigError(f"--shared-prefix must be >= 0, got {shared_prefix}")
    arrivals = arrival_steps(len(trace), arrival_rate, seed)
    return [
        Replay(
            trace,
            p,
            pool_tokens=pool_tokens,
            max_model_len=max_model_len,
            max_output=max_output,
            arrivals=arrivals,
            shared_prefix=shared_prefix,
            enable_prefix_caching=enable_prefix_caching,
        ).run()
        for p in policies
    ]
