"""`pagedkv serve --data-parallel-size 2`: a real local Ray cluster on loopback, a tiny model.

One server for the module (Ray and two engines take a while to start): the OpenAI routes,
errors and streaming through the replicas, /metrics and /v1/kv over both, prefix-aware
routing, a replica killed mid-stream, the shared --kv-offload-dir seen by the replica
Ray starts in its place, and the CORS and access-log flags applied by the ingress.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

pytest.importorskip("ray.serve", reason="needs pip install 'pagedkv[ray]'")

from server_process import serve_error  # noqa: E402
from tiny_model import make_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REPLICA = "x-pagedkv-replica"
ORIGIN, OTHER_ORIGIN = "https://a.example", "https://evil.example"  # --allowed-origins: the first
TENANTS = [
    f"You are assistant number {i}. " + "Paged attention keeps the KV cache in blocks. " * 12
    for i in range(4)
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's URL and its log (stdout and stderr, Ray's relayed lines too)."""
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "tiny-ray")
    port, offload = free_port(), tmp_path_factory.mktemp("offload")
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedkv-ray-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--num-gpu-blocks-override",
        "64",
        "--max-num-seqs",
        "4",
        "--kv-offload-dir",
        str(offload),
        "--shutdown-timeout",
        "2",
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--disable-uvicorn-access-log",
        "--enable-lora",
        "--enable-log-requests",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "RAY_DEDUP_LOGS": "0"}  # (Ray holds back lines alike across replicas)  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while "pagedkv serves" not in Path(log.name).read_text():
            assert proc.poll() is None, Path(log.name).read_text()[-4000:]
            assert time.monotonic() < deadline, "the replicas did not start"
            time.sleep(0.5)
        while len(replicas(url)) < 2:  # the ingress's router learns of both replicas
            assert time.monotonic() < deadline, "the ingress never saw both replicas"
            time.sleep(0.5)
        yield url, log.name
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def cluster(server) -> str:
    return server[0]


def complete(url: str, prompt: str, replica: int | None = None, **body) -> httpx.Response:
    headers = {REPLICA: str(replica)} if replica is not None else {}
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/kv", timeout=60).json()["replicas"]


