"""vLLM's request fields through a real server: each honoured field has the effect it names, and a
field pagedkv does not implement is a 400 that names it.
"""

from __future__ import annotations

import openai
import pytest
from server_process import TINY_SERVER, ServerProcess, serve_error

from pagedkv.engine.logits_processors import completing_tokens
from pagedkv.engine.request import SamplingParams
from pagedkv.model.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog."


pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        *TINY_SERVER,
        "--max-model-len",
        "1024",
        "--trust-request-chat-template",
        "--response-role",
        "model",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_model_dir)


def complete(client, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    extra = {
        k: kw.pop(k)
        for k in list(kw)
        if k
        not in (
            "max_tokens",
            "temperature",
            "seed",
            "echo",
            "logprobs",
            "stream",
            "stop",
            "n",
            "logit_bias",
        )
    }
    return client.completions.create(model="tiny", prompt=prompt, extra_body=extra or None, **kw)


def ids_of(choice) -> list[int]:
    """The output token ids, read from logprobs with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


# ---------------------------------------------------------------- token rules


def test_logit_bias_forces_a_token(client):
    r = complete(client, logit_bias={"300": 100}, logprobs=0, return_tokens_as_token_ids=True)
    assert ids_of(r.choices[0]) == [300] * 8


def test_allowed_token_ids_restrict_sampling(client):
    allowed = [100, 200, 300]
    for seed in range(3):
        r = complete(
            client,
            temperature=1.0,
            seed=seed,
            max_tokens=16,
            allowed_token_ids=allowed,
            logprobs=0,
            return_tokens_as_token_ids=True,
        )
        assert set(ids_of(r.choices[0])) <= set(allowed)


def test_bad_words_are_never_completed(client, tok):
    word = "quick"
    forced = set(
        tok.encode(word, add_special_tokens=False)
        + tok.encode(" " + word, add_special_tokens=False)
    )
    bias = {str(t): 100 for t in forced}
    assert word in complete(client, logit_bias=bias, max_tokens=12).choices[0].text
    assert (
        word
        not in complete(client, logit_bias=bias, max_tokens=12, bad_words=[word]).choices[0].text
    )


def test_allowed_token_ids_all_forbidden_is_400(client, tok):
    """Every allowed token banned (by a one-token bad word, or as EOS/stop before min_tokens):
    nothing could be drawn, and the sampler returned tokens outside the list with NaN logprobs."""
    word, t = next(
        (w, t)
        for t in range(100, 2000)
        if (w := tok.decode([t])).isalpha() and tok.encode(w, add_special_tokens=False) == [t]
    )
    eos = sorted(tok.eos_token_ids)
    for extra in (
        {"allowed_token_ids": [t], "bad_words": [word]},
        {"allowed_token_ids": eos, "min_tokens": 2},
        {"allowed_token_ids": [*eos, 300], "min_tokens": 2, "stop_token_ids": [300]},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, temperature=1.0, seed=0, **extra)
        assert "allowed_token_ids" in e.value.message
    # one token left, or EOS allowed from the start: fine
    r = complete(
        client,
        allowed_token_ids=[t, 300],
        bad_words=[word],
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    assert set(ids_of(r.choices[0])) == {300}
    complete(client, allowed_token_ids=eos, min_tokens=2, ignore_eos=True)


def test_completing_tokens_follows_vllm():
    assert completing_tokens([5, 6], [[7]]) == [7]  # one token: always banned
    assert completing_tokens([5, 6], [[6, 8], [5, 9]]) == [8]  # only where the rest ends the output
    assert completing_tokens([], [[1, 2]]) == []


# ---------------------------------------------------------------- text


def test_echo_prepends_the_prompt(client, tok):
    plain = complete(client).choices[0].text
    assert complete(client, echo=True).choices[0].text == PROMPT + plain
    ids = tok.encode(PROMPT)
    assert complete(client, prompt=ids, echo=True).choices[0].text == tok.decode(ids) + plain
    chunks = list(complete(client, echo=True, stream=True))
    assert (
        chunks[0].choices[0].text == PROMPT
        and "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    )


def test_echo_with_logprobs_scores_the_prompt_too(client, tok):
    r = complete(client, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n_prompt = len(tok.encode(PROMPT))
    assert (
        len(lp.tokens) == n_prompt + 8
        and lp.token_logprobs[0] is None
        and lp.top_logprobs[0] is None
    )
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, tok):
    """The legacy way to score text (lm-evaluation-harness): the prompt back with its logprobs,
    nothing generated; the same scores as when a token is generated after it."""
    n_prompt = len(tok.encode(PROMPT))
    r = complete(client, echo=True, logprobs=2, max_tokens=0)
    (choice,) = r.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == n_prompt and choice.logprobs.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n_prompt
    longer = complete(client, echo=True, logprobs=2, max_tokens=1).choices[0].logprobs
    assert choice.logprobs.token_logprobs == longer.token_logprobs[:n_prompt]
    assert choice.logprobs.top_logprobs == longer.top_logprobs[:n_prompt]
    # n choices and token-id prompts alike; streamed: the prompt, then an empty finishing chunk
    ids = tok.encode(PROMPT)
    two = complete(client, prompt=[ids, ids], echo=True, max_tokens=0, n=2)
    assert [c.text for c in two.choices] == [tok.decode(ids)] * 4
    chunks = list(complete(client, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    # without echo there is nothing to return; min_tokens cannot be met
    for kw in ({}, {"min_tokens": 1, "echo": True}):
        with pytest.raises(openai.BadRequestError) as err:
            complete(client, max_tokens=0, **kw)
        assert err.value.body["param"] == ("min_tokens" if kw else "max_tokens")


def test_chat_echo_prepends_the_last_assistant_message(client):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    plain = chat(
        client, msgs, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    echoed = chat(
        client,
        msgs,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    assert echoed.choices[0].message.content == "Well," + plain.choices[0].message.content


def test_the_answer_takes_the_response_role_or_the_last_message_s(client):
    """As vLLM: --response-role names a generated answer's role; without a generation prompt the
    answer goes on the last message, in its role, and echo repeats that message."""
    msgs = [{"role": "user", "content": "Hi"}]
    assert chat(client, msgs).choices[0].message.role == "model"
    chunks = list(chat(client, msgs, stream=True))
    assert chunks[0].choices[0].delta.role == "model"
    on = {"add_generation_prompt": False}
    plain = chat(client, msgs, extra_body=on).choices[0].message
    echoed = chat(client, msgs, extra_body=on | {"echo": True}).choices[0].message
    assert plain.role == echoed.role == "user"
    assert echoed.content == "Hi" + plain.content
    # with a generation prompt the answer is the model's: a user's last message is not echoed
    assert (
        chat(client, msgs, extra_body={"echo": True}).choices[0].message.content
        == chat(client, msgs).choices[0].message.content
    )


def test_include_stop_str_in_output(client):
    text = complete(client, max_tokens=16).choices[0].text
    stop = text[4:7]
    cut = text.find(stop)
    assert complete(client, max_tokens=16, stop=[stop]).choices[0].text == text[:cut]
    shown = complete(client, max_tokens=16, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert shown.text == text[: cut + len(stop)] and shown.finish_reason == "stop"


def test_skip_special_tokens_false_shows_them(client, tok):
    special = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    bias = {str(special[0]): 100}
    assert complete(client, logit_bias=bias, max_tokens=3).choices[0].text == ""
    shown = (
        complete(client, logit_bias=bias, max_tokens=3, skip_special_tokens=False).choices[0].text
    )
    assert shown == "<|im_start|>" * 3
    assert (
        complete(
            client,
            logit_bias=bias,
            max_tokens=3,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )
        .choices[0]
        .text
        == shown
    )


# ---------------------------------------------------------------- prompt


def test_truncate_prompt_tokens_keeps_the_last_n(client, tok):
    ids = tok.encode(PROMPT)
    r = complete(client, truncate_prompt_tokens=5)
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].text == complete(client, prompt=ids[-5:]).choices[0].text


def test_truncation_side_right_keeps_the_first_n(client, tok):
    ids = tok.encode(PROMPT)
    r = complete(client, truncate_prompt_tokens=5, truncation_side="right")
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].text == complete(client, prompt=ids[:5]).choices[0].text
    assert r.choices[0].text != complete(client, truncate_prompt_tokens=5).choices[0].text


def test_truncation_makes_a_too_long_chat_prompt_fit(client):
    long = [{"role": "user", "content": "paged attention keeps blocks " * 200}]
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        chat(client, long)
    r = chat(client, long, extra_body={"truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50


def test_prompt_logprobs_cover_every_prompt_token(client, tok):
    ids = tok.encode(PROMPT)
    first = complete(client, prompt_logprobs=2).choices[0].model_extra["prompt_logprobs"]
    assert len(first) == len(ids) and first[0] is None
    for token, entry in zip(ids[1:], first[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["logprob"] <= 0
    again = complete(
        client, prompt_logprobs=2
    )  # the prefix cache is skipped: every position is scored
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].model_extra["prompt_logprobs"] == first
    r = chat(client, [{"role": "user", "content": "Hi"}], extra_body={"prompt_logprobs": 0})
    assert len(r.model_extra["prompt_logprobs"]) == r.usage.prompt_tokens


# ---------------------------------------------------------------- chat template


def test_chat_template_and_its_kwargs(client, tok):
    template = "{{ greeting }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = chat(
        client,
        [{"role": "user", "content": "there"}],
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hello"}},
    )
    assert r.usage.prompt_tokens == len(tok.encode("Hello:there", add_special_tokens=False))


def test_tokenize_renders_a_chat_as_chat_completions_does(server, client):
    """Tools, documents and a request's template included: /tokenize counts what a chat sends."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for extra in (
        {"tools": tools, "tool_choice": "required"},
        {
            "chat_template": "{{ documents[0]['t'] }}|{{ messages[0]['content'] }}",
            "documents": [{"t": "doc"}],
        },
    ):
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        sent = chat(client, msgs, extra_body=extra).usage.prompt_tokens
        body = {"messages": msgs, **{k: v for k, v in extra.items() if k != "tool_choice"}}
        counted = server.http.post("/tokenize", json=body).json()["count"]
        assert counted == sent


