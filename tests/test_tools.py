"""Tool calls: each format's parser on its own (whole, streamed a character at a time, what is not
a call), then `tools` / `tool_choice` through a real server.

With the tiny random model, `required` and named calls show the grammar at work (the call always
parses and its arguments validate); `auto` is checked by forcing the model's text to a call in the
server's format with a choice constraint, so the parser sees exactly what such a model writes.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_process import TINY_SERVER, ServerProcess
from tiny_model import make_tiny_model

from pagedkv.config import TOOL_CALL_PARSERS, ConfigError, EngineConfig
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.tool_parsers import (
    PARSERS,
    HermesToolParser,
    MistralToolParser,
    ToolCallStream,
    final_tool_calls,
    tool_parser,
)
from pagedkv.server.tools import plain_tool_messages

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TIME = {
    "type": "object",
    "additionalProperties": False,
    "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


# ---------------------------------------------------------------- the parser


def test_hermes_text_parses_into_calls():
    parsed = HermesToolParser().parse(HERMES, final=True)
    assert parsed.content == "Let me check."
    calls = final_tool_calls(parsed, HermesToolParser())
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert len(HermesToolParser(max_calls=1).parse(HERMES, final=True).calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "no tools here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ],
)
def test_text_that_is_not_a_call_stays_content(text):
    parsed = HermesToolParser().parse(text, final=True)
    assert parsed.content == text and final_tool_calls(parsed, HermesToolParser()) == []


def test_tools_and_history_reach_a_template_that_knows_no_tools(tiny_model_dir):
    history = [
        {"role": "user", "content": "Weather?", "name": "alice"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    msgs = plain_tool_messages(history, [TOOLS[0]], HermesToolParser())
    assert msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n'
        "</tool_call>" in msgs[2]["content"]
    )
    assert msgs[1] == history[0]  # other keys (a name) stay for the template
    assert msgs[3] == {
        "role": "tool",
        "content": "<tool_response>\nsunny\n</tool_response>",
        "tool_call_id": "c1",
    }
    assert "tool_calls" not in msgs[2]
    text = Tokenizer.from_hf_folder(tiny_model_dir).apply_chat_template(msgs)
    assert "<tool_response>" in text and "Weather forecast" in text


# ---------------------------------------------------------------- the other formats

CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
PROPERTIES = {name: schema["properties"] for name, schema in SCHEMAS.items()}
# (parser, text, content): the same two calls as each format writes them
FORMATS = [
    ("hermes", HERMES, "Let me check."),
    (
        "qwen3_coder",
        "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
        "\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
        "Let me check.",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
    ),
    (
        "llama3_json",
        ' {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}};'
        '{"name": "get_time", "arguments": {"zone": "CET"}}',
        "",
    ),
    (
        "mistral",
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Let me check.",
    ),
    (  # tokenizers v11 and v13
        "mistral",
        'Let me check.[TOOL_CALLS]get_weather{"city": "Paris", "days": 2}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "Let me check.",
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
    ),
    (
        "granite",
        '<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
    ),
    (
        "phi4_mini_json",
        'Let me check.functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},'
        ' {"name": "get_time", "parameters": {"zone": "CET"}}]',
        "Let me check.",
    ),
    ("pythonic", "[get_weather(city='Paris', days=2), get_time(zone=\"CET\")]", ""),
]


def streamed(parser, text: str) -> tuple[str, list[dict]]:
    """Content and calls as a client rebuilds them from a stream fed a character at a time."""
    stream, content, calls = ToolCallStream(parser), "", {}
    for end in range(1, len(text) + 1):
        piece, deltas = stream.update(text[:end], final=end == len(text))
        content += piece
        for d in deltas:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            assert d.id is None or d.id == call["id"]
            call["arguments"] += d.function.arguments or ""
    return content, list(calls.values())


@pytest.mark.parametrize(("name", "text", "content"), FORMATS)
def test_each_format_parses_whole_and_streamed_alike(name, text, content):
    parsed = tool_parser(name, tools=PROPERTIES).parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS
    assert all(c.complete for c in parsed.calls)
    sent, calls = streamed(tool_parser(name, tools=PROPERTIES), text)
    assert sent == content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in parsed.calls
    ]
    assert all(c["id"] for c in calls)
    assert len(tool_parser(name, max_calls=1, tools=PROPERTIES).parse(text, final=True).calls) == 1


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_reads_what_it_writes(name):
    parser = tool_parser(name, tools=PROPERTIES)
    text = parser.write(CALLS)
    parsed = parser.parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS
    assert parsed.content == ""
    assert parser.instructions  # told to a model whose template knows no tools


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_plain_answers_stream_as_they_come(name):
    """An answer that does not begin as calls is content at once, not held to the end."""
    text = "It is sunny in Paris today, 21 degrees."
    sent = ""
    stream = ToolCallStream(tool_parser(name, tools=PROPERTIES))
    for end in range(1, len(text) + 1):
        piece, deltas = stream.update(text[:end], final=False)
        sent += piece
        assert not deltas
        assert len(text[:end]) - len(sent) < len("[TOOL_CALLS]")  # at most a possible marker held
    assert sent + stream.update(text, final=True)[0] == text


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("llama3_json", '{"name": "f", "parameters": {}} and then some prose'),
        ("llama3_json", '{"city": "Paris"}'),  # JSON, not a call
        ("llama3_json", '<|python_tag|>print("hi")'),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1'),  # cut short
        ("granite", "[1, 2, 3]"),
        ("granite", '[{"name": "f", "arguments": {}}] trailing'),
        ("granite", '<tool_call>{"name": "f", "arguments": {}}'),  # Hermes' block, not a list
        ("mistral", "Sure.[TOOL_CALLS]not a call!"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}'),
        ("phi4_mini_json", "Use functools[lru_cache] here."),
        ("phi4_mini_json", 'functools[{"name": "f", "arguments": {}}] and more'),
        ("pythonic", "[f(1)]"),  # positional
        ("pythonic", "[f(a=b)]"),  # not a literal
        ("pythonic", "[f(a={1, 2})]"),  # a set: not JSON
        ("pythonic", "[f(a=1e999)]"),  # inf: not JSON
        ("pythonic", "[f(**k)]"),
        ("pythonic", "[f(a=1)"),
        ("pythonic", "[f(a=1)] and more"),
        ("pythonic", "[]"),
        ("granite", "[]"),
        ("qwen3_coder", "<tool_call>\n<function=f>\nnot a parameter\n</function>\n</tool_call>"),
        ("qwen3_coder", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
        ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>"),
    ],
)
def test_text_that_is_not_calls_of_the_format_stays_content(name, text):
    parsed = tool_parser(name, tools=PROPERTIES).parse(text, final=True)
    assert parsed.content == text and parsed.calls == []
    sent, calls = streamed(tool_parser(name, tools=PROPERTIES), text)
    assert sent == text


def test_the_flag_takes_every_parser_and_only_those():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    with pytest.raises(
        ConfigError, match="--tool-call-parser must be one of hermes, qwen3_coder, llama3_json"
    ):
        EngineConfig(tool_call_parser="xlam")


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    """As vLLM reads them: each value by its parameter's type; text not of that type, or of a
    parameter the schema does not name, stays text; "null" is null."""
    schema = {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
        "o": {"type": "object"},
        "l": {"type": "array"},
        "s": {"type": "string"},
        "u": {"type": ["string", "null"]},
    }
    values = {
        "n": "12",
        "x": "2.5",
        "b": "True",
        "o": '{"k": [1, 2]}',
        "l": "[1, 'two']",
        "s": "12",
        "u": "null",
        "other": "3",
        "bad": "x",
    }
    text = (
        "<tool_call>\n<function=f>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        + "</function>\n</tool_call>"
    )
    schema["bad"] = {"type": "integer"}
    (call,) = tool_parser("qwen3_coder", tools={"f": schema}).parse(text, final=True).calls
    assert json.loads(call.arguments) == {
        "n": 12,
        "x": 2.5,
        "b": True,
        "o": {"k": [1, 2]},
        "l": [1, "two"],
        "s": "12",
        "u": None,
        "other": "3",
        "bad": "x",
    }
    multiline = "<tool_call><function=f><parameter=s>\na\n\nb\n</parameter></function></tool_call>"
    (call,) = tool_parser("qwen3_coder").parse(multiline, final=True).calls
    assert json.loads(call.arguments) == {"s": "a\n\nb"}


def test_pythonic_literals_become_json():
    (call,) = (
        tool_parser("pythonic")
        .parse("[f(a=True, b=None, c=(1, -2.5), d={'k': [1, 'x']}, e='it\\'s')]", final=True)
        .calls
    )
    assert json.loads(call.arguments) == {
        "a": True,
        "b": None,
        "c": [1, -2.5],
        "d": {"k": [1, "x"]},
        "e": "it's",
    }


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse other ids when the calls come back in the history."""
    parser = MistralToolParser()
    calls = final_tool_calls(parser.parse(parser.write(CALLS), final=True), parser)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert parser.keeps_special_tokens  # [TOOL_CALLS] is a control token: decoded, it must stay


