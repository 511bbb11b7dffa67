"""A vLLM user switches by changing the command name: vLLM's flags, endpoints and Python API.

CLI flags run as real subprocesses (exit 0 + a note, or one line + exit 2);
endpoints run against a real `pagedkv serve` with the openai client and httpx;
the Python API runs the tiny random model. The README's examples are checked
against the default model's served name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_process import REPO, ServerProcess

from pagedkv import LLM, AsyncEngineArgs, AsyncLLMEngine, Logprob, SamplingParams
from pagedkv.config import ConfigError, EngineConfig, default_model_path, model_display_name

CLI = [sys.executable, "-m", "pagedkv.cli"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!{% endif %}"
)
NOOP_FLAGS = [
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--disable-log-requests",
    "--enable-prompt-tokens-details",
    "--calculate-kv-scales",
    "--disable-cascade-attn",
    "--no-use-tqdm-on-load",
    "--disable-hybrid-kv-cache-manager",
    "--language-model-only",  # (vLLM 0.32's, for a multimodal model's text part)
    "--numa-bind",
    "--log-error-stack",
    "--enable-offline-docs",
]
NOOP_VALUES = {  # flags with a value, as deployments write them
    "--cpu-offload-gb": "4",
    "--model-impl": "auto",
    "--max-parallel-loading-workers": "2",
    "--hf-token": "hf_abc",
    "--tokenizer-revision": "main",
    "--api-server-count": "2",
    "--cudagraph-capture-sizes": "8",
    "--prefix-caching-hash-algo": "xxhash",
    "--show-hidden-metrics-for-version": "0.9",
}


def cli(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env={**ENV, **env}, cwd=REPO, timeout=timeout
    )


# ---- command line ---------------------------------------------------------------------------------


def test_vllm_flags_accepted_with_notes(tiny_model_dir, tmp_path):
    """The issue's rejected command line now runs; each flag without meaning here says so on stderr."""
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    r = cli(
        "generate",
        tiny_model_dir,
        "--prompt",
        "hi",
        "--chat",
        "--max-tokens",
        "2",
        "--json",
        "--gpu-memory-utilization",
        "0.5",
        "--kv-cache-memory-bytes",
        "8MiB",
        "--seed",
        "1",
        *NOOP_FLAGS,
        *(x for flag_value in NOOP_VALUES.items() for x in flag_value),
        "--tokenizer",  # as vLLM's GGUF guide writes it: the base model's tokenizer
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        "-O3",
        "--guided-decoding-backend",
        "xgrammar",
        "--enforce-eager",  # (has a meaning here: no decode graphs)
        "--disable-sliding-window",  # (and here: the model has none)
        "-tp",
        "1",
        "--served-model-name",
        "a",
        "b",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--dtype",
        "half",
        "--max-model-len",
        "1k",
        "--swap-space",
        "1",
        "--chat-template",
        str(template),
        "--generation-config",
        "vllm",
        "--max-num-seqs",
        "8",
        "--enable-log-requests",  # (a server's: generate logs no requests)
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["output_token_ids"]) == 2
    notes = [line for line in r.stderr.splitlines() if line.startswith("pagedkv: note:")]
    assert [n.split()[2] for n in notes] == [
        *NOOP_FLAGS,
        *NOOP_VALUES,
        "--tokenizer",
        "-O",
        "--guided-decoding-backend",
        "--served-model-name",  # a server's name for the model: generate serves none
        "--enable-log-requests",
    ]
    assert all("no effect" in n for n in notes)