LOOPING = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"


def test_content_parts_reach_a_template_that_loops_over_them(server):
    """--chat-template-content-format auto (the default): a template that loops over a message's
    content gets the parts (a string becomes one), any other a string (parts joined by lines)."""

    def rendered(content, template: str) -> str:
        body = {
            "messages": [{"role": "user", "content": content}],
            "chat_template": template,
            "add_generation_prompt": False,
        }
        r = server.http.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return server.http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd", "cache_control": {}}]
    assert rendered(parts, LOOPING) == "[ab][cd]"
    assert rendered("abcd", LOOPING) == "[abcd]"
    assert rendered(parts, "{{ messages[0]['content'] }}") == "ab\ncd"


def test_auto_finds_a_loop_over_content_in_either_spelling():
    from tiny_model import CHAT_TEMPLATE

    from pagedkv.model.tokenizer import template_content_format

    assert template_content_format(LOOPING) == "openai"
    texts = "m.content | selectattr('type', 'equalto', 'text')"
    assert template_content_format(f"{{% for p in {texts} %}}{{{{ p.text }}}}{{% endfor %}}") == (
        "openai"
    )
    assert template_content_format(CHAT_TEMPLATE) == "string"
    assert template_content_format("{% for %}") == "string"  # broken: reported when rendered


