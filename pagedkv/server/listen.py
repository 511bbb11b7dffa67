"""Where and how `pagedkv serve` listens: its address bound before the model loads (a busy port
fails at once), and vLLM's HTTP options (--root-path, --uds, --ssl-*, ...) checked as early.
"""

from __future__ import annotations

import copy
import json
import logging.config
import os
import socket
import ssl
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn

from pagedkv.config import ConfigError


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """http://host:port, an IPv6 address in brackets (http://[::1]:8000) as URLs write it."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def served_url(sock: socket.socket, config: uvicorn.Config) -> tuple[str, str]:
    """Where clients reach the app on `sock` (with --root-path, a proxy serves it under that path),
    and how: for a Unix socket, the URL curl takes with `--unix-socket PATH`."""
    if sock.family == socket.AF_UNIX:
        return "http://localhost", f" through the Unix socket {sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return base_url(host, port, "https" if config.is_ssl else "http"), ""


def bind(host: str, port: int, uds: str | None = None) -> socket.socket:
    """The server's address (`uds`: a Unix socket at that path instead), bound (as uvicorn binds
    it) but not yet listening, so that a client is refused while the model loads; ConfigError
    (exit code 2) if it cannot be had."""
    if uds is not None:
        sock, where, address = socket.socket(socket.AF_UNIX), f"--uds {uds}", uds
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        where, address = f"--host {host} --port {port}", (host, port)  # type: ignore[assignment]
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {where}: {e.strerror}") from None
    if uds is not None:
        os.chmod(uds, 0o666)  # as uvicorn leaves it: any local user may connect
    return sock


@dataclass(frozen=True)
class HTTPOptions:
    """How `serve` answers HTTP beyond host and port: vLLM's --root-path, --uds, --ssl-*,
    --h11-max-incomplete-event-size and --log-config-file flags, handed to uvicorn as they are."""

    root_path: str = ""
    uds: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE
    ssl_ciphers: str | None = None  # OpenSSL's cipher list (None: uvicorn's, "TLSv1")
    h11_max_incomplete_event_size: int | None = None  # bytes of a request head (uvicorn: 16 KiB)
    h11_max_header_count: int | None = None  # header lines of a request (None: vLLM's 256)
    log_config_file: str | None = None  # a logging.config.dictConfig as JSON, replacing ours
    # vLLM's: paths whose requests leave no access log line, comma-separated ("/health,/metrics")
    disable_access_log_for_endpoints: str | None = None

    def check(self) -> None:
        """ConfigError (exit 2, before the model loads) for options uvicorn would fail on later."""
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            size = getattr(self, name)
            if size is not None and size < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {size}")
        self.log_config()
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError(
                f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), "
                f"got {self.ssl_cert_reqs}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        if self.ssl_certfile is None:
            if self.ssl_ca_certs or self.ssl_ciphers or self.ssl_cert_reqs != ssl.CERT_NONE:
                raise ConfigError(
                    "--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers need --ssl-certfile"
                )
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            if self.ssl_ciphers is not None:
                context.set_ciphers(self.ssl_ciphers)
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs is not None:
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-ciphers: {e}"
            ) from None

    def quiet_paths(self) -> QuietPaths | None:
        """The access log's filter of --disable-access-log-for-endpoints (None: none given)."""
        paths = {p.strip() for p in (self.disable_access_log_for_endpoints or "").split(",")}
        paths -= {""}
        return QuietPaths(frozenset(paths), self.root_path) if paths else None

    def log_config(self) -> dict | None:
        """The --log-config-file's configuration (None without one), applied to check it."""
        if self.log_config_file is None:
            return None
        where = f"--log-config-file {self.log_config_file}"
        try:
            data = json.loads(Path(self.log_config_file).expanduser().read_text())
        except OSError as e:
            raise ConfigError(f"{where}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: wants a JSON object (logging.config.dictConfig's)")
        try:
            logging.config.dictConfig(copy.deepcopy(data))
        except (ValueError, TypeError, AttributeError, ImportError) as e:
            raise ConfigError(f"{where}: {e}") from None
        return data

    def uvicorn_options(self) -> dict:
        options = {k: v for k, v in asdict(self).items() if v is not None}
        options.pop("log_config_file", None)  # serve() hands uvicorn the configuration itself
        options.pop("disable_access_log_for_endpoints", None)  # (serve(): quiet_paths)
        options.pop("h11_max_header_count", None)  # the app's own check (HeaderCountLimit)
        if self.h11_max_incomplete_event_size is not None:
            options["http"] = "h11"  # h11's limit (httptools, uvicorn's first choice, has none)
        return options


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")  # vLLM's --log-level


class QuietPaths(logging.Filter):
    """Drops uvicorn's access lines of requests to these paths (as vLLM's filter: the exact path,
    its query string aside; and under --root-path, which uvicorn logs before it, the path after
    it too), so that health checks do not flood the log."""

    def __init__(self, paths: frozenset[str], root_path: str = "") -> None:
        super().__init__()
        self.paths, self.root_path = paths, root_path

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path with query, HTTP version, status)
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        path = args[2].split("?", 1)[0]
        below = (
            path[len(self.root_path) :]
            if self.root_path and path.startswith(self.root_path)
            else path
        )
        return path not in self.paths and below not in self.paths