@pytest.mark.parametrize(
    "args,message",
    [
        (["-tp", "0"], "--tensor-parallel-size must be a positive integer"),
        (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4"),
        (["--max-model-len", "1.0001k"], "--max-model-len"),
        (["--max-model-len", "lots"], "--max-model-len"),
        (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
        (["--dtype", "float64"], "--dtype"),
        (["--swap-space", "-1"], "--swap-space"),
        (["--swap-space", "4 parsecs"], "size"),
        (["--allowed-origins", "*"], "--allowed-origins must be a JSON list"),
        (["--allowed-methods", '["GET", 1]'], "--allowed-methods"),
        (["--chat-template", "missing.jinja"], "--chat-template"),
        (["--generation-config", "/no/such/folder"], "--generation-config"),
        (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
        (["--served-model-name"], "--served-model-name"),
        (["--model", "/a.gguf", "/b.gguf"], "two models"),
        (["--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
        (["--api-key", ""], "--api-key is empty"),  # `--api-key "$KEY"` with KEY unset
        (["--api-key", " "], "--api-key is empty"),
        (["--api-key", "key "], "--api-key must be printable ASCII"),  # a header drops the space
        (["--api-key", "clé"], "--api-key must be printable ASCII"),
        (["--api-key", "a\nb"], "--api-key must be printable ASCII"),
        (["--kv-cache-mem", "1GiB"], "unrecognized arguments: --kv-cache-mem"),  # no abbreviations
        (["--kv-offload-dir", ""], "--kv-offload-dir needs a folder"),
        (["--kv-offload-disk-size", "1GiB"], "needs --kv-offload-dir"),
        (["--seed", str(2**64)], "--seed must be an integer in"),  # torch's seed range
        (["--generation-config", ""], "--generation-config"),
        (["--override-generation-config", "{"], "--override-generation-config is not JSON"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (["--override-generation-config", '{"seed": 1}'], "'seed' is not one of temperature"),
        (["--override-generation-config", '{"top_p": 7}'], "generation defaults: top_p must be"),
        (
            ["--shutdown-timeout", "nan"],
            "--shutdown-timeout must be >= 0",
        ),  # `"$DIR"` with DIR unset
        (["--kv-cache-memory", "4096TiB"], "of free memory"),  # an error, not an allocator's trace
        # at start, not as every chat request's 400 (which blamed the client)
        (["--chat-template", "{{% bad"], "--chat-template: chat template does not compile"),
        (["--preemption-mode", "swap", "--swap-space", "1000000"], "of free memory"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--kv-offloading-backend", "lmcache"], "invalid choice: 'lmcache'"),
        (["--kv-offloading-size", "0"], "--kv-offloading-size must be a number of GiB > 0"),
        (["--kv-offloading-size", "1", "--kv-offload-host-memory", "1GiB"], "size one tier"),
        (["--limit-mm-per-prompt", '{"image": 1}'], "takes text only, so image's limit must be 0"),
        (["--limit-mm-per-prompt", "image=0"], "--limit-mm-per-prompt is not JSON"),
        (["--ssl-ciphers", "ECDHE"], "need --ssl-certfile"),
        (["--no-enable-prompt-tokens-details"], "always reported"),
        (["--logprobs-mode", "raw"], "argument --logprobs-mode: invalid choice: 'raw'"),
    ],
)
def test_bad_values_exit_2(args, message):
    r = cli("serve", *args)
    assert r.returncode == 2, r.stderr
    # what a start prints before it fails: notes, progress, the load's log lines
    progress = ("pagedkv: note:", "pagedkv: loading", "INFO: ")
    errors = [line for line in r.stderr.splitlines() if not line.startswith(progress)]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr


def test_vllm_0_32_names_for_what_pagedkv_has():
    """--kv-offloading-size (vLLM's CPU KV offloading, native) is the host tier;
    --device-memory-utilization is --gpu-memory-utilization; every boolean flag has its --no-
    form; --limit-mm-per-prompt with every limit 0 asks for what a text-only server does."""
    from pagedkv.cli import build_parser, engine_config_from_args

    argv = ["serve", "--kv-offloading-size", "0.25", "--device-memory-utilization", "0.5"]
    argv += ["--enable-lora", "--no-enable-lora", "--no-enforce-eager", "--no-allow-credentials"]
    argv += ["--limit-mm-per-prompt", '{"image": 0, "video": {"count": 0}}']
    argv += ["--logprobs-mode", "processed_logits"]
    config = engine_config_from_args(build_parser().parse_args(argv))
    assert config.logprobs_mode == "processed_logits"
    assert config.kv_offload_host_memory == 2**28
    assert config.memory_utilization == 0.5
    assert config.enable_lora is False and config.enforce_eager is False


def test_an_address_it_cannot_listen_on_exits_2_before_the_model_loads(tiny_model_dir):
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a second `pagedkv serve`, say
        port = str(taken.getsockname()[1])
        for host, message in (("127.0.0.1", "Address already in use"), ("999.1.1.1", "")):
            r = cli("serve", tiny_model_dir, "--host", host, "--port", port, timeout=60)
            assert r.returncode == 2, r.stderr
            errors = [line for line in r.stderr.splitlines() if "loading" not in line]
            assert errors == [errors[0]] and f"cannot listen on --host {host}" in errors[0]
            assert message in errors[0] and "Started server process" not in r.stderr


def test_help_shows_vllm_names():
    r = cli("serve", "--help")
    assert r.returncode == 0
    for flag in (
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--served-model-name NAME [NAME ...]",
        "-tp",
        "--chat-template",
        "--generation-config",
        "--allowed-origins",
        "--trust-remote-code",
        "MODEL",
    ):
        assert flag in r.stdout, flag


def test_other_subcommands_keep_the_shared_flags(tiny_model_dir):
    r = cli("bench", "--help")
    assert (
        r.returncode == 0
        and "--gpu-memory-utilization" in r.stdout
        and "--kv-cache-memory" in r.stdout
    )
    r = cli(
        "generate",
        "--model",
        tiny_model_dir,
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--kv-cache-memory",
        "8MiB",
        "--memory-utilization",
        "0.5",
        "--swap-space",
        "64MiB",
    )
    assert r.returncode == 0, r.stderr


def test_generate_takes_the_models_defaults_and_fails_loudly(tiny_model_dir, tmp_path):
    """Unset sampling flags come from generation_config.json (unless --generation-config vllm);
    text that is not valid UTF-8 is one line and exit 2; a request the engine fails is exit 1."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    base = ("generate", str(model), "--prompt", "hi", "--ignore-eos", "--json")
    base += ("--kv-cache-memory", "8MiB")

    def count(*extra: str) -> int:
        r = cli(*base, *extra)
        assert r.returncode == 0, r.stderr
        return len(json.loads(r.stdout)["output_token_ids"])

    assert count() == 3
    r = cli(*base, "--max-tokens", "1", "--block-size", "4")
    out = json.loads(r.stdout)
    prompt = len(out["prompt_token_ids"])  # one step: its K/V is the prompt's, 4 tokens a block
    assert (out["kv"]["tokens_held_peak"], out["kv"]["blocks_used_peak"]) == (
        prompt,
        -(-prompt // 4),
    )
    assert count("--max-tokens", "5") == 5
    assert count("--generation-config", "vllm") == 64
    # --override-generation-config lays its keys over the file's, and applies with 'vllm' too
    over = '{"max_new_tokens": 2}'
    assert count("--override-generation-config", over) == 2
    assert count("--generation-config", "vllm", "--override-generation-config", over) == 2
    r = subprocess.run(
        [*CLI, *base[:2], "--prompt", b"\xff\xfe", *base[4:]],
        capture_output=True,
        env=ENV,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert b"lone surrogate" in r.stderr
    r = subprocess.run(
        [*CLI, *base],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**ENV, "PAGEDKV_INJECT_FAULT": "sample:hi"},
    )
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("pagedkv generate: error:"), r.stderr


def test_units_and_aliases():
    c = EngineConfig(
        model="x.gguf", swap_space=4, max_model_len="32k", dtype="half", kv_cache_dtype="fp8_e4m3"
    )
    assert (c.swap_space_bytes, c.max_model_len, c.dtype, c.kv_cache_dtype) == (
        4 * 2**30,
        32000,
        "float16",
        "fp8",
    )
    assert EngineConfig(max_model_len="32K").max_model_len == 32768
    assert EngineConfig(max_model_len="1M").max_model_len == 2**20
    assert EngineConfig(max_model_len="25.6k").max_model_len == 25600
    assert EngineConfig(swap_space="512MiB").swap_space_bytes == 2**29
    assert EngineConfig().swap_space_bytes == 4 * 2**30  # vLLM's default
    c = EngineConfig.from_options(gpu_memory_utilization=0.5, kv_cache_memory_bytes="1GiB")
    assert (c.memory_utilization, c.kv_cache_memory) == (0.5, 2**30)
    with pytest.raises(ConfigError, match="enable_chunked_prefill=False"):
        EngineConfig.from_options(enable_chunked_prefill=False)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"enable_prefix_caching": "False"}, "enable_prefix_caching must be True or False"),
        ({"enforce_eager": "no"}, "enforce_eager"),
        ({"max_num_seqs": 2.5}, "--max-num-seqs must be a positive integer"),
        ({"max_num_seqs": "8"}, "--max-num-seqs"),
        ({"max_num_batched_tokens": 100.5}, "--max-num-batched-tokens"),
        ({"num_gpu_blocks_override": -5}, "--num-gpu-blocks-override"),
        ({"block_size": True}, "--block-size"),
        ({"max_model_len": True}, "--max-model-len"),
        ({"memory_utilization": True}, "--gpu-memory-utilization"),
        ({"kv_cache_memory": float("inf")}, "invalid size"),
        ({"kv_offload_host_memory": float("nan")}, "invalid size"),
        ({"swap_space": float("inf")}, "--swap-space"),
        ({"seed": 2**64}, "--seed must be an integer in"),
        ({"seed": -(2**63) - 1}, "--seed"),
        ({"generation_config": ""}, "--generation-config"),
        ({"generation_config": 3}, "--generation-config must be a string or a path"),
        ({"chat_template": 3}, "--chat-template must be a string or a path"),
        ({"kv_offload_dir": b"/tmp/tier"}, "--kv-offload-dir must be a string or a path"),
        ({"logprobs_mode": "processed"}, "--logprobs-mode must be one of raw_logprobs, raw_logits"),
    ],
)
def test_options_of_the_wrong_type_or_range_are_config_errors(options, words):
    """The Python API takes what the command line's parser would have refused: checked alike."""
    with pytest.raises(ConfigError, match=re.escape(words)):
        EngineConfig(model="x.gguf", **options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"swap_space": 1},
        {"swap_space": "512MiB", "max_model_len": "32k", "kv_cache_memory": "1GiB"},
        {
            "swap_space": 0.5,
            "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
        },
    ],
)
def test_config_revalidated_is_unchanged(options):
    """dataclasses.replace runs __post_init__ again: nothing it parses may be parsed twice."""
    c = EngineConfig(model="x.gguf", **options)
    again = dataclasses.replace(c)
    assert again == c
    assert dataclasses.replace(again, block_size=32).swap_space_bytes == c.swap_space_bytes
    assert c.swap_space == options.get("swap_space", 4)  # the user's value, kept as given


def test_default_served_name():
    assert model_display_name(None) == "SmolLM2-135M-Instruct"
    assert EngineConfig().served_model_names == ["SmolLM2-135M-Instruct"]
    assert model_display_name(str(default_model_path())) == "SmolLM2-135M-Instruct"
    assert (
        model_display_name("/m/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf") == "Meta-Llama-3-8B-Instruct"
    )
    assert model_display_name("/m/tinyllama-1.1b.f16.gguf") == "tinyllama-1.1b"
    assert model_display_name("/models/SmolLM2-135M") == "SmolLM2-135M"
    c = EngineConfig(served_model_name=["a", "b"])
    assert c.served_model_names == ["a", "b"]
    assert dataclasses.replace(c, block_size=32).served_model_names == ["a", "b"]  # all kept


# ---- the server: names, utility endpoints, CORS ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess(
        None,
        tiny_model_dir,
        "--num-gpu-blocks-override",
        "128",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--chat-template",
        str(template),
        "--allowed-origins",
        '["https://ok.example"]',
        "--allowed-methods",
        '["GET", "POST"]',
        "--disable-log-requests",
    ) as srv:
        yield srv


def test_served_names_and_positional_model(server):
    assert "--disable-log-requests has no effect" in server.output()
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    out = client.completions.create(model="tiny-alias", prompt="Hello", max_tokens=3, temperature=0)
    assert out.model == "tiny" and out.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hello", max_tokens=1)


def test_tokenize_detokenize(server):
    http = server.http
    r = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    back = http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    # messages go through the --chat-template given, with chat_template_kwargs
    msgs = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"shout": True}})
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "<user>Hi\n<assistant>!"
    # any key is a template variable, even one that is a Python keyword argument's name
    r = http.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"self": 1}})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    r = http.post(
        "/tokenize",
        json={
            "messages": [*msgs, {"role": "assistant", "content": "Par"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert (
        http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        == "<user>Hi\n<assistant>Par"
    )


def test_a_huge_tokenize_leaves_the_server_answering(server):
    """Megabytes of prompt take seconds to tokenize, the token strings and the answer's JSON
    included: /health must be answered meanwhile, so none of it may run on the event loop."""
    body = {"prompt": "Paged attention keeps blocks. " * 250_000, "return_token_strs": True}
    waits: list[float] = []
    began = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{server.url}/tokenize", json=body, timeout=300)
        while not big.done():
            start = time.monotonic()
            assert server.http.get("/health").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.01)
        r = big.result()
    took = time.monotonic() - began
    assert r.status_code == 200, r.text[:300]
    answer = r.json()
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"]) > 1_000_000
    assert answer["token_strs"][1:4] == [
        server.http.post("/detokenize", json={"tokens": [t]}).json()["prompt"]
        for t in answer["tokens"][1:4]
    ]
    # a share of the request's own time, so that a slow machine passes too (measured: 0.015-0.02 of
    # it; 0.035-0.12 while the encoder's offsets were freed holding the GIL, 0.11-0.14 when the
    # token strings were decoded on the event loop)
    assert len(waits) > 10 and max(waits) < took / 12, (
        f"/health waited {max(waits):.2f}s of {took:.2f}s"
    )


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, None),
        (
            "/tokenize",
            {
                "messages": [{"role": "user", "content": "b"}],
                "chat_template_kwargs": {"messages": []},
            },
            None,
        ),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400(server, path, body, param):
    # sent as JSON text with escapes: httpx cannot encode a lone surrogate itself
    r = server.http.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]
    assert server.http.post(path, content=b"{not json").status_code == 400
    assert server.http.post("/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


def test_version_ping_health(server):
    http = server.http
    assert http.get("/version").json()["version"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    r = http.head("/health")
    assert r.status_code == 200 and r.content == b""


def test_cors(server):
    preflight = {
        "Origin": "https://ok.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    r = server.http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    r = server.http.options(
        "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = server.http.get("/v1/models", headers={"Origin": "https://ok.example"})
    assert r.headers["access-control-allow-origin"] == "https://ok.example"
    r = server.http.post(  # a page's script may read which fields were dropped
        "/tokenize", json={"prompt": "hi", "x": 1}, headers={"Origin": "https://ok.example"}
    )
    assert r.headers["x-pagedkv-ignored-fields"] == "x"
    assert "x-pagedkv-ignored-fields" in r.headers["access-control-expose-headers"].lower()


def test_chat_uses_the_given_template(server):
    client = server.openai()
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    want = len(
        server.http.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
        ).json()["tokens"]
    )
    assert out.usage.prompt_tokens == want


@pytest.mark.slow
def test_readme_examples_work_as_written():
    """The README's curl and openai examples, against `pagedkv serve` with the default model."""
    readme = (REPO / "README.md").read_text()
    names = set(re.findall(r'"model": "([^"]+)"', readme)) | set(
        re.findall(r'model="([^"]+)"', readme)
    )
    assert names == {"SmolLM2-135M-Instruct"}
    with ServerProcess(None, "--kv-cache-memory", "64MiB") as srv:
        client = srv.openai()
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        chat = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Say hello"}],
            max_tokens=8,
        )
        assert (
            chat.choices[0].message.content and chat.usage.prompt_tokens_details.cached_tokens >= 0
        )
        beams = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            n=3,
            max_tokens=16,
            extra_body={"use_beam_search": True},
        )
        assert len(beams.choices) == 3 and beams.choices[0].text
        answer = client.responses.create(
            model="SmolLM2-135M-Instruct",
            instructions="Answer in one sentence.",
            input="What is the capital of France?",
            max_output_tokens=32,
        )
        follow = client.responses.create(
            model="SmolLM2-135M-Instruct",
            previous_response_id=answer.id,
            input="And of Italy?",
            max_output_tokens=32,
        )
        whole = client.responses.create(
            model="SmolLM2-135M-Instruct",
            input=[
                {"role": "user", "content": "What is the capital of France?"},
                answer.output[0].model_dump(exclude_none=True),
                {"role": "user", "content": "And of Italy?"},
            ],
            max_output_tokens=1,
        )
        assert answer.output_text and follow.output_text
        assert follow.usage.input_tokens == whole.usage.input_tokens
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Once upon a time",
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


# ---- Python API -----------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        model=tiny_model_dir,
        gpu_memory_utilization=0.5,
        seed=0,
        max_model_len="1k",
        dtype="float32",
        kv_cache_dtype="auto",
        swap_space=1,
        enable_prefix_caching=True,
        block_size=16,
        max_num_seqs=8,
        tensor_parallel_size=1,
        enforce_eager=True,
        trust_remote_code=True,
        num_gpu_blocks_override=128,
    )