def test_content_format_offline_and_on_the_command_line(tiny_model_dir):
    from pagedkv import LLM
    from pagedkv.config import ConfigError

    llm = LLM(tiny_model_dir, num_gpu_blocks_override=64)
    msgs = [{"role": "user", "content": "hello"}]
    length = "{{ messages[0]['content'] | length }}"  # no loop: auto reads it as "string"
    params = SamplingParams(max_tokens=1)
    (out,) = llm.chat(msgs, params, chat_template=length, chat_template_content_format="openai")
    assert out.prompt_token_ids == tok_ids(tiny_model_dir, "1")  # one part
    (out,) = llm.chat(msgs, params, chat_template=length)
    assert out.prompt_token_ids == tok_ids(tiny_model_dir, "5")  # five characters
    with pytest.raises(ConfigError, match="chat_template_content_format must be one of"):
        llm.chat(msgs, params, chat_template_content_format="text")
    llm.close()
    lines = serve_error("--model", tiny_model_dir, "--chat-template-content-format", "text")
    assert len(lines) == 1 and "invalid choice: 'text'" in lines[0], lines


def tok_ids(model_dir: str, text: str) -> list[int]:
    return Tokenizer.from_hf_folder(model_dir).encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "template, words",
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),  # jinja's sandbox refuses
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ raise_exception('no system role') }}", "no system role"),
    ],
)
def test_a_template_that_fails_as_it_runs_is_a_400(server, client, template, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "hi"}], extra_body={"chat_template": template})
    assert "chat template" in e.value.message and words in e.value.message
    assert e.value.body["param"] == "chat_template"
    assert "Traceback" not in server.output()


def test_documents_reach_the_template(client, tok):
    template = "{% for d in documents %}{{ d['title'] }};{% endfor %}{{ messages[0]['content'] }}"
    r = chat(
        client,
        [{"role": "user", "content": "hi"}],
        extra_body={
            "chat_template": template,
            "documents": [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}],
        },
    )
    assert r.usage.prompt_tokens == len(tok.encode("A;B;hi", add_special_tokens=False))


