"""`pagedkv` command line: serve, generate, simulate, plan, bench.

Each subcommand lives in its own module exposing `add_parser(subparsers)` and
`run(args) -> int`. A user mistake (bad flag, bad file) prints one line on
stderr and exits with code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.config import ConfigError, EngineConfig

# subcommand -> module that implements it
COMMANDS = {
    "serve": "pagedkv.server.cli",
    "generate": "pagedkv.engine.cli",
    "simulate": "pagedkv.sim.cli",
    "plan": "pagedkv.sim.plan_cli",
    "bench": "pagedkv.bench.cli",
}


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line and exit 2 (argparse prints usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)   # prog is "pagedkv" or "pagedkv CMD"
        raise SystemExit(2)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and cache flags shared by serve, generate and bench (names follow vLLM)."""
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=["none", "int8", "gguf"], help="weights: none, int8 (per channel), gguf (the file's own blocks; default for a .gguf on CPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 1GiB (wins over --memory-utilization)")
    p.add_argument("--memory-utilization", type=float, default=d["memory_utilization"].default,
                   help="fraction of free device memory after the weights to give the KV pool")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact KV pool size in blocks")
    p.add_argument("--swap-space", default="2GiB", help="host memory for swap-preempted blocks")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "bfloat16", "float32", "float16"])
    p.add_argument("--allocation-policy", default="paged", choices=["paged", "reserve-max", "reserve-output"])
    p.add_argument("--kv-offload-host-memory", default=None, help="host tier for evicted prefix blocks, e.g. 4GiB")
    p.add_argument("--kv-offload-dir", default=None, help="disk tier folder for evicted prefix blocks (persistent)")
    p.add_argument("--kv-offload-disk-size", default="10GiB")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=d["max_waiting"].default, help="queue length beyond which new requests get 429")


def engine_config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    opts = {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}
    opts.update(extra)
    return EngineConfig.from_options(**opts)


def build_parser() -> Parser:
    parser = Parser(prog="pagedkv", description="Paged KV-cache LLM engine and OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, module in COMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    parser.commands = sub.choices   # name -> subparser, for errors found after parsing
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # reported by the subcommand they were given to
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as e:
        print(f"pagedkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `pagedkv simulate | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
