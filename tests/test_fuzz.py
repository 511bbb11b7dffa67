"""Property-based fuzzing of a real server: nothing a client sends earns a 5xx or leaks a KV block.

Bounded and derandomized (the same examples every run): schemathesis reads
/openapi.json and sends bodies and query strings that fit the schema and that
break it; then what an attacker tries (huge integers, NaN, lone surrogates,
wrong types, nesting), sent as raw JSON, which no schema-driven tool produces:
every such value in every field, then Hypothesis' mixes of them with random
JSON. The server is small (max_model_len 64) so accepted requests finish fast.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
NASTY = [
    None,
    True,
    0,
    -1,
    1,
    2**63,
    -(2**63) - 1,
    10**30,
    1e-38,
    1e300,
    -1e300,
    0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x",
    "\ud800",
    "a\udfffb",
    "\x00",
    "é" * 300,
    [],
    [-1],
    [2**64],
    [1e400],
    ["\udc00"],
    {},
    {"a": [1]},
    [[[[[]]]]],
    [[1, 2], "x"],
    [{"type": "text", "text": "\ud83d"}],
]
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.text(st.characters() | SURROGATES, max_size=20)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
TOP_LEVEL = [
    "model",
    "prompt",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "max_tokens",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "cache_salt",
    "priority",
    "return_token_ids",
]
USER = {"role": "user", "content": "hi"}
NESTED = {  # field -> the top-level entries that put a value there
    "stream_options.include_usage": lambda v: {
        "stream": True,
        "stream_options": {"include_usage": v},
    },
    "messages.0.content": lambda v: {"messages": [{**USER, "content": v}]},
    "messages.0.role": lambda v: {"messages": [{**USER, "role": v}]},
    "messages.0.name": lambda v: {"messages": [{**USER, "name": v}]},
    "messages.0.content.0.text": lambda v: {
        "messages": [{**USER, "content": [{"type": "text", "text": v}]}]
    },
}
FIELDS = TOP_LEVEL + list(NESTED)
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


def hostile_body(endpoint: str, fields: dict[str, object]) -> bytes:
    """A valid small request with `fields` overwritten, as raw JSON (NaN and Infinity included)."""
    body: dict = {"prompt": "hi"} if endpoint == ENDPOINTS[0] else {"messages": [USER]}
    body["max_tokens"] = 2
    for field, value in fields.items():
        body.update(NESTED[field](value) if field in NESTED else {field: value})
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "8",
        "--num-gpu-blocks-override",
        "64",
    ) as srv:
        yield srv


def assert_healthy_and_idle(srv: ServerProcess) -> None:
    assert srv.http.get("/health").status_code == 200
    snap = srv.wait_idle()
    assert snap["used"] == 0 and snap["num_requests"] == 0
    assert "Traceback" not in srv.output()


def assert_answer_ok(status: int, text: str) -> None:
    assert status < 500, text[:500]
    if status == 200 and text.startswith("{"):
        body = json.loads(text)
        for choice in body.get("choices", []):
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            assert all(isinstance(v, float) for v in logprobs), body  # NaN would serialise as null


def test_schema_driven_fuzzing_never_gets_a_5xx(server):
    schemathesis = pytest.importorskip("schemathesis", minversion="4")
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in ops}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/simulate"} <= labels
    body = schema.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    cases = st.one_of([op.as_strategy(generation_mode=m) for op in ops for m in GenerationMode])
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=100)
    @given(case=cases)
    def run(case):
        response = case.call(base_url=server.url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert_answer_ok(response.status_code, response.text)

    run()
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both kinds were sent
    assert_healthy_and_idle(server)


def post_hostile(srv: ServerProcess, endpoint: str, fields: dict[str, object]) -> None:
    response = srv.http.post(
        endpoint,
        content=hostile_body(endpoint, fields),
        headers={"Content-Type": "application/json"},
    )
    assert_answer_ok(response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (fields, error)


def test_every_hostile_value_in_every_field_is_a_4xx_not_a_5xx(server):
    """All of NASTY x FIELDS x both endpoints, one field at a time (about 2,200 small requests)."""
    for endpoint in ENDPOINTS:
        for field in FIELDS:
            for value in NASTY:
                post_hostile(server, endpoint, {field: value})
    assert_healthy_and_idle(server)


def test_hostile_values_combined_are_4xx_not_5xx(server):
    """Several hostile fields at once, as Hypothesis picks them, with random JSON too."""
    fields = st.dictionaries(
        st.sampled_from(FIELDS), st.sampled_from(NASTY) | JSON, min_size=2, max_size=5
    )

    @settings(FUZZ, max_examples=80)
    @given(endpoint=st.sampled_from(ENDPOINTS), fields=fields)
    def run(endpoint, fields):
        post_hostile(server, endpoint, fields)

    run()
    assert_healthy_and_idle(server)