def test_a_template_that_knows_no_tools_is_told_the_parsers_format():
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [  # arguments as OpenAI sends them: JSON text
                {
                    "id": "abcdefghi",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
    ]
    msgs = plain_tool_messages(history, [TOOLS[0]], MistralToolParser())
    assert "[TOOL_CALLS]" in msgs[0]["content"] and "<tool_call>" not in msgs[0]["content"]
    written = msgs[2]["content"]
    assert (
        written == '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]'
    )
    (call,) = MistralToolParser().parse(written, final=True).calls
    assert json.loads(call.arguments) == {"city": "Oslo", "days": 1}


# ---------------------------------------------------------------- through the server

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        *TINY_SERVER,
        "--num-gpu-blocks-override",
        "1024",
        "--max-model-len",
        "2048",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(
        model="tiny", messages=kw.pop("messages", MESSAGES), tools=kw.pop("tools", TOOLS), **kw
    )


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", range(3))
def test_required_yields_a_parsed_call(client, seed):
    r = chat(client, tool_choice="required", seed=seed, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)


def test_required_with_parallel_calls(client):
    """Several calls may follow each other; each one parses and validates."""
    tools = [TOOLS[1], {"type": "function", "function": {"name": "get_zone", "parameters": TIME}}]
    SCHEMAS["get_zone"] = TIME
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=tools,
            tool_choice="required",
            seed=seed,
            temperature=1.0,
            max_tokens=1000,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)


