"""`pagedkv simulate --replicas R --routing ...`: a multi-tenant trace over R replicas, per routing.

Each replica is the dynamic replay (`sim.dynamic.Replay`: the real block manager, one token per
running request per step); a request is routed on arrival by the same `pagedkv.routing` policy
object the Ray Serve router runs, seeing each replica's requests in flight as its load. The
trace is many users of a few tenants, each tenant with its own long system prompt, arriving
at random: what prefix-aware routing is for. Reported per policy: the prefix-cache hit rate,
prompt tokens computed, and the load balance (requests per replica, steps to finish).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass

from pagedkv.config import ConfigError
from pagedkv.routing import make_policy, prompt_block_hashes
from pagedkv.sim.dynamic import UNIQUE_TOKEN_STRIDE, Replay, _Live, arrival_steps
from pagedkv.sim.simulate import DEFAULT_POLICIES, Policy

TENANT_TOKEN_STRIDE = 10**6  # tenant k's system prompt: ids (k+1)*stride + j (below the unique ids)
SYSTEM_PROMPT_RANGE = (500, 1000)  # tokens per tenant system prompt
USER_RANGE = (20, 200)  # the user's own part of the prompt
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CAP = 60, 0.8, 256
# flags of the other simulate modes at their defaults: any other value with --replicas is an error
NOT_WITH_REPLICAS = {
    "requests": 200,
    "max_output": 2048,
    "plot": None,
    "dynamic": False,
    "shared_prefix": 0,
    "no_prefix_caching": False,
    "policies": ",".join(DEFAULT_POLICIES),
}
REPLICA_BLOCK_SIZE = 16  # the engine's default block size


@dataclass(frozen=True, slots=True)
class TenantRequest:
    tenant: int
    system_tokens: int
    user_tokens: int
    output_tokens: int

    def token_ids(self, index: int) -> list[int]:
        """The tenant's system prompt, then tokens no other request has."""
        base, own = (self.tenant + 1) * TENANT_TOKEN_STRIDE, (index + 1) * UNIQUE_TOKEN_STRIDE
        return [base + j for j in range(self.system_tokens)] + list(
            range(own, own + self.user_tokens + self.output_tokens)
        )


def tenant_trace(num_requests: int, tenants: int, seed: int) -> list[TenantRequest]:
    """Users of `tenants` tenants, tenant k about 1/(k+1) as popular as the first (Zipf)."""
    if tenants < 1 or num_requests < 1:
        raise ConfigError(
            f"--tenants and the request count must be >= 1, got {tenants}, {num_requests}"
        )
    rng = random.Random(seed)
    system = [rng.randint(*SYSTEM_PROMPT_RANGE) for _ in range(tenants)]
    weights = [1 / (k + 1) for k in range(tenants)]
    out = []
    for _ in range(num_requests):
        k = rng.choices(range(tenants), weights)[0]
        output = min(OUTPUT_CAP, max(1, round(rng.lognormvariate(0, OUTPUT_SIGMA) * OUTPUT_MEDIAN)))
        out.append(TenantRequest(k, system[k], rng.randint(*USER_RANGE), output))
    return out


@dataclass(slots=True)
class ReplicaResult:
    replicas: int
    routing: str
    requests: int
    prefix_queries: int
    prefix_hits: int
    prompt_tokens_computed: int
    requests_max_per_replica: int
    requests_mean_per_replica: float
    peak_load: int  # most requests one replica held at once (waiting + running)
    steps: int
    preemptions: int

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def imbalance(self) -> float:
        """Busiest replica's requests over the mean: 1.0 is perfectly even."""
        return self.requests_max_per_replica / self.requests_mean_per_replica

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "imbalance": self.imbalance}


