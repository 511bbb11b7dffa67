"""Structured outputs against a real server with the official `openai` client.

The tiny model's weights are random, so without the grammar its text is garbage: whatever comes out
parsing and validating shows the mask is what shaped it. Sampling is at temperature 1 with several
seeds, so many different paths through each grammar are taken.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from server_process import TINY_SERVER, ServerProcess

from pagedkv.engine.request import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "kind"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", None]},
    },
}
SEEDS = range(4)


pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--max-model-len", "1024") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe a pet"}], **kw
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_output_parses_and_validates(client, seed):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    r = chat(client, response_format=fmt, temperature=1.0, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_is_an_object(client):
    for seed in SEEDS:
        r = chat(
            client,
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=400,
        )
        if r.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choice_output_is_one_of_the_choices(client, field):
    choices = ["red", "green", "blue sky"]
    body = (
        {"guided_choice": choices}
        if field == "guided_choice"
        else {"structured_outputs": {"choice": choices}}
    )
    outs = {
        client.completions.create(
            model="tiny", prompt="Colour:", max_tokens=20, temperature=1.0, seed=s, extra_body=body
        )
        .choices[0]
        .text
        for s in range(6)
    }
    assert outs <= set(choices)


def test_regex_and_grammar_outputs_match(client):
    for seed in SEEDS:
        r = client.completions.create(
            model="tiny",
            prompt="Code:",
            max_tokens=30,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{2,4}"},
        )
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", r.choices[0].text)
        lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/ | start'
        r = client.completions.create(
            model="tiny",
            prompt="Tree:",
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_grammar": lark},
        )
        text = r.choices[0].text
        if r.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"[(),a-c]+", text) and text.count("(") == text.count(")")
    gbnf = 'root ::= "x" [0-9] [0-9]? "y"'  # GBNF is converted to Lark
    r = client.completions.create(
        model="tiny",
        prompt="A",
        max_tokens=30,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"grammar": gbnf}},
    )
    assert re.fullmatch(r"x[0-9]{1,2}y", r.choices[0].text)


def test_streamed_and_n_samples_all_follow_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, response_format=fmt, temperature=1.0, seed=3, n=3)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    chunks = list(chat(client, response_format=fmt, temperature=1.0, seed=3, n=3, stream=True))
    texts = [
        "".join(
            ch.choices[0].delta.content or ""
            for ch in chunks
            if ch.choices and ch.choices[0].index == i
        )
        for i in range(3)
    ]
    assert texts == [c.message.content for c in r.choices]


def test_constrained_requests_do_not_change_others(server, client):
    """A plain request batched with constrained ones gets exactly the text it gets alone."""
    alone = (
        client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0
        )
        .choices[0]
        .text
    )

    async def together() -> str:
        c = server.async_openai()
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        plain = c.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0
        )
        others = [
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                response_format=fmt,
                max_tokens=100,
                temperature=1.0,
                seed=s,
            )
            for s in range(3)
        ]
        results = await asyncio.gather(plain, *others)
        await c.close()
        return results[0].choices[0].text

    assert asyncio.run(together()) == alone


@pytest.mark.parametrize(
    "body, words",
    [
        ({"guided_regex": "a(b"}, "regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "frob",
        ),
        ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"guided_json": "{not json"}, "structured output"),
        ({"guided_json": "[" * 50_000}, "structured output"),  # deeper than Python parses JSON
        ({"guided_choice": ["a"], "guided_regex": "a"}, "only one output constraint"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "llguidance"),
        (
            {"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
            "structured_outputs.backend",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ],
)
def test_a_bad_constraint_is_a_400_before_any_work(server, body, words):
    before = server.metrics()["pagedkv:prompt_tokens_total"]
    r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert server.metrics()["pagedkv:prompt_tokens_total"] == before  # never queued


@pytest.mark.parametrize(
    "body",
    [
        {"guided_regex": ""},
        {"structured_outputs": {"regex": ""}},
        {"guided_json": {}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    ],
)
def test_empty_constraints_are_constraints(server, body):
    """An empty regex allows only the empty text; an empty schema allows any JSON value."""
    r = server.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 24, "seed": 1, "temperature": 1.0, **body},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if "guided_regex" in body or "structured_outputs" in body:
        assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    elif choice["finish_reason"] == "stop":
        json.loads(choice["text"])


def test_offline_llm_takes_structured_outputs(tiny_model_dir, one_torch_thread):
    from pagedkv import LLM

    llm = LLM(tiny_model_dir, num_gpu_blocks_override=128, block_size=4)
    specs = [
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(json=PERSON),
        StructuredOutputsParams(regex=r"[0-9]{3}"),
    ]
    outs = llm.generate(
        ["Answer:"] * 3,
        [
            SamplingParams(temperature=1.0, seed=2, max_tokens=150, structured_outputs=s)
            for s in specs
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].text in ("yes", "no")
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)
    assert re.fullmatch(r"[0-9]{3}", outs[2].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammars_survive_preemption(tiny_model_dir, one_torch_thread, mode):
    """A pool too small for the batch preempts: each matcher keeps its place."""
    from pagedkv import LLM

    llm = LLM(
        tiny_model_dir,
        num_gpu_blocks_override=48,
        block_size=4,
        max_model_len=256,
        preemption_mode=mode,
    )
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=60,
            n=2,
            structured_outputs=StructuredOutputsParams(json=PERSON),
        )
        for s in range(4)
    ]
    outs = llm.generate(["Pet:"] * 4, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        for c in o.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), PERSON)
            else:
                assert c.finish_reason == "length" and c.text.startswith('{"name":"')