def test_named_function_is_the_one_called(client):
    for seed in range(3):
        r = chat(
            client, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=seed
        )
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        check_call("get_time", calls[0].function.arguments)


def test_streamed_calls_reassemble_to_the_same_call(client):
    kw = dict(tool_choice="required", seed=5, parallel_tool_calls=False)
    whole = chat(client, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, stream=True, **kw):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": d.function.name, "arguments": "", "id": d.id})
            call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(whole) == len(calls) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        whole[0].function.name,
        whole[0].function.arguments,
    )
    assert calls[0]["id"].startswith("call_")


def test_auto_parses_a_hermes_answer(client):
    """The text is forced to a Hermes call (a choice constraint); auto must find the calls."""
    r = chat(client, tool_choice="auto", extra_body={"guided_choice": [HERMES]}, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    plain = chat(client, tool_choice="auto", extra_body={"guided_choice": ["just text"]})
    assert (
        plain.choices[0].message.content == "just text" and not plain.choices[0].message.tool_calls
    )
    assert plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parser", ["mistral", "qwen3_coder"])
def test_auto_reads_calls_in_the_servers_parser_format(tiny_model_dir, parser):
    """The text is forced to the parser's calls; whole and streamed, the answer has them (with
    Mistral's ids; qwen3_coder's values typed by the request's tools), and a Hermes answer is text
    to such a server."""
    text = next(t for name, t, _ in FORMATS if name == parser)
    with ServerProcess(
        tiny_model_dir,
        *TINY_SERVER,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        parser,
    ) as srv:
        client = srv.openai()
        kw = dict(tool_choice="auto", extra_body={"guided_choice": [text]}, max_tokens=300)
        choice = chat(client, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
        if parser == "mistral":
            assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
            # forced calls (Hermes blocks) get the ids Mistral's templates take back too
            forced = chat(client, tool_choice="required", parallel_tool_calls=False, seed=0)
            (call,) = forced.choices[0].message.tool_calls
            assert len(call.id) == 9 and call.id.isalnum()
        content, pieces, finish = "", {}, None
        for chunk in chat(client, stream=True, **kw):
            delta = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = pieces.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and content == "Let me check."
        assert [(c["name"], c["arguments"]) for c in pieces.values()] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        hermes = chat(
            client, tool_choice="auto", extra_body={"guided_choice": [HERMES]}, max_tokens=300
        )
        assert hermes.choices[0].message.content == HERMES
        assert not hermes.choices[0].message.tool_calls
        srv.wait_idle()


def test_mistrals_marker_token_reaches_the_parser(tmp_path):
    """[TOOL_CALLS] is a special token in Mistral's vocabulary (here too): decoded skipping special
    tokens, as requests are by default, the parser would never see it."""
    folder = make_tiny_model(tmp_path / "model", tool_tags=True)
    (marker,) = Tokenizer.from_hf_folder(folder).encode("[TOOL_CALLS]", add_special_tokens=False)
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "mistral")
    with ServerProcess(folder, *TINY_SERVER, *args) as srv:
        client = srv.openai()
        # the marker alone: in the text, and no call (nothing follows it)
        bare = chat(client, tool_choice="auto", logit_bias={str(marker): 100}, max_tokens=1)
        assert bare.choices[0].message.content == "[TOOL_CALLS]"
        assert not bare.choices[0].message.tool_calls
        # without tools the request decodes as it asks
        plain = client.chat.completions.create(
            model="tiny", messages=MESSAGES, logit_bias={str(marker): 100}, max_tokens=1
        )
        assert plain.choices[0].message.content == ""
        srv.wait_idle()


def test_history_with_tool_calls_and_results_is_accepted(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    r = chat(client, messages=messages, tool_choice="none", max_tokens=4)
    bare = chat(client, tool_choice="none", max_tokens=4)
    assert (
        r.usage.prompt_tokens > bare.usage.prompt_tokens
    )  # the call and its result are in the prompt


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{bad"},
                            }
                        ],
                    },
                ]
            },
            "not JSON",
        ),
        (  # nested deeper than Python's JSON parser goes: a 400, not a RecursionError
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[" * 50_000},
                            }
                        ],
                    },
                ]
            },
            "not JSON",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "$defs": None}},
                    }
                ],
            },
            "$defs",
        ),
    ],
)
def test_bad_tool_requests_are_400(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert words in e.value.message


def test_tool_choice_without_tools_is_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="required")