def test_llm_engine_args(llm, tiny_model_dir):
    assert llm.engine.max_model_len == 1000 and llm.engine.config.swap_space_bytes == 2**30
    with pytest.raises(ConfigError, match="pipeline-parallel-size 2"):
        LLM(model=tiny_model_dir, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(model=tiny_model_dir, speculative_model="x")


def test_llm_takes_a_torch_dtype_and_notes_serve_only_options(tiny_model_dir, capfd):
    import torch

    llm = LLM(model=tiny_model_dir, dtype=torch.bfloat16, num_gpu_blocks_override=16, max_waiting=1)
    assert llm.engine.config.dtype == "bfloat16"
    assert "max_waiting has no effect in LLM" in capfd.readouterr().err


def test_generate_prompt_forms(llm):
    ids = llm.get_tokenizer().encode("The quick brown fox")
    by_text = llm.generate("The quick brown fox", sampling_params=GREEDY, use_tqdm=False)[0]
    forms = llm.generate(
        [{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}, ids],
        sampling_params=[GREEDY, GREEDY, GREEDY],
        use_tqdm=False,
    )
    assert by_text.prompt_token_ids == ids and by_text.prompt == "The quick brown fox"
    assert all(o.outputs[0].token_ids == by_text.outputs[0].token_ids for o in forms)
    assert forms[1].prompt_token_ids == ids
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ConfigError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY)
    with pytest.raises(ConfigError, match="'prompt_token_ids' must be a list of ints"):
        llm.generate({"prompt_token_ids": "Hello"}, GREEDY)  # not run as text
    with pytest.raises(ConfigError, match="'prompt' must be a string"):
        llm.generate({"prompt": ids}, GREEDY)  # not run as token ids
    with pytest.raises(ConfigError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY])
    with pytest.raises(ConfigError, match="lora_request"):
        llm.generate("x", GREEDY, lora_request=object())
    assert llm.generate("x", GREEDY, use_tqdm=False, lora_request=None)[
        0
    ].finished  # None: not used