def test_openai_routes_errors_and_streaming(cluster):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    again = client.completions.create(
        model=model, prompt="Hello world", max_tokens=4, temperature=0
    )
    assert again.choices[0].text == out.choices[0].text  # greedy: same answer whichever replica
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
            temperature=0,
        )
    )
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert (
        err.value.body["message"].startswith("max_tokens")
        and err.value.body["type"] == "invalid_request_error"
    )
    bad = httpx.post(f"{cluster}/v1/chat/completions", content=b"{not json", timeout=60)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_a_stored_conversation_stays_on_the_replica_that_keeps_it(cluster):
    """Each replica keeps its own responses; whatever names one reaches that replica: the next
    turn (against what prefix routing would choose), a streamed turn's successor (found by
    asking the replicas), retrieve, input_items, delete and a background response's polls."""
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    ask = TENANTS[1] + "What is a block?"
    # prefix routing now sends this input to `elsewhere`: it was last served there
    warm = client.responses.with_raw_response.create(
        model=model, input=ask, max_output_tokens=2, temperature=0, store=False
    )
    elsewhere = warm.headers[REPLICA]
    names = [snap["replica"] for snap in replicas(cluster)]
    home = names[1 - names.index(elsewhere)]
    first = httpx.post(
        f"{cluster}/v1/responses",
        headers={REPLICA: str(names.index(home))},
        json={"model": model, "input": "Hello", "max_output_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert first.status_code == 200 and first.headers[REPLICA] == home
    turn = client.responses.with_raw_response.create(
        model=model, input=ask, previous_response_id=first.json()["id"], max_output_tokens=3,
        temperature=0,
    )  # fmt: skip
    assert turn.headers[REPLICA] == home
    second = turn.parse()
    with httpx.stream(
        "POST",
        f"{cluster}/v1/responses",
        json={"model": model, "input": "Go on.", "previous_response_id": second.id,
              "max_output_tokens": 3, "temperature": 0, "stream": True},
        timeout=120,
    ) as stream:  # fmt: skip
        assert stream.status_code == 200 and stream.headers[REPLICA] == home
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert events[0]["type"] == "response.created"
    streamed = events[0]["response"]["id"]
    fourth = client.responses.with_raw_response.create(
        model=model, input="And then?", previous_response_id=streamed, max_output_tokens=2,
        temperature=0,
    )  # fmt: skip
    assert fourth.headers[REPLICA] == home
    # the whole conversation is its prompt, and its earlier turns' blocks are there
    assert fourth.parse().usage.input_tokens_details.cached_tokens >= 16 * 4
    got = client.responses.with_raw_response.retrieve(streamed)
    assert got.headers[REPLICA] == home and got.parse().status == events[-1]["response"]["status"]
    items = client.responses.input_items.with_raw_response.list(second.id)
    assert items.headers[REPLICA] == home
    assert items.parse().data[0].content[0].text == ask
    deleted = client.responses.with_raw_response.delete(streamed)
    assert deleted.headers[REPLICA] == home
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed)
    # a background response's polls reach the replica running it, wherever it was created
    for i in range(2):
        queued = client.responses.with_raw_response.create(
            model=model, input=f"Count {i}", max_output_tokens=4, background=True,
            extra_headers={REPLICA: str(i)},
        )  # fmt: skip
        running, status = queued.parse(), "queued"
        deadline = time.monotonic() + 120
        while status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the background response did not end"
            poll = client.responses.with_raw_response.retrieve(running.id)
            assert poll.headers[REPLICA] == queued.headers[REPLICA] == names[i]
            status = poll.parse().status
        assert status in ("completed", "incomplete")


def test_kv_and_metrics_cover_every_replica(cluster):
    for i in (0, 1):
        complete(cluster, f"replica {i} counts this prompt", replica=i)
    snaps = replicas(cluster)
    assert len(snaps) == 2 and len({s["replica"] for s in snaps}) == 2
    assert all(s["num_blocks"] == 64 and s["prefix_queries"] > 0 for s in snaps)
    text = httpx.get(f"{cluster}/metrics", timeout=60).text
    queries = float(
        re.search(r"^pagedkv:prefix_cache_queries_total\{.*\} (\S+)$", text, re.M).group(1)
    )
    assert queries == sum(s["prefix_queries"] for s in snaps)
    # the merged answer in the form a Prometheus scrape asks for, and the name[] filter
    scrape = httpx.get(
        f"{cluster}/metrics",
        params=[("name[]", "pagedkv:prefix_cache_queries_total")],
        headers={"Accept": "application/openmetrics-text;version=1.0.0", "Accept-Encoding": "gzip"},
        timeout=60,
    )
    assert scrape.headers["content-type"].startswith("application/openmetrics-text")
    assert scrape.headers["content-encoding"] == "gzip" and scrape.text.endswith("# EOF\n")
    families = list(openmetrics_families(scrape.text))
    assert [f.name for f in families] == ["pagedkv:prefix_cache_queries"]
    assert sum(s.value for s in families[0].samples if s.name.endswith("_total")) == queries


def test_cors_and_access_log_flags_reach_the_ingress(server):
    """The ingress answers HTTP: its CORS is the flags' (not any origin), its log has no
    access lines; on a replica's answers (/v1/models) as on its own (/v1/kv). The request log
    is the replicas'."""
    url, log = server

    def preflight(origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return httpx.options(f"{url}/v1/completions", headers=headers, timeout=60)

    refused, allowed = preflight(OTHER_ORIGIN), preflight(ORIGIN)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    for path in ("/v1/models", "/v1/kv"):
        mine = httpx.get(f"{url}{path}", headers={"Origin": ORIGIN}, timeout=60)
        assert mine.status_code == 200 and mine.headers.get_list("access-control-allow-origin") == [
            ORIGIN
        ]
        other = httpx.get(f"{url}{path}", headers={"Origin": OTHER_ORIGIN}, timeout=60)
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    answer = complete(url, "an access log line would follow this request").json()
    time.sleep(2)  # Ray relays the replicas' log lines to the driver within this
    lines = Path(log).read_text()
    assert not re.search(r" -- (GET|POST|OPTIONS) /", lines)
    # (--enable-log-requests: the replica's own lines do reach it, relayed by Ray in a while)
    received, deadline = f"Received request {answer['id']}-0: params: SamplingParams(", 60
    while received not in Path(log).read_text():
        assert (deadline := deadline - 1) > 0, "the replica's request log never reached the log"
        time.sleep(1)


def test_uvicorn_trace_level_is_refused_before_ray_starts():
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "serve", "-dp", "2", "--uvicorn-log-level", "trace"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.startswith("pagedkv serve: error: --uvicorn-log-level trace")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_malformed_ray_address_is_one_error_line():
    """Ray's ValueError for an address it cannot parse was a traceback and exit 1."""
    last = serve_error("--ray-address", "1.2.3.4")[-1]
    assert last.startswith(
        "pagedkv serve: error: --ray-address 1.2.3.4: cannot join: Invalid address format"
    )


def test_an_address_where_nothing_listens_is_one_error_line():
    """Ray retried such an address for minutes (3.5 measured) before it failed."""
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    last = serve_error("--ray-address", f"ray://127.0.0.1:{port}")[-1]
    assert last.startswith(
        f"pagedkv serve: error: --ray-address ray://127.0.0.1:{port}: cannot join: "
        f"nothing answers at 127.0.0.1:{port} ("
    ), last


def test_prefix_aware_routing_keeps_each_tenant_on_one_replica(cluster):
    served: dict[int, set[str]] = {}
    cached = []
    for turn in range(3):
        for t, system in enumerate(TENANTS):
            r = complete(cluster, f"{system} User {turn} asks about tenant {t}.")
            served.setdefault(t, set()).add(r.headers[REPLICA])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(names) == 1 for names in served.values()), served
    assert min(cached[len(TENANTS) :]) >= 16 * 4  # every later turn found its system prompt cached


def test_a_client_that_goes_away_frees_the_replicas_blocks(cluster):
    with httpx.stream(
        "POST",
        f"{cluster}/v1/completions",
        headers={REPLICA: "0"},
        timeout=120,
        json={"prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True},
    ) as s:
        assert s.status_code == 200
        assert next(line for line in s.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 60
    while (pool := replicas(cluster)[0])["num_requests"] or pool["used"]:
        assert time.monotonic() < deadline, (
            f"replica 0 still holds the request: {pool['num_requests']}"
        )
        time.sleep(0.5)


def successor_of(cluster: str, before: list[dict]) -> int:
    """The index of the replica Ray starts in place of the one of `before` that died."""
    deadline = time.monotonic() + 120
    names = {b["replica"] for b in before}
    while len(after := replicas(cluster)) < 2 or names <= {s["replica"] for s in after}:
        assert time.monotonic() < deadline, "Ray did not replace the dead replica"
        time.sleep(1)
    return next(i for i, s in enumerate(after) if s["replica"] not in names)


def test_dead_replica_errors_its_stream_and_its_successor_reads_the_shared_tier(cluster):
    prompt = "The disk tier is shared. " * 20
    first = complete(cluster, prompt, replica=0)
    for i in range(
        12
    ):  # push the prompt's blocks out of replica 0's 64-block pool into the shared dir
        complete(cluster, f"filler {i} " + "Memory is cut into fixed-size blocks. " * 30, replica=0)
    before = replicas(cluster)
    victim = before[1]
    kept = httpx.post(
        f"{cluster}/v1/responses",
        headers={REPLICA: "1"},
        json={"input": "Remember me.", "max_output_tokens": 2},
        timeout=120,
    )
    assert kept.status_code == 200 and kept.headers[REPLICA] == victim["replica"]
    with httpx.stream(
        "POST",
        f"{cluster}/v1/completions",
        headers={REPLICA: "1"},
        timeout=120,
        json={"prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True},
    ) as s:
        assert s.status_code == 200 and s.headers[REPLICA] == victim["replica"]
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        os.kill(victim["pid"], signal.SIGKILL)
        tail = [line for line in lines if line.startswith("data:")]
    assert "error" in json.loads(tail[-1][5:]) and "replica" in tail[-1]
    for i in range(3):  # the other replica keeps serving meanwhile
        assert complete(cluster, f"still served {i}").json()["choices"][0]["text"] is not None
    successor = successor_of(cluster, before)
    # its responses died with it: the ingress sends the request elsewhere, which has none
    gone = httpx.get(f"{cluster}/v1/responses/{kept.json()['id']}", timeout=120)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    again = complete(cluster, prompt, replica=successor).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 4
    assert again["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert (
        replicas(cluster)[successor]["offload_hits"] >= 16 * 4
    )  # read from the files replica 0 wrote


def test_load_sums_the_replicas(cluster):
    """GET /load at the ingress: every replica's generation requests in flight, summed (four
    pinned to each replica: more than four at once is both replicas' count)."""

    def load() -> int:
        return httpx.get(f"{cluster}/load", timeout=60).json()["server_load"]

    def stream(i: int) -> int:
        """The tokens the stream delivered, by its closing usage (a chunk may carry several tokens:
        those of accepted drafts, or of steps the server ran while the client had not read)."""
        body = {"prompt": f"Load {i}", "max_tokens": 500, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        headers = {REPLICA: str(i % 2)}
        with httpx.stream(
            "POST", f"{cluster}/v1/completions", json=body, headers=headers, timeout=300
        ) as r:
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and events[-1] == "[DONE]", events[-2:]
        return json.loads(events[-2])["usage"]["completion_tokens"]

    assert load() == 0
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(8)]
        seen = [load()]
        while not all(s.done() for s in streams):
            seen.append(load())
        assert [s.result() for s in streams] == [500] * 8  # every stream whole
    assert max(seen) > 4, seen
    assert load() == 0


def test_a_chats_route_key_is_the_prompt_its_replica_renders(tmp_path):
    """Content parts included: the ingress hashes the text the replica's template gets."""
    from pagedkv.engine.chat import render_chat
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.server.ray_app import Ingress

    tok = Tokenizer.from_hf_folder(make_tiny_model(tmp_path / "model"))
    from types import SimpleNamespace

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    ids = Ingress.func_or_class._prompt_ids(  # its routing alone: no cluster, no instance
        SimpleNamespace(tokenizer=tok),
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": parts}]},
    )
    text = render_chat(tok, [{"role": "user", "content": "Hello\nworld"}])
    assert ids == tok.encode(text, add_special_tokens=False)


def test_a_responses_route_key_is_its_chats(tmp_path):
    """/v1/responses is routed by the conversation it is served as: instructions and input render
    the same prompt as the chat request of those messages."""
    from types import SimpleNamespace

    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.server.ray_app import Ingress

    ingress = SimpleNamespace(tokenizer=Tokenizer.from_hf_folder(make_tiny_model(tmp_path / "m")))
    response = Ingress.func_or_class._prompt_ids(
        ingress, "/v1/responses", {"instructions": "Be brief.", "input": "Hello"}
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = Ingress.func_or_class._prompt_ids(
        ingress, "/v1/chat/completions", {"messages": messages}
    )
    assert response == chat and len(chat) > 4
    other = Ingress.func_or_class._prompt_ids(ingress, "/v1/responses", {"input": "Hello"})
    assert other != chat


def test_an_invocations_route_key_is_the_endpoint_its_body_names(tmp_path):
    """SageMaker's /invocations is routed as the endpoint its body stands for (chat by messages,
    completion by prompt, embeddings by input, rerank by query): it keeps prefix affinity."""
    from types import SimpleNamespace

    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.server.ray_app import Ingress

    ingress = SimpleNamespace(tokenizer=Tokenizer.from_hf_folder(make_tiny_model(tmp_path / "m")))

    def ids(path: str, body: dict) -> list[int]:
        return Ingress.func_or_class._prompt_ids(ingress, path, body)

    messages = [{"role": "user", "content": "Hello there"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": messages}),
        ("/v1/completions", {"prompt": "Hello there"}),
        ("/v1/embeddings", {"input": ["Hello there, again"]}),
        ("/rerank", {"query": "Hello", "documents": ["a"]}),
    ]:
        assert ids("/invocations", body) == ids(path, body) != [], path
    assert ids("/invocations", {"text": "Hello"}) == []


def test_a_pooling_chat_forms_route_key_is_the_prompt_its_replica_pools(tmp_path):
    """vLLM's chat form of an embeddings, /classify or /pooling request is routed by the prompt
    the replica pools: the messages rendered with no generation prompt unless asked (as
    tests/test_embeddings.py checks the replica makes it)."""
    from types import SimpleNamespace

    from pagedkv.engine.chat import render_chat
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.server.ray_app import Ingress

    tok = Tokenizer.from_hf_folder(make_tiny_model(tmp_path / "m"))
    ingress = SimpleNamespace(tokenizer=tok)

    def ids(path: str, body: dict) -> list[int]:
        return Ingress.func_or_class._prompt_ids(ingress, path, body)

    messages = [{"role": "user", "content": "Hello there"}]
    pooled = tok.encode(render_chat(tok, messages, add_generation_prompt=False), False)
    chat = ids("/v1/chat/completions", {"messages": messages})
    assert pooled and pooled != chat
    for path in ("/v1/embeddings", "/classify", "/pooling", "/invocations"):
        got = ids(path, {"input": None, "messages": messages})
        assert got == (chat if path == "/invocations" else pooled), path
        asked = {"messages": messages, "add_generation_prompt": True}
        if path != "/invocations":
            assert ids(path, asked) == chat, path


def test_a_request_for_an_adapter_is_routed_apart_from_the_base_models(tmp_path):
    """Replicas key an adapter's prefix blocks apart, so the same prompt under another adapter
    (or none) must not be steered to the replica holding the other one's blocks."""
    from types import SimpleNamespace

    from starlette.requests import Request

    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.server.ray_app import Ingress

    tok = Tokenizer.from_hf_folder(make_tiny_model(tmp_path / "model"))
    ingress = SimpleNamespace(
        tokenizer=tok, block_size=4, adapters=frozenset({"sql", "chat"}), _prompt_ids=None
    )
    ingress._prompt_ids = lambda path, data: Ingress.func_or_class._prompt_ids(ingress, path, data)

    def hashes(path="/v1/completions", headers=(), **fields):
        request = Request({"type": "http", "method": "POST", "path": path, "headers": headers})
        body = json.dumps({"prompt": list(range(5, 30)), **fields}).encode()
        return Ingress.func_or_class.route_key(ingress, request, body).hashes

    base = hashes()
    assert len(base) == 6
    assert hashes(model="the-base-model") == base  # not an adapter: the base model's blocks
    sql, chat = hashes(model="sql"), hashes(model="chat")
    assert len({base, sql, chat}) == 3 and all(len(h) == 6 for h in (sql, chat))
    assert hashes(model="sql", cache_salt="s") not in (sql, hashes(cache_salt="s"))
    # SageMaker's /invocations: the adapter its header names, over the body's model
    header = [(b"x-amzn-sagemaker-adapter-identifier", b"sql")]
    assert hashes("/invocations", header, model="chat") == sql
    assert hashes("/invocations", model="chat") == chat


def test_runtime_lora_updates_reach_every_replica(cluster, tmp_path_factory):
    """A loaded adapter serves on every replica, and on one Ray starts after a replica died; a
    load that fails leaves none with it; an unload takes it from all."""
    from test_lora import make_adapter

    model = make_tiny_model(tmp_path_factory.getbasetemp() / "tiny-ray")
    adapter = make_adapter(tmp_path_factory.mktemp("ray-lora") / "sql", model, seed=3)

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(f"{cluster}/v1/{path}_lora_adapter", json=body, timeout=120)

    def served(replica: int) -> int:
        headers = {REPLICA: str(replica)}
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "model": "sql"}
        r = httpx.post(f"{cluster}/v1/completions", json=body, headers=headers, timeout=120)
        return r.status_code

    r = post("load", lora_name="bad", lora_path=str(Path(adapter).parent))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = post("load", lora_name="sql", lora_path=adapter)
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert [served(i) for i in range(2)] == [200, 200]
    r = post("load", lora_name="sql", lora_path=adapter)  # loaded already: on both, still
    assert r.status_code == 400 and [served(i) for i in range(2)] == [200, 200], r.text
    before = replicas(cluster)  # a replica Ray starts in place of a dead one loads it too
    os.kill(before[0]["pid"], signal.SIGKILL)
    assert served(successor_of(cluster, before)) == 200
    assert [served(i) for i in range(2)] == [200, 200]
    assert post("unload", lora_name="sql").status_code == 200
    assert [served(i) for i in range(2)] == [404, 404]
    r = post("unload", lora_name="sql")
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"], r.text
    # SageMaker's forms reach every replica too
    r = httpx.post(f"{cluster}/adapters", json={"name": "sql", "src": adapter}, timeout=120)
    assert r.status_code == 200 and r.text == "Adapter sql registered", r.text
    assert [served(i) for i in range(2)] == [200, 200]
    r = httpx.delete(f"{cluster}/adapters/sql", timeout=120)
    assert r.status_code == 200 and r.text == "Adapter sql unregistered", r.text
    assert [served(i) for i in range(2)] == [404, 404]


def test_which_requests_need_a_stored_response_and_which_answers_create_one():
    from pagedkv.server.response_owners import ResponseOwners, created_response, needed_response

    body = json.dumps({"input": "x", "previous_response_id": "resp_a"}).encode()
    assert needed_response("POST", "/v1/responses", body) == "resp_a"
    assert needed_response("POST", "/v1/responses", b'{"input": "x"}') is None
    assert needed_response("POST", "/v1/responses", b"{not json") is None
    assert needed_response("POST", "/v1/chat/completions", body) is None
    for path in ("/v1/responses/resp_b", "/v1/responses/resp_b/cancel",
                 "/v1/responses/resp_b/input_items"):  # fmt: skip
        assert needed_response("GET", path, b"") == "resp_b", path
    assert needed_response("DELETE", "/v1/responses/resp_c/", b"") == "resp_c"
    assert needed_response("GET", "/v1/responses/resp_b/other", b"") is None

    answer = {"id": "resp_d", "object": "response", "store": True, "status": "completed"}
    assert created_response("POST", "/v1/responses", 200, json.dumps(answer).encode()) == "resp_d"
    unkept = json.dumps({**answer, "store": False}).encode()
    assert created_response("POST", "/v1/responses", 200, unkept) is None
    assert created_response("POST", "/v1/responses", 400, json.dumps(answer).encode()) is None
    assert created_response("GET", "/v1/responses/resp_d", 200, json.dumps(answer).encode()) is None

    owners = ResponseOwners(2)
    owners.put("a", "r0")
    owners.put("b", "r1")
    assert owners.get("a") == "r0"  # now the most recent: "b" leaves first
    owners.put("c", "r0")
    assert (owners.get("a"), owners.get("b"), owners.get("c")) == ("r0", None, "r0")
    owners.drop("a")
    assert owners.get("a") is None
