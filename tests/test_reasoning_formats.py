"""vLLM's other reasoning parsers and their settings, each on a real server: `mistral` (Magistral's
[THINK] and [/THINK] control tokens), `granite` (phrases), --reasoning-config (what a thinking
budget forces) and --default-chat-template-kwargs; speculation under a thinking budget.

The tiny random models never write a mark by themselves: a prompt that opens a section and a
thinking budget that closes it (mistral), or a regex that makes the model write Granite's phrases,
give outputs with sections in them.
"""

from __future__ import annotations

import json

import pytest
from server_process import TINY_SERVER, ServerProcess, serve_error
from test_reasoning import MESSAGES, TEXTS, split_reasoning
from tiny_model import make_tiny_model

from pagedkv.config import REASONING_PARSERS
from pagedkv.engine.reasoning import END, FORMATS, Section

# test_reasoning's texts in each parser's marks (Granite's with both spellings)
MARKS = {
    "mistral": [("<think>", "[THINK]"), ("</think>", "[/THINK]"), ("<thin", "[THI")],
    "granite": [
        ("</think>", "Here is my response:"),
        ("<think>", "Here is my thought process:"),
        ("<thin", "Here is my th"),
        ("</thi", "Here's my resp"),
    ],
}


def in_marks(text: str, parser: str) -> str:
    for old, new in MARKS[parser]:
        text = text.replace(old, new)
    return text


def test_the_parsers_are_the_configs():
    assert tuple(FORMATS) == REASONING_PARSERS


@pytest.mark.parametrize("parser", ["mistral", "granite"])
@pytest.mark.parametrize("first", [Section.THINK, Section.EITHER])
@pytest.mark.parametrize("text", TEXTS)
def test_each_parsers_split_only_grows_and_ends_as_the_whole(parser, first, text):
    text = in_marks(text, parser)
    reasoning, content = split_reasoning(text, first, True, parser)
    for k in range(len(text) + 1):
        r, c = split_reasoning(text[:k], first, False, parser)
        assert reasoning.startswith(r) and content.startswith(c), (text[:k], r, c)
        assert not (c and len(r) < len(reasoning)), "content came before the reasoning ended"


def test_granites_phrases_in_either_spelling():
    either = Section.EITHER
    for opened in ("Here is my thought process:", "Here's my thought process:"):
        for closed in ("Here is my response:", "Here's my response:"):
            text = f"{opened} plan. {closed} answer"
            assert split_reasoning(text, either, True, "granite") == (" plan. ", " answer")
    assert split_reasoning("Here is the answer", either, True, "granite") == (
        "",
        "Here is the answer",
    )
    assert split_reasoning("Here's my", either, False, "granite") == ("", "")  # may be a mark
    assert split_reasoning("Here's my thought process: a Here", either, False, "granite") == (
        " a ",
        "",
    )


def post(server, path: str, **body) -> dict:
    r = server.http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server, **body) -> tuple[str, str]:
    reasoning, content = "", ""
    body = {"model": "tiny", "stream": True, **body}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning, content


# ---------------------------------------------------------------- mistral


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("magistral") / "model", mistral_think=True)
    with ServerProcess(folder, *TINY_SERVER, "--reasoning-parser", "mistral") as s:
        yield s


