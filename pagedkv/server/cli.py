"""`pagedkv serve`: the OpenAI-compatible server with the live KV-cache dashboard."""
from __future__ import annotations

import argparse
import sys

from pagedkv.cli import add_engine_args, engine_config_from_args
from pagedkv.config import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a live KV-cache dashboard")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind one endpoint, on Ray Serve (pip install 'pagedkv[ray]')")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--routing", default=None, choices=["prefix-aware", "least-loaded", "round-robin"],
                   help="how --data-parallel-size picks a replica (default prefix-aware)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.routing and args.data_parallel_size == 1 and not args.ray_address:
        raise ConfigError("--routing chooses among replicas: give --data-parallel-size N (N > 1)")
    config = engine_config_from_args(args)
    from pagedkv.server.app import serve   # late: keeps `pagedkv --help` free of torch
    print(f"pagedkv: loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    if args.data_parallel_size != 1 or args.ray_address:   # late: the default never imports Ray
        from pagedkv.server.ray_launch import serve_replicas
        serve_replicas(config, args.host, args.port, args.data_parallel_size, args.ray_address,
                       args.shutdown_timeout, args.routing or "prefix-aware")
        return 0
    serve(config, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    return 0
