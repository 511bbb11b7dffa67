"""`pagedkv simulate`: the seeds' reservation-vs-paging experiment.

Static by default (how many requests fit at once, pure arithmetic); with
`--dynamic`, a replay over time through the real block manager.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from pagedkv.config import ConfigError, format_size, parse_size
from pagedkv.sim.simulate import (
    DEFAULT_POLICIES,
    SimResult,
    fit_ratio,
    parse_policies,
    pool_tokens_for,
    simulate,
    validate_trace,
)
from pagedkv.sim.trace import OUTPUT_CAP, TraceRequest, generate_trace, load_trace

if TYPE_CHECKING:
    from pagedkv.sim.dynamic import DynamicResult

# the defaults of the flags only a replay over time reads (--dynamic; --arrival-rate also
# --replicas), and of those only --replicas reads: a flag set where it is not read is refused
DYNAMIC_ONLY = {"arrival_rate": 0.0, "shared_prefix": 0, "no_prefix_caching": False}
REPLICAS_ONLY = {
    "routing": "round-robin,least-loaded,prefix-aware",
    "tenants": 8,
    "requests_per_replica": 100,
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="how many requests fit under reservation vs paging (the seeds' experiment)"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace", metavar="FILE.jsonl", help='JSON lines {"prompt_tokens": P, "output_tokens": O}'
    )
    src.add_argument(
        "--requests", type=int, default=200, help="generate this many requests (default 200)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    p.add_argument("--kv-memory", default="64GiB", help="KV pool size, e.g. 64GiB")
    p.add_argument(
        "--bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes per token (Llama 3 8B bf16: 131072)",
    )
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument(
        "--max-output",
        type=int,
        default=2048,
        help="max tokens per answer (reserve-output reserves prompt + this)",
    )
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma list of reserve-max, reserve-output, paged:B",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the result with matplotlib")
    _add_dynamic_args(p.add_argument_group("replay over time (--dynamic)"))
    _add_replica_args(
        p.add_argument_group("a multi-tenant trace over replicas, by routing (--replicas)")
    )
    p.set_defaults(func=run)


def _add_dynamic_args(dyn: argparse._ArgumentGroup) -> None:
    dyn.add_argument(
        "--dynamic", action="store_true", help="replay the trace through the real block manager"
    )
    dyn.add_argument(
        "--arrival-rate",
        type=float,
        default=DYNAMIC_ONLY["arrival_rate"],
        help="Poisson arrivals per step (0: every request arrives at step 0)",
    )
    dyn.add_argument(
        "--shared-prefix",
        type=int,
        default=DYNAMIC_ONLY["shared_prefix"],
        help="tokens of system prompt every request shares (exercises prefix caching)",
    )
    dyn.add_argument(
        "--no-prefix-caching", action="store_true", help="turn prefix caching off in the replay"
    )


def _add_replica_args(rep: argparse._ArgumentGroup) -> None:
    rep.add_argument(
        "--replicas",
        metavar="R[,R...]",
        help="replay over R replicas (--arrival-rate is per replica)",
    )
    rep.add_argument(
        "--routing",
        default=REPLICAS_ONLY["routing"],
        help="comma list of round-robin, least-loaded, prefix-aware",
    )
    rep.add_argument(
        "--tenants",
        type=int,
        default=REPLICAS_ONLY["tenants"],
        help="tenants, each with its own long system prompt",
    )
    rep.add_argument(
        "--requests-per-replica", type=int, default=REPLICAS_ONLY["requests_per_replica"]
    )


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is not None:
        return load_trace(args.trace)
    return generate_trace(
        args.requests, args.seed, output_cap=min(OUTPUT_CAP, max(args.max_output, 1))
    )


def format_table(result: SimResult, args: argparse.Namespace, num_requests: int) -> str:
    source = args.trace or f"{num_requests} generated requests (seed {args.seed})"
    lines = [
        f"pool: {result.pool_tokens:,} token slots ({format_size(parse_size(args.kv_memory))} / "
        f"{args.bytes_per_token:,} B per token); trace: {source}, cycled",
        f"{'policy':<16}{'requests fit':>13}{'real tokens':>14}{'reserved':>12}"
        f"{'holds tokens':>14}{'empty':>8}",
    ]
    for r in result.policies:
        used = 100 * r.token_utilization
        lines.append(
            f"{r.policy:<16}{r.requests_fit:>13,}{r.real_tokens:>14,}{r.reserved_tokens:>12,}"
            f"{used:>13.1f}%{100 - used:>7.1f}%"
        )
    paged = next((r.policy for r in result.policies if r.policy.startswith("paged")), None)
    ratio = fit_ratio(result, paged, "reserve-output") if paged else None
    if ratio is not None:
        lines.append(f"{paged} fits {ratio:.1f}x as many requests as reserve-output")
    return "\n".join(lines)


def run_static(args: argparse.Namespace, trace: list[TraceRequest]) -> int:
    result = simulate(
        trace,
        kv_memory=args.kv_memory,
        bytes_per_token=args.bytes_per_token,
        max_model_len=args.max_model_len,
        max_output=args.max_output,
        policies=args.policies,
    )
    if args.plot:  # before printing, so a bad path gives just the error
        from pagedkv.sim.plot import plot_static

        plot_static(result, args.plot)
    print(json.dumps(result.to_dict()) if args.json else format_table(result, args, len(trace)))
    return 0


def format_dynamic(
    results: list[DynamicResult], args: argparse.Namespace, pool_tokens: int, num_requests: int
) -> str:
    arrivals = f"Poisson, {args.arrival_rate:g} per step" if args.arrival_rate else "all at step 0"
    lines = [
        f"replay through the block manager: {num_requests} requests ({arrivals}), "
        f"pool {pool_tokens:,} token slots",
        "(admission keeps the block manager's 1% watermark free, as the engine does)",
        f"{'policy':<16}{'peak running':>13}{'mean running':>13}{'steps':>8}{'preemptions':>12}"
        f"{'utilization mean / min':>24}{'prefix hits / queries':>26}",
    ]
    for r in results:
        util = f"{100 * r.token_utilization_mean:.1f}% / {100 * r.token_utilization_min:.1f}%"
        hits = f"{r.prefix_hits:,} / {r.prefix_queries:,}"
        lines.append(
            f"{r.policy:<16}{r.peak_running:>13,}{r.mean_running:>13.1f}{r.steps:>8,}{r.preemptions:>12,}"
            f"{util:>24}{hits:>26}"
        )
    return "\n".join(lines)


def run_dynamic(args: argparse.Namespace, trace: list[TraceRequest]) -> int:
    from pagedkv.sim.dynamic import replay

    pool = pool_tokens_for(args.kv_memory, args.bytes_per_token)
    validate_trace(trace, args.max_model_len, args.max_output)
    results = replay(
        trace,
        parse_policies(args.policies),
        pool_tokens=pool,
        max_model_len=args.max_model_len,
        max_output=args.max_output,
        arrival_rate=args.arrival_rate,
        seed=args.seed,
        shared_prefix=args.shared_prefix,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if args.plot:
        from pagedkv.sim.plot import plot_dynamic

        plot_dynamic(results, args.plot)
    if args.json:
        print(json.dumps({"pool_tokens": pool, "policies": [r.summary() for r in results]}))
    else:
        print(format_dynamic(results, args, pool, len(trace)))
    return 0


def _set(args: argparse.Namespace, defaults: dict) -> list[str]:
    """The flags among `defaults` that the command line set (nan differs from any default)."""
    return [f"--{k.replace('_', '-')}" for k, v in defaults.items() if getattr(args, k) != v]


def check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse a --dynamic or --replicas flag given without it: it would be ignored."""
    if args.replicas is not None:
        return  # the replicas replay refuses what it does not read itself
    if given := _set(args, REPLICAS_ONLY):
        raise ConfigError(f"{', '.join(given)} without --replicas would be ignored: add it")
    if not args.dynamic and (given := _set(args, DYNAMIC_ONLY)):
        raise ConfigError(f"{', '.join(given)} without --dynamic would be ignored: add it")


def run(args: argparse.Namespace) -> int:
    check_mode_flags(args)
    if args.replicas is not None:
        from pagedkv.sim.replicas import run_cli

        return run_cli(args)
    parse_policies(args.policies)  # fail on a bad policy before any work
    trace = load_requests(args)
    return run_dynamic(args, trace) if args.dynamic else run_static(args, trace)
