"""examples/grafana.json reads only series a running `pagedkv serve` exports, with vLLM's meanings."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import REPO, ServerProcess

DASHBOARD = REPO / "examples" / "grafana.json"
# what vLLM's reference dashboard reads, under pagedkv's prefix
VLLM_DASHBOARD_SERIES = {
    "e2e_request_latency_seconds_bucket",
    "prompt_tokens_total",
    "generation_tokens_total",
    "inter_token_latency_seconds_bucket",
    "num_requests_running",
    "num_requests_waiting",
    "time_to_first_token_seconds_bucket",
    "kv_cache_usage_perc",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
    "request_success_total",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum",
    "request_inference_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
    "iteration_tokens_total_bucket",
    "cache_config_info",
}


def dashboard_series() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return {name for e in exprs for name in re.findall(r"pagedkv:(\w+)", e)}


def scrape(server) -> dict[str, list]:
    """sample name -> samples, from the real /metrics text."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples.get("pagedkv:" + name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--num-gpu-blocks-override",
        "128",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    ) as srv:
        yield srv


def send_two(server) -> None:
    """One request of 4 tokens, one of n=2 samples of 3 tokens (short prompts: no cached block)."""
    client = server.openai()
    no_eos = {"ignore_eos": True}
    client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=4, temperature=0, extra_body=no_eos
    )
    client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=3,
        n=2,
        temperature=1,
        extra_body=no_eos,
    )
    server.wait_idle()


def test_dashboard_reads_only_exported_series(server):
    send_two(server)
    samples = scrape(server)
    wanted = dashboard_series()
    assert VLLM_DASHBOARD_SERIES <= wanted  # every panel of vLLM's has its series here
    missing = sorted(n for n in wanted if "pagedkv:" + n not in samples)
    assert not missing, f"the dashboard reads series /metrics does not export: {missing}"


def test_request_metrics_have_vllms_meaning(server):
    before = scrape(server)
    send_two(server)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # requests, not choices: the n=2 request counts once, with vLLM's finished_reason label
    assert delta("request_success_total") == 2
    assert delta("request_success_total", finished_reason="length") == 2
    prompt_tokens = [
        len(server.http.post("/tokenize", json={"prompt": p}).json()["tokens"])
        for p in ("Hello world", "The quick brown fox")
    ]
    assert delta("request_prompt_tokens_sum") == sum(prompt_tokens)
    assert delta("request_prompt_tokens_count") == 2
    assert delta("request_generation_tokens_sum") == 4 + 2 * 3  # all samples
    assert delta("request_max_num_generation_tokens_sum") == 4 + 3  # the longest sample
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"request_{phase}_time_seconds_count") == 2
        assert delta(f"request_{phase}_time_seconds_sum") >= 0
    assert delta("request_inference_time_seconds_sum") >= delta("request_decode_time_seconds_sum")
    # every step's tokens land in the iteration histogram: prompts + all but the samples' last tokens
    steps_tokens = delta("iteration_tokens_total_sum")
    assert sum(prompt_tokens) <= steps_tokens <= sum(prompt_tokens) + 4 + 2 * 3
    info = after["pagedkv:cache_config_info"][0]
    assert (
        info.value == 1
        and info.labels["block_size"] == "16"
        and info.labels["num_gpu_blocks"] == "128"
    )


def test_inter_token_latency_is_one_gap_per_step(server):
    """As vLLM: the tokens of one step (a token and its accepted drafts) are one gap, not zeros."""
    before = scrape(server)
    done = server.openai().completions.create(
        model="tiny",
        prompt=[7] * 12,  # with token 7 forced, every n-gram draft is accepted
        max_tokens=20,
        temperature=0,
        logit_bias={"7": 100},
        extra_body={"ignore_eos": True},
    )
    server.wait_idle()
    after = scrape(server)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert done.usage.completion_tokens == 20
    assert delta("spec_decode_num_accepted_tokens_total") > 0
    steps = delta("iteration_tokens_total_count")  # it ran alone: a prefill, then decodes
    assert delta("inter_token_latency_seconds_count") == steps - 1


def test_a_request_whose_client_goes_away_counts_once_as_abort(server):
    """As vLLM's finished_reason="abort": a stream left after its first chunk, and a plain answer
    given up on, each count once; the requests that finish count only under their own reason."""
    before = scrape(server)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True}
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert '"text"' in next(line for line in r.iter_lines() if line)
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    server.wait_idle(timeout=10)
    send_two(server)
    after = scrape(server)

    def delta(**labels: str) -> float:
        return total(after, "request_success_total", **labels) - total(
            before, "request_success_total", **labels
        )

    assert delta(finished_reason="abort") == 2
    assert delta(finished_reason="length") == 2
    assert delta() == 4