def test_output_shapes(llm):
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    out = llm.generate("Hello world", p, use_tqdm=False)[0]
    assert out.finished and out.num_cached_tokens >= 0 and out.prompt_logprobs is None
    c = out.outputs[0]
    assert c.finished() and c.finish_reason == "length" and c.stop_reason is None
    assert isinstance(c.logprobs, list) and len(c.logprobs) == 5
    tok = llm.get_tokenizer()
    for step, t in zip(c.logprobs, c.token_ids):
        assert (
            isinstance(step, dict)
            and t in step
            and all(isinstance(v, Logprob) for v in step.values())
        )
        assert step[t].rank == 1 and step[t].decoded_token == tok.decode(
            [t], skip_special_tokens=False
        )
    assert c.cumulative_logprob == pytest.approx(
        sum(s[t].logprob for s, t in zip(c.logprobs, c.token_ids))
    )
    plain = llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_seed_seeds_sampling(tiny_model_dir):
    sample = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=tiny_model_dir, seed=seed, num_gpu_blocks_override=64, dtype="float32")
        return [
            o.outputs[0].token_ids for o in llm.generate(["Hello", "Hi"], sample, use_tqdm=False)
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_chat_options(llm):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Par"}]
    cont = llm.chat(
        msgs,
        sampling_params=GREEDY,
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    assert (
        llm.get_tokenizer().decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("Par")
    )
    normal = llm.chat(
        msgs[:1], sampling_params=GREEDY, use_tqdm=False, chat_template_kwargs={"unused": 1}
    )[0]
    assert normal.outputs[0].token_ids
    with pytest.raises(ConfigError, match="cannot both be true"):
        llm.chat(msgs, GREEDY, continue_final_message=True)
    # OpenAI content parts are joined by newlines, as the server joins them
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}
    ]
    joined = llm.chat([{"role": "user", "content": "H\ni"}], GREEDY, use_tqdm=False)[0]
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == joined.prompt_token_ids
    with pytest.raises(ConfigError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY)
    own = llm.chat(  # offline, the caller's own template runs (no server to protect)
        msgs[:1], GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!"
    )[0]
    assert own.prompt_token_ids == llm.get_tokenizer().encode("Hi!", add_special_tokens=False)