def test_mistrals_control_tokens_mark_the_section(mistral):
    """A prompt that ends in [THINK] (an answer continued) starts inside a section; a budget of 3
    closes it with [/THINK], which (a special token) reaches the text only with special tokens
    kept, as requests under this parser decode."""
    think = post(mistral, "/tokenize", prompt="[THINK][/THINK]", add_special_tokens=False)
    start_id, end_id = think["tokens"]
    opened = [*MESSAGES, {"role": "assistant", "content": "[THINK]"}]
    body = dict(
        messages=opened,
        add_generation_prompt=False,
        continue_final_message=True,
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        thinking_token_budget=3,
    )
    choice = post(mistral, "/v1/chat/completions", **body, return_token_ids=True)["choices"][0]
    assert choice["token_ids"][3] == end_id and start_id not in choice["token_ids"]
    message = choice["message"]
    assert message["reasoning"] and message["content"]
    assert "[/THINK]" not in message["reasoning"] + message["content"]
    kept = post(
        mistral,
        "/v1/completions",
        prompt=post(
            mistral,
            "/tokenize",
            messages=opened,
            add_generation_prompt=False,
            continue_final_message=True,
        )["tokens"],
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        thinking_token_budget=3,
        skip_special_tokens=False,
    )["choices"][0]["text"]
    assert kept == message["reasoning"] + "[/THINK]" + message["content"]
    assert stream_chat(mistral, **body) == (message["reasoning"], message["content"])
    # a plain answer (no [THINK] first) is content
    plain = post(mistral, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=8)
    assert plain["choices"][0]["message"].get("reasoning") is None
    assert plain["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- granite

GRANITE_REGEX = r"Here is my thought process: [a-z]{2,6}\. Here's my response: [a-z]{2,6}\."


@pytest.fixture(scope="module")
def granite(tiny_model_dir):
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--reasoning-parser", "granite") as s:
        yield s


def test_granites_phrases_split_the_answer(granite):
    """Granite's marks are phrases, not tokens: a grammar constrains the whole output (here it
    makes the model write both phrases), and the answer splits at them, streamed alike."""
    body = dict(
        messages=MESSAGES,
        temperature=0,
        max_tokens=64,
        structured_outputs={"regex": GRANITE_REGEX},
    )
    message = post(granite, "/v1/chat/completions", **body)["choices"][0]["message"]
    raw = post(
        granite,
        "/v1/completions",
        prompt=post(granite, "/tokenize", messages=MESSAGES)["tokens"],
        **{k: v for k, v in body.items() if k != "messages"},
    )["choices"][0]["text"]
    head, tail = raw.split(" Here's my response:")
    assert message["reasoning"] == head.removeprefix("Here is my thought process:") + " "
    assert message["content"] == tail
    assert stream_chat(granite, **body) == (message["reasoning"], message["content"])
    plain = post(granite, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=8)
    assert plain["choices"][0]["message"].get("reasoning") is None


def test_a_thinking_budget_needs_marks_that_are_tokens(granite):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 2}
    r = granite.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "granite" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- the settings


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("think") / "model", think_tags=True)


PHRASE = "Time is up.</think>"


@pytest.fixture(scope="module")
def qwen3(think_model):
    with ServerProcess(
        think_model,
        *TINY_SERVER,
        "--reasoning-parser",
        "qwen3",
        "--reasoning-config",
        json.dumps({"reasoning_end_str": PHRASE}),
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--trust-request-chat-template",
    ) as s:
        yield s


def test_the_servers_template_arguments_apply_unless_a_request_sets_them(qwen3):
    closed = post(qwen3, "/tokenize", messages=MESSAGES)["tokens"]
    own = post(
        qwen3, "/tokenize", messages=MESSAGES, chat_template_kwargs={"enable_thinking": True}
    )["tokens"]
    shut = post(qwen3, "/tokenize", prompt="<think>\n\n</think>\n\n", add_special_tokens=False)
    assert closed == own + shut["tokens"]  # the default closed an empty section
    message = post(qwen3, "/v1/chat/completions", messages=MESSAGES, temperature=0, max_tokens=8)
    assert message["choices"][0]["message"].get("reasoning") is None  # answered as content


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(qwen3):
    """As `reasoning_effort`, and as `enable_thinking` (false for "none") unless the request's
    own arguments set that; /v1/responses' reasoning.effort the same way."""

    def prompt(**body) -> list[int]:
        answer = post(
            qwen3,
            "/v1/chat/completions",
            messages=MESSAGES,
            max_tokens=1,
            return_token_ids=True,
            **body,
        )
        return answer["prompt_token_ids"]

    closed = prompt()  # the server's default: thinking off
    opened = prompt(chat_template_kwargs={"enable_thinking": True})
    assert closed != opened
    assert prompt(reasoning_effort="none") == closed
    assert prompt(reasoning_effort="low") == opened
    own = {"enable_thinking": False}
    assert prompt(reasoning_effort="high", chat_template_kwargs=own) == closed
    shown = prompt(
        reasoning_effort="minimal", chat_template="{{ reasoning_effort }} {{ enable_thinking }}"
    )
    said = post(qwen3, "/tokenize", prompt="minimal True", add_special_tokens=False)["tokens"]
    assert shown == said
    answer = post(
        qwen3, "/v1/responses", input=MESSAGES, reasoning={"effort": "low"}, max_output_tokens=1
    )
    assert answer["reasoning"] == {"effort": "low", "summary": None}
    assert answer["usage"]["input_tokens"] == len(opened)