@pytest.mark.slow
def test_default_model_calls_a_tool_and_answers_in_json():
    """SmolLM2 (real weights, GGUF tokenizer in llguidance): a forced call, a JSON answer."""
    with ServerProcess(
        None,
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "256MiB",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as srv:
        c = srv.openai()
        name = c.models.list().data[0].id
        r = c.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(call.function.name, call.function.arguments)
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        r = c.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Paris, 3 days, as JSON"}],
            response_format=fmt,
            max_tokens=60,
            temperature=0,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
        srv.wait_idle()


def test_a_name_inside_the_arguments_is_not_the_call_name():
    text = '<tool_call>{"arguments": {"name": "Bob"}, "name": "greet"}</tool_call>'
    for end in range(1, len(text)):
        for call in HermesToolParser().parse(text[:end], final=False).calls:
            assert call.name in (None, "greet")
    (call,) = HermesToolParser().parse(text, final=True).calls
    assert (call.name, json.loads(call.arguments)) == ("greet", {"name": "Bob"})
    stringified = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert HermesToolParser().parse(stringified, final=True).calls[0].arguments == '{"a": 1}'


def test_odd_call_text_is_not_an_error():
    """A name with an escape JSON does not know, or arguments nested deeper than Python parses,
    mid-stream or whole: no call (yet), never an exception."""
    odd_name = '<tool_call>\n{"name": "a\\q", "arguments": {"x": 1}}\n</tool_call>'
    deep = '<tool_call>\n{"name": "f", "arguments": ' + "[" * 5000 + "\n</tool_call>"
    for text in (odd_name, deep):
        for end in range(1, len(text), 7):
            for call in HermesToolParser().parse(text[:end], final=False).calls:
                assert call.name in (None, "f")
        assert HermesToolParser().parse(text, final=True).calls == []


@pytest.mark.parametrize("where", ["$defs", "definitions", "properties"])
def test_tool_parameters_with_defs_and_refs(client, where):
    """References are relative to the tool's parameters, as they are in a response_format schema;
    a second tool's `$defs` of the same name but another meaning stays its own."""
    day = {"enum": ["mon", "tue"]}
    params = {
        "type": "object",
        "additionalProperties": False,
        "required": ["when"],
        "properties": {"when": {"$ref": f"#/{where}/day"}},
        where: {"day": day},
    }
    if where == "properties":  # a reference to a sibling property
        params["properties"] = {"day": day, "when": {"$ref": "#/properties/day"}}
    other = {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/day"}},
        "$defs": {"day": {"type": "integer"}},
    }
    tools = [
        {"type": "function", "function": {"name": "book", "parameters": params}},
        {"type": "function", "function": {"name": "other", "parameters": other}},
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "book"}},
        temperature=1.0,
        max_tokens=100,
    )
    call = r.choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments)["when"] in ("mon", "tue")
