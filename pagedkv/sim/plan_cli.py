"""`pagedkv plan`: KV bytes per token and capacity for a model on a memory budget."""

from __future__ import annotations

import argparse
import json

from pagedkv.config import (
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    format_size,
    parse_size,
)
from pagedkv.sim.plan import Plan, check_budget, plan_capacity
from pagedkv.sim.shapes import KNOWN_SHAPES, resolve_shape


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="KV bytes per token, tokens and requests that fit in a memory budget"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder or .gguf (default: SmolLM2-135M-Instruct)",
    )
    src.add_argument(
        "--shape", default=None, choices=sorted(KNOWN_SHAPES), help="a known model shape"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
        help="one KV dtype (default: all)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weights as loaded: none (bfloat16), int8, gguf (default: gguf for a .gguf, else "
        "none); int8 and gguf with their bf16 copy unless PAGEDKV_DENSE_WEIGHTS=0",
    )
    p.add_argument("--memory", default="80GB", help="device memory, e.g. 80GB or 24GiB")
    p.add_argument(
        "--memory-utilization",
        "--gpu-memory-utilization",
        dest="memory_utilization",
        type=float,
        default=0.9,
        help="fraction of --memory the engine may use",
    )
    p.add_argument(
        "--context", type=int, default=128000, help="tokens per request for the concurrency column"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_plan(plan: Plan) -> str:
    budget = int(plan.memory * plan.memory_utilization)
    lines = [
        f"model: {plan.model} ({plan.source}): {plan.num_layers} layers x "
        f"{plan.num_kv_heads} KV heads x {plan.head_dim} head dim; "
        f"weights {format_size(plan.weight_bytes)} "
        f"({format_count(plan.num_params)} params)",
        f"budget: {format_size(plan.memory)} x {plan.memory_utilization:g} = "
        f"{format_size(budget)}; KV cache after weights: {format_size(plan.kv_memory)} "
        f"in blocks of {plan.block_size} tokens",
    ]
    if plan.max_context is not None and plan.context > plan.max_context:
        lines.append(
            f"note: --context {plan.context:,} is longer than the model's "
            f"{plan.max_context:,} tokens"
        )
    if plan.kv_memory == 0:
        lines.append("the weights alone exceed the budget: no room for a KV cache")
    lines.append(
        f"{'kv dtype':<10}{'bytes/token':>14}{'tokens that fit':>18}"
        f"{f'requests at {plan.context:,}':>22}"
    )
    for row in plan.dtypes:
        bpt = row.bytes_per_token
        per_token = f"{bpt:,}" if isinstance(bpt, int) else f"{bpt:,.2f}"
        lines.append(
            f"{row.kv_cache_dtype:<10}{per_token:>14}{row.tokens:>18,}{row.requests_at_context:>22,}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    memory = parse_size(args.memory)
    check_budget(
        memory, args.memory_utilization, args.context, args.block_size
    )  # before reading a model
    shape = resolve_shape(args.model, args.shape, args.quantization)
    asked = KV_CACHE_DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    dtypes = (asked,) if asked else KV_CACHE_DTYPES
    plan = plan_capacity(
        shape,
        memory=memory,
        memory_utilization=args.memory_utilization,
        context=args.context,
        block_size=args.block_size,
        kv_dtypes=dtypes,
    )
    print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
    return 0