def run_replicas(
    trace: list[TenantRequest],
    replicas: int,
    routing: str,
    *,
    pool_tokens: int,
    block_size: int,
    max_model_len: int,
    arrival_rate: float,
    seed: int,
) -> ReplicaResult:
    """Replay the trace over `replicas` block managers, routing each arrival by the named policy."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    policy = make_policy(routing)
    reps = [
        Replay(
            [],
            Policy("paged", block_size),
            pool_tokens=pool_tokens,
            max_model_len=max_model_len,
            max_output=OUTPUT_CAP,
            arrivals=[],
        )
        for _ in range(replicas)
    ]
    arrivals = arrival_steps(len(trace), arrival_rate * replicas, seed)
    pending = deque(sorted(range(len(trace)), key=lambda i: arrivals[i]))
    served = [0] * replicas
    t = peak = 0
    while pending or not all(r.done() for r in reps):
        if pending and all(r.done() for r in reps):
            t = max(t, arrivals[pending[0]])  # skip idle steps
        while pending and arrivals[pending[0]] <= t:
            i = pending.popleft()
            live = _live(i, trace[i], arrivals[i], pool_tokens, max_model_len)
            loads = {k: len(r.waiting) + len(r.running) for k, r in enumerate(reps)}
            k = policy.choose(prompt_block_hashes(live.token_ids[: live.prompt], block_size), loads)
            reps[k].waiting.append(live)
            served[k] += 1
            peak = max(peak, loads[k] + 1)
        for r in reps:
            r.t = t
            r.step()
        t += 1
    queries = sum(r.kv.prefix_queries for r in reps)
    hits = sum(r.kv.prefix_hits for r in reps)
    return ReplicaResult(
        replicas,
        routing,
        len(trace),
        queries,
        hits,
        queries - hits,
        max(served),
        len(trace) / replicas,
        peak,
        t,
        sum(r.preemptions for r in reps),
    )


def _live(i: int, req: TenantRequest, arrival: int, pool_tokens: int, max_model_len: int) -> _Live:
    prompt = req.system_tokens + req.user_tokens
    total = prompt + req.output_tokens
    if total > min(pool_tokens, max_model_len):
        raise ConfigError(
            f"a request of {total} tokens does not fit the replica's pool of {pool_tokens} "
            f"token slots (or --max-model-len {max_model_len}); raise --kv-memory"
        )
    return _Live(f"r{i}", arrival, prompt, total, req.token_ids(i), prompt)


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--replicas must be a comma list of integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--replicas must be >= 1, got {text!r}")
    return counts


def format_results(
    results: list[ReplicaResult], pool_tokens: int, tenants: int, arrival_rate: float
) -> str:
    lines = [
        f"{tenants} tenants (system prompts {SYSTEM_PROMPT_RANGE[0]}-{SYSTEM_PROMPT_RANGE[1]} "
        "tokens), "
        f"Poisson arrivals {arrival_rate:g} per step per replica, {pool_tokens:,} token slots "
        "per replica",
        f"{'replicas':>8}  {'routing':<14}{'hit rate':>9}{'prompt tokens computed':>24}"
        f"{'requests/replica max/mean':>27}{'peak load':>11}{'steps':>8}{'preemptions':>12}",
    ]
    for r in results:
        spread = f"{r.requests_max_per_replica} / {r.requests_mean_per_replica:.0f}"
        lines.append(
            f"{r.replicas:>8}  {r.routing:<14}{100 * r.hit_rate:>8.1f}%"
            f"{r.prompt_tokens_computed:>24,}"
            f"{spread:>27}{r.peak_load:>11}{r.steps:>8,}{r.preemptions:>12,}"
        )
    return "\n".join(lines)


def run_cli(args) -> int:
    """`pagedkv simulate --replicas ...`: each count, each routing; one trace per count."""
    import json

    from pagedkv.sim.simulate import pool_tokens_for

    if args.trace is not None:
        raise ConfigError(
            "--replicas generates its own multi-tenant trace; --trace is not supported with it"
        )
    ignored = [
        f"--{name.replace('_', '-')}"
        for name, value in NOT_WITH_REPLICAS.items()
        if getattr(args, name) != value
    ]
    if ignored:
        raise ConfigError(f"{', '.join(ignored)} does not apply to --replicas")
    counts, routings = parse_counts(args.replicas), [s.strip() for s in args.routing.split(",")]
    for name in routings:
        make_policy(name)  # a bad name fails before any work
    pool = pool_tokens_for(args.kv_memory, args.bytes_per_token)
    results = []
    for n in counts:
        trace = tenant_trace(args.requests_per_replica * n, args.tenants, args.seed)
        results += [
            run_replicas(
                trace,
                n,
                name,
                pool_tokens=pool,
                block_size=REPLICA_BLOCK_SIZE,
                max_model_len=args.max_model_len,
                arrival_rate=args.arrival_rate,
                seed=args.seed,
            )
            for name in routings
        ]
    if args.json:
        print(json.dumps({"pool_tokens": pool, "results": [r.to_dict() for r in results]}))
    else:
        print(format_results(results, pool, args.tenants, args.arrival_rate))
    return 0
