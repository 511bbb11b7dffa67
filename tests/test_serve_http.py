"""vLLM's HTTP flags on a real server: HTTPS (--ssl-*), a Unix socket (--uds), a proxy's
--root-path, X-Request-Id headers, forced usage chunks and token ids for tokens; and mistakes in
them refused with one line and exit code 2 before the model loads."""

from __future__ import annotations

import ast
import datetime
import ipaddress
import json
import math
import re
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from server_process import TINY_SERVER, ServerProcess, serve_error


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, valid today."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def complete(server: ServerProcess, **kw):
    return server.openai().completions.create(model="tiny", prompt="Hello", max_tokens=2, **kw)


def test_https_with_the_ssl_flags(tiny_model_dir, tmp_path):
    key, cert = self_signed(tmp_path)
    with ServerProcess(
        tiny_model_dir,
        *TINY_SERVER,
        "--ssl-keyfile",
        str(key),
        "--ssl-certfile",
        str(cert),
        "--ssl-ciphers",  # (TLS 1.2's; 1.3's suites are not set by a cipher list)
        "ECDHE+CHACHA20",
        verify=ssl.create_default_context(cafile=str(cert)),
    ) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        assert complete(srv).usage.completion_tokens == 2
        assert f"OpenAI API at {srv.url}/v1" in srv.output()
        with pytest.raises(httpx.TransportError):  # plain HTTP is not answered
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)
        for ciphers, answered in (("ECDHE+CHACHA20", True), ("ECDHE+AESGCM", False)):
            tls12 = ssl.create_default_context(cafile=str(cert))
            tls12.maximum_version = ssl.TLSVersion.TLSv1_2
            tls12.set_ciphers(ciphers)
            try:
                ok = httpx.get(srv.url + "/health", verify=tls12, timeout=10).status_code == 200
            except httpx.TransportError:
                ok = False
            assert ok == answered, ciphers
        assert srv.terminate() == 0


def test_a_unix_socket_with_uds(tiny_model_dir, tmp_path):
    path = tmp_path / "pagedkv.sock"
    with ServerProcess(tiny_model_dir, *TINY_SERVER, uds=path) as srv:
        assert path.is_socket()
        assert complete(srv).usage.completion_tokens == 2
        assert f"through the Unix socket {path}" in srv.output()
        assert srv.terminate() == 0


ACCESS_FORMAT = "ACCESS %(message)s"


@pytest.fixture(scope="module")
def access_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs") / "access.log"


@pytest.fixture(scope="module")
def server(tiny_model_dir, access_log):
    """With a logging configuration of its own: uvicorn's start-up lines on stderr (where
    ServerProcess reads the port), its access lines in a file."""
    config = access_log.with_name("logging.json")
    config.write_text(
        json.dumps(
            {
                "version": 1,
                "formatters": {"access": {"format": ACCESS_FORMAT}},
                "handlers": {
                    "err": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
                    "file": {
                        "class": "logging.FileHandler",
                        "filename": str(access_log),
                        "formatter": "access",
                    },
                },
                "loggers": {
                    "uvicorn.error": {"handlers": ["err"], "level": "INFO"},
                    "uvicorn.access": {"handlers": ["file"], "level": "INFO", "propagate": False},
                },
            }
        )
    )
    with ServerProcess(
        tiny_model_dir,
        *TINY_SERVER,
        "--root-path",
        "/api",
        "--enable-request-id-headers",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--log-config-file",
        str(config),
        "--h11-max-incomplete-event-size",
        "4096",
        "--h11-max-header-count",
        "24",  # the openai client sends 17
        "--exclude-tools-when-tool-choice-none",
        "--disable-access-log-for-endpoints",
        "/health, /ping",  # (uvicorn logs them under --root-path: /api/health)
    ) as srv:
        yield srv


def test_the_log_config_file_decides_where_logs_go(server, access_log):
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/ping?probe=1").status_code == 200
    assert server.http.get("/v1/models").status_code == 200
    assert complete(server).usage.completion_tokens == 2
    lines = access_log.read_text().splitlines()
    assert any(line.startswith("ACCESS ") and "/v1/completions" in line for line in lines), lines
    assert any("/v1/models" in line for line in lines), lines
    # --disable-access-log-for-endpoints: no line for those paths (a query string aside)
    assert not any("/health" in line or "/ping" in line for line in lines), lines
    assert "/v1/completions" not in server.output()  # the file took them