def test_add_generation_prompt_and_continue_final_message(client, tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    with_prompt = chat(client, msgs[:1]).usage.prompt_tokens
    without = chat(
        client, msgs[:1], extra_body={"add_generation_prompt": False}
    ).usage.prompt_tokens
    assert with_prompt - without == len(
        tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    )
    cont = chat(
        client, msgs, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    full = tok.apply_chat_template(msgs, add_generation_prompt=False)
    expected = full[: full.rindex("The answer is") + len("The answer is")]
    assert cont.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))


def test_request_id_names_the_response(client):
    assert complete(client, request_id="abc123").id == "cmpl-abc123"


# ---------------------------------------------------------------- rejected


@pytest.mark.parametrize(
    "field, value",
    [
        ("priority", 1),
        ("logits_processors", ["x"]),
        ("kv_transfer_params", {}),
        ("vllm_xargs", {"a": 1}),
        ("length_penalty", 0.5),
        ("mm_payload", {}),
        ("media_io_kwargs", {}),
        ("ec_transfer_params", {}),
        ("watermarking", True),
        ("return_token_offsets", True),
        ("return_mm_kwargs", False),
        ("routed_experts_prompt_start", 2),
    ],
)
def test_unsupported_fields_are_400_naming_them(server, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.http.post(path, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            {"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
            "--enable-auto-tool-choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"best_of": 3}, "best_of"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"messages": []}}, "messages"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "'chat_template'"),
        ({"chat_template": "{% for %}"}, "chat template"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"allowed_token_ids": [10**6]}, "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logprob_token_ids": [1, 2]}, "logprob_token_ids requires logprobs"),
        ({"logprob_token_ids": [], "logprobs": True}, "logprob_token_ids"),
        ({"logprob_token_ids": [10**6], "logprobs": True}, "outside the vocabulary"),
        ({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, "min_count"),
        ({"repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 2}}, "min_pattern"),
        ({"truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_bad_chat_fields_are_400(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "hi"}], extra_body=extra)
    assert words in e.value.message


def test_offline_llm_takes_the_new_sampling_fields(tiny_model_dir, one_torch_thread):
    from pagedkv import LLM

    llm = LLM(tiny_model_dir, num_gpu_blocks_override=128, block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)
    outs = llm.generate(
        [ids, ids, ids],
        [
            SamplingParams(max_tokens=4, temperature=0, logit_bias={300: 100.0}),
            SamplingParams(max_tokens=6, temperature=1.0, seed=1, allowed_token_ids=[7, 8]),
            SamplingParams(
                max_tokens=2, temperature=0, truncate_prompt_tokens=3, prompt_logprobs=1
            ),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == [300] * 4
    assert set(outs[1].outputs[0].token_ids) <= {7, 8}
    assert outs[2].prompt_token_ids == ids[-3:] and len(outs[2].prompt_logprobs) == 3


def test_return_token_ids_gives_the_prompt_s_and_the_output_s(server, client):
    """vLLM's return_token_ids: token ids beside the text; a stream sends each chunk's new ones,
    and the prompt's once (a completion choice's first chunk, chat's role chunk)."""
    ids = {"return_token_ids": True}
    prompt_ids = server.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    full = complete(client, **ids).choices[0]
    assert full.prompt_token_ids == prompt_ids and len(full.token_ids) == 8
    chunks = list(complete(client, stream=True, **ids))
    assert [t for c in chunks for t in c.choices[0].token_ids] == full.token_ids
    assert [c.choices[0].prompt_token_ids for c in chunks if c.choices[0].prompt_token_ids] == [
        prompt_ids
    ]
    assert getattr(complete(client).choices[0], "token_ids", None) is None

    msgs = [{"role": "user", "content": "Hi"}]
    answer = chat(client, msgs, extra_body=ids)
    rendered = server.http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert answer.prompt_token_ids == rendered
    assert len(answer.choices[0].token_ids) == answer.usage.completion_tokens
    streamed = list(chat(client, msgs, extra_body=ids, stream=True))
    assert streamed[0].prompt_token_ids == rendered
    assert [t for c in streamed for t in (c.choices[0].token_ids or [])] == answer.choices[
        0
    ].token_ids


def _chunk_tokens(client, **extra) -> tuple[list[int], str]:
    """A streamed completion's tokens per chunk (those with any), and its whole text."""
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=13, temperature=0, logprobs=0, stream=True,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    counts, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs and c.logprobs.tokens:
                counts.append(len(c.logprobs.tokens))
    return counts, text


def test_stream_interval_batches_the_tokens_of_each_chunk(client, tiny_model_dir):
    """vLLM's stream_interval (a request's, over the server's --stream-interval): every chunk but
    the first and the last carries at least that many tokens; the text is unchanged."""
    want = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=13, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text  # fmt: skip
    counts, text = _chunk_tokens(client, stream_interval=4)
    assert text == want and sum(counts) == 13
    assert all(n >= 4 for n in counts[1:-1]) and len(counts) <= 5, counts
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        _chunk_tokens(client, stream_interval=0)
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--stream-interval", "3") as srv:
        other = srv.openai()
        for extra in ({}, {"stream_interval": 2}):  # a request's lower one is raised to 3
            counts, text = _chunk_tokens(other, **extra)
            assert text == want and all(n >= 3 for n in counts[1:-1]), (extra, counts)
    assert "--stream-interval must be" in serve_error("--stream-interval", "0")[-1]


# ---------------------------------------------------------------- vLLM 0.32's newer fields


def test_logprob_token_ids_give_those_tokens_logprobs(client):
    """Each output token's logprobs of the asked tokens (in their order), instead of the top
    ones: the values a top_logprobs list gives the same tokens."""
    ids = {"return_tokens_as_token_ids": True}
    hi = [{"role": "user", "content": "hi"}]
    full = chat(client, hi, logprobs=True, top_logprobs=20, extra_body=ids).choices[0]
    tops = [{t.token: t.logprob for t in item.top_logprobs} for item in full.logprobs.content]
    asked = [int(t.removeprefix("token_id:")) for t in list(tops[0])[:3]][::-1] + [5]
    r = chat(client, hi, logprobs=True, extra_body={"logprob_token_ids": asked, **ids})
    names = [f"token_id:{t}" for t in asked]
    for item, ref, top in zip(r.choices[0].logprobs.content, full.logprobs.content, tops):
        assert [t.token for t in item.top_logprobs] == names
        assert item.token == ref.token and item.logprob == pytest.approx(ref.logprob, abs=1e-5)
        for t in item.top_logprobs:
            if t.token in top:
                assert t.logprob == pytest.approx(top[t.token], abs=1e-5)
    first = {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}
    assert all(first[n] == pytest.approx(tops[0][n], abs=1e-5) for n in names[:3])
    c = complete(client, logprob_token_ids=asked, **ids)
    assert all(list(d) == names for d in c.choices[0].logprobs.top_logprobs)


def test_repetition_detection_follows_vllm():
    from pagedkv.engine.request import RepetitionDetection

    spec = RepetitionDetection(max_pattern_size=3, min_pattern_size=2, min_count=3)
    assert spec.repeats([9, 1, 2, 1, 2, 1, 2])  # (1, 2) three times
    assert not spec.repeats([1, 2, 1, 2, 9, 1, 2])  # not in a row
    assert not spec.repeats([5, 5, 5])  # a pattern of 1 is below min_pattern_size
    assert spec.repeats([4, 5, 6, 4, 5, 6, 4, 5, 6])
    assert not RepetitionDetection().repeats([7] * 10)  # off


def test_repetition_detection_ends_a_looping_output(client):
    """A token forced by logit_bias comes again and again: the output ends once it came
    min_count times (finish_reason "repetition", stop_reason "repetition_detected", as vLLM's),
    not before min_tokens; without the field it runs to max_tokens."""
    forced = {"logit_bias": {"7": 100}, "ignore_eos": True, "max_tokens": 16}
    assert complete(client, **forced).usage.completion_tokens == 16
    spec = {"max_pattern_size": 2, "min_count": 4}
    r = complete(client, **forced, repetition_detection=spec)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "repetition"
    assert r.choices[0].model_extra["stop_reason"] == "repetition_detected"
    late = complete(client, **forced, repetition_detection=spec, min_tokens=9)
    assert late.usage.completion_tokens == 9


def test_return_prompt_text_gives_the_templated_prompt(server, client, tok):
    messages = [{"role": "user", "content": "hi"}]
    r = server.http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2, "return_prompt_text": True},
    ).json()
    rendered = server.http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert tok.encode(r["prompt_text"], add_special_tokens=False) == rendered["tokens"]
    assert r["prompt_text"].endswith("<|im_start|>assistant\n")  # (the generation prompt)
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "stream": True}
    with server.http.stream(
        "POST", "/v1/chat/completions", json={**body, "return_prompt_text": True}
    ) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    texts = [line for line in chunks if '"prompt_text":"' in line]
    assert len(texts) == 1  # (the first chunk's; the others leave it out, null or not)
    assert sum('"prompt_text"' in line or '"prompt_token_ids"' in line for line in chunks) == 1
