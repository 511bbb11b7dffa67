"""`pagedkv serve`: the OpenAI-compatible server with the live KV-cache dashboard.

Takes `vllm serve`'s flags (see pagedkv.cli.add_engine_args): the model may be
positional, and the CORS and uvicorn flags have vLLM's names and defaults.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from pagedkv.cli import add_engine_args, add_switch, engine_config_from_args
from pagedkv.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ConfigError, EngineConfig
from pagedkv.server.listen import LOG_LEVELS, HTTPOptions

UVICORN_LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with a live KV-cache dashboard"
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    p.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help="where pagedkv's own log lines start (vLLM's; default: PAGEDKV_LOGGING_LEVEL, "
        "else INFO); DEBUG adds --enable-log-requests' prompts",
    )
    add_switch(p, "--disable-uvicorn-access-log", "no log line per request")
    p.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help='no access log line for requests to these paths, e.g. "/health,/metrics"',
    )
    g = p.add_argument_group("CORS (as vLLM: JSON lists)")
    g.add_argument(
        "--allowed-origins", default='["*"]', help="JSON list, e.g. '[\"https://a.example\"]'"
    )
    g.add_argument("--allowed-methods", default='["*"]', help="JSON list of HTTP methods")
    g.add_argument("--allowed-headers", default='["*"]', help="JSON list of request headers")
    add_switch(g, "--allow-credentials", "allow cookies and credentials")
    add_switch(p, "--enable-auto-tool-choice", 'allow tool_choice "auto"')
    add_switch(
        p,
        "--trust-request-chat-template",
        "run a chat template sent with a request (off: a 400, as in vLLM; a template can "
        "take the server's CPU and memory)",
    )
    add_switch(
        p,
        "--return-tokens-as-token-ids",
        'logprobs name tokens as "token_id:N" unless a request says otherwise',
    )
    add_switch(
        p,
        "--enable-force-include-usage",
        "every stream ends with a usage chunk, asked for or not",
    )
    p.add_argument(
        "--sse-keep-alive-interval",
        type=int,
        default=0,
        metavar="SECONDS",
        help="an idle stream (queued, in prefill, between tokens) sends an SSE comment this often, "
        "so that a proxy with a read timeout keeps it (vLLM's; default 0: never)",
    )
    add_switch(
        p,
        "--enable-request-id-headers",
        "replies carry X-Request-Id (the client's, else a new one the answer's id ends with)",
    )
    h = p.add_argument_group("HTTP (as vLLM; not with --data-parallel-size)")
    h.add_argument("--root-path", default="", help="the path a proxy serves the API under")
    h.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    h.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file")
    h.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file")
    h.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates for client certs")
    h.add_argument(
        "--ssl-ciphers", default=None, help="HTTPS: the ciphers offered (OpenSSL's list)"
    )
    h.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        help="most bytes of a request's head (uvicorn's default: 16 KiB)",
    )
    h.add_argument(
        "--h11-max-header-count",
        type=int,
        default=None,
        help="most header lines a request may carry, else 431 (default 256, as vLLM)",
    )
    h.add_argument(
        "--log-config-file",
        default=None,
        help="logging.config.dictConfig as JSON, for the server's and uvicorn's logs",
    )
    h.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="HTTPS: client certificates 0 not asked for, 1 optional, 2 required",
    )
    p.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="a message's content in the chat template: a string, or a list of text parts "
        "(openai); auto: parts for a template that loops over them",
    )
    p.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat answers (with add_generation_prompt false: the last message's)",
    )
    add_switch(
        p,
        "--exclude-tools-when-tool-choice-none",
        'tool_choice "none" leaves the tools out of the prompt (default: shown, as vLLM)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read from the output (vLLM's names): "
        + ", ".join(TOOL_CALL_PARSERS),
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=EngineConfig.max_stored_responses,
        help="the latest N /v1/responses answers kept for previous_response_id and GET "
        "/v1/responses/{id} (0: none; under --data-parallel-size, N on each replica)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help=", ".join(REASONING_PARSERS) + ": a chat answer's thinking section becomes its "
        "`reasoning`, a structured output constrains what follows it, and a request's "
        "thinking_token_budget closes it",
    )
    p.add_argument(
        "--reasoning-config",
        default=None,
        metavar="JSON",
        help='what a thinking budget forces to close a section: {"reasoning_end_str": '
        '"a phrase, then the closing tag"}',
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template arguments of every request that does not set them, e.g. "
        "'{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local one)"
    )
    p.add_argument(
        "--routing",
        default=None,
        choices=["prefix-aware", "least-loaded", "round-robin"],
        help="how --data-parallel-size picks a replica (default prefix-aware)",
    )
    p.set_defaults(func=run)


def json_list(flag: str, value: str) -> list[str]:
    """vLLM's CORS flags take a JSON list of strings."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
        raise ConfigError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {value!r}")
    return items


def run(args: argparse.Namespace) -> int:
    if args.log_level is not None:  # (read by the server, and by replicas Ray starts from here)
        os.environ["PAGEDKV_LOGGING_LEVEL"] = args.log_level
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:  # nan too (uvicorn would fail on it at SIGTERM)
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.routing and args.data_parallel_size == 1 and not args.ray_address:
        raise ConfigError("--routing chooses among replicas: give --data-parallel-size N (N > 1)")
    cors = {
        "allow_origins": json_list("--allowed-origins", args.allowed_origins),
        "allow_methods": json_list("--allowed-methods", args.allowed_methods),
        "allow_headers": json_list("--allowed-headers", args.allowed_headers),
        "allow_credentials": args.allow_credentials,
    }
    config = engine_config_from_args(args)
    replicated = config.data_parallel_size != 1 or bool(args.ray_address)
    http = HTTPOptions(
        root_path=args.root_path,
        uds=args.uds,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count,
        log_config_file=args.log_config_file,
        disable_access_log_for_endpoints=args.disable_access_log_for_endpoints,
    )  # checked by serve() before the model loads; -dp takes none of them
    if replicated:  # checked before anything loads
        from pagedkv.server.ray_launch import serve_logging

        if http != HTTPOptions():
            raise ConfigError(
                "--root-path, --uds, --ssl-*, --h11-*, --log-config-file and "
                "--disable-access-log-for-endpoints are not available with "
                "--data-parallel-size or --ray-address: Ray Serve's proxy answers HTTP there"
            )
        serve_logs = serve_logging(args.uvicorn_log_level, not args.disable_uvicorn_access_log)
    # late: keeps `pagedkv --help` free of torch
    from pagedkv.server.app import CORS_DEFAULTS, serve

    print(
        f"pagedkv: loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True
    )
    if replicated:  # late: the default never imports Ray
        from pagedkv.server.ray_launch import serve_replicas

        replica = copy.copy(config)  # each replica is one engine
        replica.data_parallel_size = 1
        serve_replicas(
            replica,
            args.host,
            args.port,
            config.data_parallel_size,
            args.ray_address,
            args.shutdown_timeout,
            args.routing or "prefix-aware",
            cors={**CORS_DEFAULTS, **cors},
            logging_config=serve_logs,
        )
        return 0
    return serve(
        config,
        args.host,
        args.port,
        shutdown_timeout=args.shutdown_timeout,
        cors=cors,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        http=http,
    )