def test_a_request_with_more_headers_than_the_limit_is_a_431(server):
    few = {f"x-{i}": "1" for i in range(4)}  # with httpx's own (host, accept, ...): under 24
    assert server.http.get("/health", headers=few).status_code == 200
    many = {f"x-{i}": "1" for i in range(24)}
    r = server.http.get("/health", headers=many)
    assert r.status_code == 431
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert "the limit is 24" in r.json()["error"]["message"]


def test_a_request_head_over_the_h11_limit_is_refused(server):
    """6 KiB of a request's head, still incomplete, passes uvicorn's default limit (16 KiB), not
    the server's 4 KiB."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"x" * 6144)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert server.http.get("/health").status_code == 200


def test_the_root_path_is_where_a_proxy_serves_the_api(server):
    """A proxy strips the prefix: the app answers at its own paths, and says where it is."""
    assert server.http.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert server.http.get("/v1/models").status_code == 200
    page = server.http.get("/").text  # the dashboard's own requests stay under the prefix
    assert 'src="static/dashboard.js"' in page and 'src="/static' not in page


def test_replies_carry_the_request_id(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    r = server.http.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    r = server.http.post("/v1/completions", json=body)  # none sent: a new one, the answer's too
    given = r.headers["x-request-id"]
    assert len(given) == 32 and r.json()["id"] == f"cmpl-{given}"
    assert server.http.get("/health").headers["x-request-id"]
    assert "Received request" not in server.output()  # (requests are logged only when asked)


def test_every_stream_ends_with_usage(server):
    chunks = list(complete(server, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    chat = server.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    )
    assert list(chat)[-1].usage.completion_tokens == 2


def test_tokens_are_named_by_id_unless_a_request_says_otherwise(server):
    tokens = complete(server, logprobs=1).choices[0].logprobs.tokens
    assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens)
    own = complete(server, logprobs=1, extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in own.choices[0].logprobs.tokens)


def tool_prompt_tokens(server: ServerProcess, **tools) -> int:
    """The prompt tokens of a chat request with these tool fields."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = {k: ([tool] if v is True else v) for k, v in tools.items()}
    answer = server.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, **tools
    )
    return answer.usage.prompt_tokens


def test_tool_choice_none_leaves_the_tools_out(server):
    """--exclude-tools-when-tool-choice-none (vLLM's): the tools are not shown to the model."""
    assert tool_prompt_tokens(server, tools=True, tool_choice="none") == tool_prompt_tokens(server)
    assert tool_prompt_tokens(server, tools=True, tool_choice="required") > tool_prompt_tokens(
        server
    )


def serve_fails(*args: str) -> str:
    """The error line of a `pagedkv serve` that must not start (after the line saying it loads, for
    what only the load itself meets, as a port in use)."""
    *before, last = serve_error(*args)
    assert all(line.startswith("pagedkv: loading") for line in before), before
    return last


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "nope.pem", "--ssl-certfile", "nope.pem"], "--ssl-certfile/"),
        (
            ["--ssl-cert-reqs", "2"],
            "--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers need --ssl-certfile",
        ),
        (["--uds", "/nonexistent-folder/pagedkv.sock"], "cannot listen on --uds"),
        (["-dp", "2", "--root-path", "/api"], "not available with --data-parallel-size"),
        (["--h11-max-incomplete-event-size", "0"], "must be >= 1"),
        (["--h11-max-header-count", "0"], "--h11-max-header-count must be >= 1"),
        (["--log-config-file", "/nonexistent.json"], "--log-config-file /nonexistent.json: "),
        (["--log-config-file", "/dev/null"], "not JSON"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        (["--max-log-len", "-1"], "--max-log-len must be an integer >= 0, got -1"),
    ],
)
def test_http_flag_mistakes_are_one_line(tiny_model_dir, args, says):
    assert says in serve_fails("--model", tiny_model_dir, *args)


def test_a_client_certificate_requirement_out_of_range_is_refused(tiny_model_dir, tmp_path):
    key, cert = self_signed(tmp_path)
    line = serve_fails(
        "--model", tiny_model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--ssl-cert-reqs", "5",
    )  # fmt: skip
    assert "--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)" in line