def test_a_budget_forces_the_configured_phrase(qwen3):
    opened = {"enable_thinking": True, "open_thinking": True}  # the template opens <think>
    phrase = post(qwen3, "/tokenize", prompt=PHRASE, add_special_tokens=False)["tokens"]
    choice = post(
        qwen3,
        "/v1/chat/completions",
        messages=MESSAGES,
        chat_template_kwargs=opened,
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        thinking_token_budget=2,
        return_token_ids=True,
    )["choices"][0]
    assert choice["token_ids"][2 : 2 + len(phrase)] == phrase
    assert choice["message"]["reasoning"].endswith(PHRASE.removesuffix(END))
    assert choice["message"]["content"]
    # /v1/responses passes the budget on as well
    answer = post(
        qwen3,
        "/v1/responses",
        input=MESSAGES,
        chat_template_kwargs=opened,
        temperature=0,
        max_output_tokens=16,
        thinking_token_budget=2,
    )
    thought = answer["output"][0]
    assert thought["type"] == "reasoning", answer
    assert thought["content"][0]["text"] == choice["message"]["reasoning"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--reasoning-config", '{"reasoning_end_str": "</think>"}'], "needs --reasoning-parser"),
        (["--reasoning-parser", "qwen3", "--reasoning-config", '{"x": 1}'], "unknown key 'x'"),
        (["--reasoning-parser", "qwen3", "--reasoning-config", "[1]"], "JSON object"),
        (
            ["--reasoning-parser", "qwen3", "--reasoning-config", '{"reasoning_end_str": "done"}'],
            "must end with '</think>'",
        ),
        (
            ["--reasoning-parser", "granite", "--reasoning-config", '{"reasoning_end_str": "x"}'],
            "phrases, not tokens",
        ),
        (["--default-chat-template-kwargs", "true"], "JSON object"),
    ],
)
def test_bad_reasoning_settings_are_one_line_and_exit_2(think_model, flags, says):
    lines = serve_error("--model", think_model, *flags)
    assert says in lines[-1] and sum("error" in line for line in lines) == 1, lines


def test_speculation_never_changes_an_output_under_a_thinking_budget(think_model):
    """n-gram drafts are verified token by token, each by the same rule: the forced closing
    tokens come out the same with speculation on (drafts accepted) as off."""
    from pagedkv import LLM, SamplingParams

    prompts = ["Hello world! " * 3, "The quick brown fox " * 4, "Paged attention keeps "]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_token_budget=5)
    outputs = {}
    for spec in ("auto", "off"):
        llm = LLM(
            think_model, reasoning_parser="deepseek_r1", speculative_config=spec, block_size=4
        )
        outputs[spec] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if spec == "auto":  # (the repeated prompts give drafts on any CPU's rounding)
            assert llm.engine.spec_stats.num_drafts > 0
        end_id = llm.engine.reasoning.end_id
    assert outputs["auto"] == outputs["off"]
    assert all(ids[5] == end_id for ids in outputs["off"])
