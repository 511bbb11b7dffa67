"""Start (or join) Ray, run the replicas' Serve application, wait for SIGINT/SIGTERM, shut down.

Kept apart from `ray_app` so a missing Ray is one clear line (exit 2), not an ImportError.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

from pagedkv.config import ConfigError, EngineConfig

APP_NAME = "pagedkv"


def _init_ray(ray, num_replicas: int, ray_address: str | None) -> None:
    """Start a local Ray sized for the replicas, or join the cluster at `ray_address`."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the replicas Ray starts here
    if ray_address is None:  # no dashboard for a local instance
        ray.init(
            address="local",
            num_cpus=num_replicas,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
        return
    _check_reachable(ray_address)
    try:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError) as e:  # a wrong or malformed address, or a cluster
        # whose auth token we lack
        raise ConfigError(f"--ray-address {ray_address}: cannot join: {e}") from None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ConfigError when nothing accepts a TCP connection at a `host:port` (or `ray://host:port`)
    address: Ray itself retries such an address for minutes (3.5 on this machine) before failing.
    Other forms ("auto", a malformed address) are left to Ray, which fails on them at once."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    host = host.strip("[]")  # an IPv6 literal
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise ConfigError(
            f"--ray-address {address}: cannot join: nothing answers at {host}:{port} ({why})"
        ) from None


def serve_logging(log_level: str, access_log: bool) -> dict:
    """Ray Serve's logging options for uvicorn's flags: its proxy, not uvicorn, answers HTTP
    here. Python's logging (so Serve's) has no uvicorn "trace"."""
    if log_level == "trace":
        raise ConfigError(
            "--uvicorn-log-level trace is uvicorn's own level; Ray Serve's logs go down to debug"
        )
    from pagedkv.server.app import log_level as pagedkv_level  # late: it imports FastAPI

    pagedkv_level()  # (the replicas' own lines: PAGEDKV_LOGGING_LEVEL checked before Ray starts)
    return {"log_level": log_level.upper(), "enable_access_log": access_log}


def serve_replicas(
    config: EngineConfig,
    host: str,
    port: int,
    num_replicas: int,
    ray_address: str | None,
    shutdown_timeout: float,
    routing: str = "prefix-aware",
    cors: dict | None = None,
    logging_config: dict | None = None,
) -> None:
    """`cors`: CORSMiddleware's options, complete; `logging_config`: `serve_logging`'s."""
    if num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    if port == 0:
        raise ConfigError("--port 0 is not supported with Ray Serve: give a port")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(
            '--data-parallel-size and --ray-address need Ray: pip install "pagedkv[ray]"'
        ) from None
    from pagedkv.routing import make_policy

    make_policy(routing)  # a bad name fails before Ray starts
    from pagedkv.server.listen import base_url
    from pagedkv.server.ray_app import build

    _init_ray(ray, num_replicas, ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
        serve.run(
            build(config, num_replicas, shutdown_timeout, routing, cors),
            name=APP_NAME,
            route_prefix="/",
            logging_config=logging_config,
        )
        replicas = f"{num_replicas} Ray Serve replica{'s' if num_replicas > 1 else ''}"
        url = base_url(host, port)
        print(
            f"pagedkv serves {config.model or 'the default model'} on {replicas}: OpenAI API "
            f"at {url}/v1, dashboard at {url}/",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    finally:
        if ray_address is None:
            serve.shutdown()
        else:  # a shared cluster keeps its Serve and other applications
            serve.delete(APP_NAME)
        ray.shutdown()