def test_requests_and_answers_are_logged_as_vllm_logs_them(tiny_model_dir):
    """--enable-log-requests, --enable-log-outputs and --max-log-len: vLLM's lines (INFO: the id
    and parameters, each answer whole and a stream's pieces; DEBUG: the prompt and ids)."""
    prompt = "Once upon a time, in a land of paged caches and blocks, "
    args = ("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "24")
    # (--log-level debug wins over the variable, as vLLM's over VLLM_LOGGING_LEVEL)
    with ServerProcess(
        tiny_model_dir, *TINY_SERVER, *args, "--log-level", "debug",
        env={"PAGEDKV_LOGGING_LEVEL": "warning"},
    ) as server:  # fmt: skip
        client = server.openai()
        whole = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        tokenized = server.http.post("/tokenize", json={"model": "tiny", "prompt": prompt})
        ids = tokenized.json()["tokens"]
        log = server.output()
    rid = f"{whole.id}-0"
    received = re.search(
        rf"Received request {rid}: params: (SamplingParams\(.*\)), lora_request: None\.", log
    )
    assert received and "temperature=0.0" in received[1] and "max_tokens=6" in received[1]
    assert "top_p=" not in received[1]  # (only what the request set)
    # (the details line is DEBUG, and --max-log-len cuts the text and the ids)
    assert f"Request {rid} details: prompt: {prompt[:24]!r}, prompt_token_ids: {ids[:24]}." in log
    text = whole.choices[0].text
    assert f"Generated response {rid}: output: {text[:24]!r}, finish_reason: length" in log
    # a stream: each piece as it came, then the whole answer
    chat_id = f"{chunks[0].id}-0"
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = re.findall(
        rf"Generated response {chat_id} \(streaming delta\): output: ('.*?'|\".*?\"), finish", log
    )
    # (as many pieces as the client got: on a fast CPU the whole answer may come as one)
    shown = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) == len(shown) >= 1 and "".join(ast.literal_eval(p) for p in pieces) == answer
    assert (
        f"Generated response {chat_id} (streaming complete): output: {answer[:24]!r}, "
        "finish_reason: length" in log
    )


def test_an_unknown_logging_level_is_one_line(tiny_model_dir):
    line = serve_error("--model", tiny_model_dir, env={"PAGEDKV_LOGGING_LEVEL": "loud"})[-1]
    assert "PAGEDKV_LOGGING_LEVEL must be one of CRITICAL, ERROR, WARNING, INFO, DEBUG" in line


def test_an_idle_stream_sends_keep_alive_comments(tiny_model_dir):
    """--sse-keep-alive-interval 1: a stream queued behind a long answer (one sequence at a time)
    gets SSE comments while it waits, then its answer whole, which clients read as usual."""
    args = ("--sse-keep-alive-interval", "1", "--max-num-seqs", "1")
    with ServerProcess(tiny_model_dir, *TINY_SERVER, *args) as server:
        long = {"model": "tiny", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        streamed = server.openai().completions.create(
            model="tiny", prompt="Hi", max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        alone = [c.choices[0].text for c in streamed]
        start = time.monotonic()
        assert server.http.post("/v1/completions", json=long, timeout=300).status_code == 200
        ahead = math.ceil(3.0 / (time.monotonic() - start)) + 1  # the stream waits >= 3 s
        with ThreadPoolExecutor(ahead) as pool:
            busy = [
                pool.submit(server.http.post, "/v1/completions", json=long, timeout=300)
                for _ in range(ahead)
            ]
            time.sleep(0.5)  # (they run one after the other; the stream waits behind them)
            with server.http.stream("POST", "/v1/completions", json=body, timeout=300) as s:
                assert s.status_code == 200
                lines = [line for line in s.iter_lines() if line]
            assert [b.result().status_code for b in busy] == [200] * ahead
    comments = [i for i, line in enumerate(lines) if line == ": keep-alive"]
    data = [line for line in lines if line.startswith("data: ")]
    # one as the stream starts (its first output a second late), one a second after
    assert len(comments) >= 2 and comments[:2] == [0, 1], lines[:5]
    assert data[-1] == "data: [DONE]"
    assert "".join(json.loads(d[6:])["choices"][0]["text"] for d in data[:-1]) == "".join(alone)