def model_with_generation_config(tiny_model_dir: str, folder: Path, config: dict) -> str:
    folder.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_generation_config_defaults(tiny_model_dir, tmp_path):
    folder = model_with_generation_config(
        tiny_model_dir, tmp_path / "model", {"temperature": 0.0, "max_new_tokens": 3}
    )
    auto = LLM(model=str(folder), num_gpu_blocks_override=64)
    p = auto.get_default_sampling_params()
    assert (p.temperature, p.max_tokens) == (0.0, 3)
    assert len(auto.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) <= 3
    off = LLM(model=str(folder), num_gpu_blocks_override=64, generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()
    # a folder of defaults may be a Path, as the model may
    other = LLM(model=Path(folder), generation_config=Path(folder), num_gpu_blocks_override=64)
    assert other.get_default_sampling_params().max_tokens == 3


def test_server_applies_generation_config_to_what_requests_leave_out(tiny_model_dir, tmp_path):
    folder = model_with_generation_config(
        tiny_model_dir, tmp_path / "model", {"temperature": 0.0, "max_new_tokens": 3}
    )
    with ServerProcess(folder, "--num-gpu-blocks-override", "64") as srv:
        client = srv.openai()
        msgs = [{"role": "user", "content": "Hi"}]
        no_eos = {"ignore_eos": True}
        runs = [
            client.chat.completions.create(model="model", messages=msgs, extra_body=no_eos)
            for _ in range(2)
        ]
        assert [r.usage.completion_tokens for r in runs] == [3, 3]  # max_new_tokens
        assert (
            runs[0].choices[0].message.content == runs[1].choices[0].message.content
        )  # temperature 0
        longer = client.chat.completions.create(
            model="model", messages=msgs, max_tokens=5, extra_body=no_eos
        )
        assert longer.usage.completion_tokens == 5  # the request's own value wins


def test_async_engine(tiny_model_dir, llm):
    want = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> list:
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=tiny_model_dir, dtype="float32", num_gpu_blocks_override=64)
        )
        outs = []
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
        async for out in engine.generate({"prompt": "The quick brown fox"}, p, request_id="r1"):
            outs.append(out)
        with pytest.raises(ConfigError):
            async for _ in engine.generate({"bogus": 1}, p, request_id="r2"):
                pass
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finished and not outs[0].finished and last.outputs[0].token_ids == want
    assert len(last.outputs[0].logprobs) == 6 and all(
        isinstance(d, dict) for d in last.outputs[0].logprobs
    )


def test_a_slow_reader_gets_the_latest_output_not_a_backlog(tiny_model_dir):
    """Outputs are cumulative: one not yet read is replaced by the next, as in vLLM, so a reader
    that lags (a slow client, a busy event loop) costs memory linear in the output, not one copy
    of it per token."""

    async def main() -> list:
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=tiny_model_dir, dtype="float32", num_gpu_blocks_override=64)
        )
        p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
        outs = engine.generate("The quick brown fox", p, request_id="slow")
        first = await anext(outs)
        while engine._llm.engine.has_unfinished():  # the whole answer, unread
            await asyncio.sleep(0.01)
        rest = [out async for out in outs]
        await engine.shutdown()
        return [first, *rest]

    first, *rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) == 40
    assert len(rest[0].outputs[0].logprobs) == 40 and not first.finished


def test_tensor_parallel_size_that_does_not_divide_the_heads_exits_2():
    r = cli("serve", "-tp", "2")  # the default model has 9 attention heads
    assert r.returncode == 2, r.stderr
    assert (
        "does not divide the model's 9 attention heads" in r.stderr and "Traceback" not in r.stderr
    )


def test_a_max_model_len_past_the_models_exits_2(tiny_model_dir):
    """As vLLM refuses it: a longer context than the model's was served shorter, silently."""
    own = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    r = cli("generate", "--model", tiny_model_dir, "--max-model-len", "100000", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "pagedkv generate: error: --max-model-len 100000 exceeds the model's context length "
        f"({own}: max_position_embeddings, or a sliding window)"
    ]
    assert (
        cli(
            "generate",
            "--model",
            tiny_model_dir,
            "--max-model-len",
            str(own),
            "--prompt",
            "x",
            "--max-tokens",
            "2",
        ).returncode
        == 0
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("PAGEDKV_CASCADE", "yes"),  # was read at each step: every request failed
        ("PAGEDKV_KERNELS", "false"),  # only "0" was read: the kernels stayed on
        ("PAGEDKV_CPU_ISA", "sse"),  # was a warning and the torch paths
        ("PAGEDKV_PREPACK", "x"),
        ("PAGEDKV_DENSE_WEIGHTS", "lots"),
    ],
)
def test_a_mistyped_setting_refuses_to_start(tiny_model_dir, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}.*{value}"):
        LLM(tiny_model_dir)


def test_a_mistyped_setting_is_one_line_and_exit_2(tiny_model_dir):
    r = cli("generate", "--model", tiny_model_dir, "--prompt", "x", PAGEDKV_CASCADE="yes")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "pagedkv generate: error: PAGEDKV_CASCADE='yes' is not one of 0, 1, auto"
    ]


def test_generate_with_data_parallel_is_one_error_line(tiny_model_dir):
    """-dp is an error outside serve (one engine cannot be N replicas), not a no-op note first."""
    r = cli("generate", "--model", tiny_model_dir, "-dp", "2", "--prompt", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--data-parallel-size N runs N engine replicas under `pagedkv serve`" in r.stderr


def test_a_chat_template_without_chat_is_noted(tiny_model_dir, tmp_path):
    """generate renders a template only with --chat: without it the template was unused, unsaid."""
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    args = ("generate", tiny_model_dir, "--prompt", "hi", "--max-tokens", "1")
    r = cli(*args, "--chat-template", str(template))
    assert r.returncode == 0 and (
        "pagedkv: note: --chat-template has no effect in pagedkv generate without --chat"
        in r.stderr.splitlines()
    )
    assert "--chat-template" not in cli(*args, "--chat-template", str(template), "--chat").stderr


def test_a_config_file_holds_the_flags_and_the_command_line_wins(tiny_model_dir, tmp_path):
    """vLLM's `--config FILE`: YAML of long flags (dashes or underscores), the model among them."""
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"model: {tiny_model_dir}\n"
        "served-model-name: [tiny, tiny-alias]\n"
        "block_size: 4\n"
        "num-gpu-blocks-override: 64\n"
        "max-model-len: 256\n"
        "enable-prefix-caching: false\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 2}\n"
    )
    with ServerProcess(None, "--config", str(path), "--max-model-len", "128") as srv:
        cards = srv.http.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "tiny-alias"]
        assert cards[0]["max_model_len"] == 128  # the command line's, not the file's 256
        kv = srv.kv()
        assert kv["block_size"] == 4 and kv["num_blocks"] == 64
        assert kv["prefix_caching"] is False  # false: the flag's --no- form
        out = srv.openai().completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("bogus: 1\n", "'bogus' is not a flag of this command"),
        ("enforce-eager: 3\n", "'enforce-eager' wants true or false, got 3"),
        ("max-num-seqs: true\n", "'max-num-seqs' wants a value, not true or false"),
        ("- max-num-seqs\n", "wants a mapping of flags to values"),
        ("a: [\n", "not YAML"),
    ],
)
def test_config_file_mistakes_are_one_line(tmp_path, text, says):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = cli("serve", "--config", str(path), timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"pagedkv serve: error: --config {path}: ")
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_vllms_spec_flags_are_fields_of_the_speculative_config():
    """vLLM 0.32's --spec-method and --spec-tokens fill --speculative-config; a field given both
    ways, a draft model, or speculation turned off beside them is one error line."""
    from pagedkv.cli import build_parser, engine_config_from_args

    def config(*flags: str):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags]))

    spec = config("--spec-method", "ngram", "--spec-tokens", "3").speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.auto) == ("ngram", 3, False)
    spec = config("--spec-tokens", "2", "--speculative-config", '{"prompt_lookup_max": 3}')
    assert (
        spec.speculative_config.num_speculative_tokens,
        spec.speculative_config.prompt_lookup_max,
    ) == (2, 3)
    assert config().speculative_config.auto  # (none given: pagedkv's default)
    for flags, says in [
        (("--spec-model", "some/draft"), "--spec-model: pagedkv drafts by n-gram lookup"),
        (("--spec-tokens", "2", "--speculative-config", "off"), "need speculation on, not 'off'"),
        (
            ("--spec-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 4}'),
            "--spec-tokens and --speculative-config's 'num_speculative_tokens' are mutually",
        ),
        (("--spec-method", "eagle", "--spec-tokens", "2"), "method 'eagle' is not supported"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            config(*flags)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--tool-parser-plugin", "my_parser.py"], "pagedkv's own parsers"),
        (["--logits-processors", "a.B", "c.D"], "its own logits processors only"),
        (["--kv-transfer-config", '{"kv_connector": "X"}'], "no KV transfer between instances"),
        (["--enable-sleep-mode"], "no sleep mode"),
        (["--headless"], "--data-parallel-size with --ray-address"),
        (["--mm-processor-kwargs", "{}"], "pagedkv takes text only"),
    ],
)
def test_vllm_flags_for_what_pagedkv_lacks_say_why(flags, why):
    """Before: argparse's "unrecognized arguments"; now one line naming the flag and the reason."""
    r = cli("serve", "--max-model-len", "64", *flags)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"pagedkv serve: error: {flags[0]} is not supported: ")
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
