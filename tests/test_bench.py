"""`pagedkv bench` on the tiny model: the suite's JSON, markdown and plots, the online load generator, peers."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest

from pagedkv.bench.metrics import MIN_METERED_S, CpuMeter
from pagedkv.bench.online import (
    LoadSpec,
    ServerProcess,
    engine_flags,
    generate_load,
    parse_metrics,
    records_result,
)
from pagedkv.bench.peers import best_of, from_readme, load_peers
from pagedkv.bench.result import RunResult
from pagedkv.bench.suite import PREFIX_OFF, PREFIX_ON, suite_ratios, suite_specs
from pagedkv.bench.workloads import (
    BenchRequest,
    Workload,
    builtin_workload,
    find_shared_file,
    load_workloads,
)
from pagedkv.cli import main

# what `python3 shared/bench/workloads.py` prints
SHARED_CHECKSUMS = {"W1": "ab38e74d0a5aa11c", "W2": "774a9a993de3ef5d", "W3": "08c4650452c2e50b"}
POOL_TOKENS, MAX_LEN, BLOCK = 640, 256, 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_trace(path, n: int = 8, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    lines = [
        {"prompt_tokens": rng.randint(40, 56), "output_tokens": rng.randint(3, 10)}
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory):
    """One `pagedkv bench --suite` on a trace whose prompts share 32 tokens (block 16)."""
    d = tmp_path_factory.mktemp("bench")
    lines = write_trace(d / "tr.jsonl")
    peers = d / "peers"  # the test's own peer figures: nothing outside the repository is read
    peers.mkdir()
    (peers / "vllm.json").write_text(
        json.dumps(
            {"peer": "vllm_cpu", "results": [{"workload": "W1-mixed", "output_tok_s": 100.0}]}
        )
    )
    rc = main(
        [
            "bench",
            "--model",
            tiny_model_dir,
            "--peers-dir",
            str(peers),
            "--dtype",
            "float32",
            "--num-gpu-blocks-override",
            "256",
            "--trace",
            str(d / "tr.jsonl"),
            "--shared-prefix",
            "32",
            "--suite",
            "--suite-pool-tokens",
            str(POOL_TOKENS),
            "--suite-max-model-len",
            str(MAX_LEN),
            "--out",
            str(d / "r.json"),
            "--markdown",
            str(d / "r.md"),
            "--plot",
            str(d / "plots"),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads((d / "r.json").read_text())
    return doc, lines, d


def runs_by_label(doc: dict) -> dict[str, dict]:
    return {r["label"]: r for r in doc["runs"]}


def test_cpu_meter_reports_other_load_for_runs_over_a_second():
    with CpuMeter() as cpu:
        time.sleep(MIN_METERED_S + 0.05)
    assert cpu.own_cpu_s < 0.5 and 0.0 <= cpu.other_load <= os.cpu_count()
    with CpuMeter() as short:
        pass
    assert short.other_load is None


def test_builtin_workloads_reproduce_the_shared_file():
    for key, checksum in SHARED_CHECKSUMS.items():
        assert builtin_workload(key).checksum() == checksum
    if find_shared_file() is not None:
        assert [w.checksum() for w in load_workloads(list(SHARED_CHECKSUMS))] == list(
            SHARED_CHECKSUMS.values()
        )
    w1 = builtin_workload("W1")
    assert (len(w1.requests), w1.prompt_tokens, w1.output_tokens) == (64, 18708, 8388)


def test_suite_json_has_every_field_and_consistent_counts(suite):
    doc, lines, _ = suite
    runs = runs_by_label(doc)
    assert set(runs) == {
        "paged, prefix on",
        "paged, prefix off",
        "paged @ 640-token pool",
        "reserve-output @ 640-token pool",
        "reserve-max @ 640-token pool",
    }
    want_out = sum(x["output_tokens"] for x in lines)
    want_prompt = sum(x["prompt_tokens"] for x in lines)
    for r in doc["runs"]:
        assert r["mode"] == "offline" and r["workload"] == "tr" and r["errors"] == 0
        assert (r["requests"], r["output_tokens"], r["prompt_tokens"]) == (
            len(lines),
            want_out,
            want_prompt,
        )
        assert r["output_tok_s"] == pytest.approx(want_out / r["wall_s"], rel=0.01)
        assert r["total_tok_s"] == pytest.approx((want_out + want_prompt) / r["wall_s"], rel=0.01)
        assert 0.0 < r["kv_util_mean"] <= 1.0 and 0.0 < r["kv_usage_peak"] <= 1.0
        assert (
            1 <= r["peak_running"] <= len(lines) and r["preemptions"] == 0 and r["peak_rss_mb"] > 0
        )
        assert r["other_load"] is None  # runs under a second are too short to meter
        assert r["ttft"]["count"] == r["e2e"]["count"] == len(lines)
        assert r["itl"]["count"] == want_out - len(lines)  # one gap between consecutive tokens
        assert r["ttft"]["p50"] <= r["e2e"]["p50"] and r["ttft"]["p50"] <= r["ttft"]["p99"]
        t = r["timeline"]
        assert len(t["t"]) == len(t["running"]) == len(t["kv_usage"]) == r["extra"]["steps"] + 1
        assert t["kv_usage"][-1] == 0.0  # every block back in the pool
    assert {w["key"] for w in doc["workloads"]} == {"tr"} and doc["complete"] is True
    assert doc["machine"]["cpu_count"] >= 1 and doc["settings"]["suite_pool_tokens"] == POOL_TOKENS


def test_reservation_wastes_memory_that_paging_uses(suite):
    runs = runs_by_label(suite[0])
    paged, rmax = runs["paged @ 640-token pool"], runs["reserve-max @ 640-token pool"]
    rout = runs["reserve-output @ 640-token pool"]
    assert paged["extra"]["kv_token_capacity"] == rmax["extra"]["kv_token_capacity"] == POOL_TOKENS
    assert rmax["extra"]["max_model_len"] == MAX_LEN
    # 640 slots / 256 reserved per request: 2 at a time; paging fits all 8 (about 60 tokens each)
    assert rmax["peak_running"] == POOL_TOKENS // MAX_LEN
    assert paged["peak_running"] == 8
    assert rmax["kv_util_mean"] < rout["kv_util_mean"] < paged["kv_util_mean"]
    ratios = {r["name"]: r for r in suite[0]["ratios"]}
    assert ratios["tr KV token utilization, paged, block 16"]["value"] == paged["kv_util_mean"]
    assert "tr paged / reserve-max throughput, equal KV memory" in ratios


def test_prefix_cache_computes_fewer_prompt_tokens(suite):
    runs = runs_by_label(suite[0])
    on, off = runs["paged, prefix on"], runs["paged, prefix off"]
    sent = on["prompt_tokens"]
    assert (
        off["prompt_tokens_computed"] == sent
        and off["cached_tokens"] == 0
        and off["prefix_hit_rate"] == 0
    )
    # the 32 shared tokens are two full blocks: every request after the first reuses them
    assert on["cached_tokens"] == 32 * 7
    assert on["prompt_tokens_computed"] == sent - 32 * 7
    assert 0 < on["prefix_hit_rate"] < 1


def test_markdown_and_plots(suite):
    doc, _, d = suite
    md = (d / "r.md").read_text()
    assert md.startswith("### Runs") and "| config | workload | mode |" in md
    for r in doc["runs"]:
        assert f"| {r['label']} | tr | offline |" in md
    assert "### Ratios" in md and "### Peers" in md
    pngs = sorted(p.name for p in (d / "plots").iterdir())
    assert pngs == ["kv.png", "latency.png", "throughput.png"]
    assert all((d / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_from_json_renders_the_same_report_again(suite, tmp_path, capsys):
    doc, _, d = suite
    assert (
        main(
            [
                "bench",
                "--from-json",
                str(d / "r.json"),
                "--markdown",
                str(tmp_path / "again.md"),
                "--out",
                str(tmp_path / "again.json"),
            ]
        )
        == 0
    )
    again = json.loads((tmp_path / "again.json").read_text())
    assert (
        again["runs"] == doc["runs"]
        and again["ratios"] == doc["ratios"]
        and again["command"] == doc["command"]
    )
    assert (tmp_path / "again.md").read_text() == (d / "r.md").read_text()
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert main(["bench", "--from-json", str(tmp_path / "junk.json")]) == 2
    assert "not a pagedkv bench result" in capsys.readouterr().err


def test_ratios_withhold_verdicts_on_runs_that_shared_the_cores():
    def run(label, workload, tok_s, load):
        return RunResult(
            label,
            "offline",
            workload,
            {},
            1,
            10,
            10,
            1.0,
            tok_s,
            tok_s,
            1.0,
            {},
            {},
            {},
            other_load=load,
        )

    clean = suite_ratios(
        [run(PREFIX_ON, "W2", 300.0, 0.01), run(PREFIX_OFF, "W2", 100.0, 0.0)], [], 1024
    )
    noisy = suite_ratios(
        [run(PREFIX_ON, "W2", 300.0, 0.9), run(PREFIX_OFF, "W2", 100.0, 0.0)], [], 1024
    )
    (c,), (n,) = clean, noisy
    assert (c.value, c.met, c.note) == (3.0, True, "")
    assert (n.value, n.met) == (3.0, None) and "0.90 cores" in n.note


@pytest.mark.parametrize(
    "content, needle",
    [
        (
            '{"prompt_tokens": 10, "output_tokens": 4}\n{"prompt_tokens": "x", "output_tokens": 4}\n',
            "line 2",
        ),
        ('{"prompt_tokens": 10, "output_tokens": 0}\n', "output_tokens must be >= 1"),
        ("", "empty"),
    ],
)
def test_bad_trace_exits_2_with_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["bench", "--trace", str(path), "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv bench: error:") and needle in err[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--workloads", "W9"], "unknown workload 'W9'"),
        (["--concurrency", "4"], "add --online"),
        (["--suite", "--label", "x"], "--suite names its own"),
        (["--block-size", "0"], "--block-size"),
        # --suite sets these per run itself: given, they would be overridden or mislabelled
        (["--suite", "--allocation-policy", "reserve-max"], "drop --allocation-policy"),
        (["--suite", "--no-enable-prefix-caching"], "--[no-]enable-prefix-caching"),
        (["--suite", "--enable-prefix-caching"], "--[no-]enable-prefix-caching"),
        # flags that would have no effect
        (["--from-json", "r.json", "--workloads", "W1"], "--workloads would have no effect"),
        (["--from-json", "r.json", "--request-rate", "nan"], "--request-rate would have"),
        (["--from-json", "r.json", "--allocation-policy", "paged"], "--allocation-policy would"),
        (["--shared-prefix", "8"], "add --trace"),
        (["--trace-seed", "3"], "add --trace, or --online with --request-rate"),
        (["--online", "--trace-seed", "3"], "add --trace, or --online with --request-rate"),
        (["--server-startup-timeout", "5"], "--server-startup-timeout waits for the server"),
        (["--online", "--server-startup-timeout", "0"], "must be > 0, got 0.0"),
        (["--online", "--server-startup-timeout", "nan"], "must be > 0, got nan"),
    ],
)
def test_bad_flags_exit_2(capsys, argv, needle):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedkv bench: error:") and needle in err[0]


def test_suite_prefix_rows_run_the_paged_policy():
    """Their labels say paged: the engine option must say so too, whatever the base options."""
    specs = {
        s.label: s
        for s in suite_specs(
            ["W1"], equal_memory_workload=None, pool_tokens=1024, max_model_len=256, block_size=16
        )
    }
    assert specs[PREFIX_ON].overrides == {
        "allocation_policy": "paged",
        "enable_prefix_caching": True,
    }
    assert specs[PREFIX_OFF].overrides == {
        "allocation_policy": "paged",
        "enable_prefix_caching": False,
    }


# ---------------------------------------------------------------- online


def test_online_against_the_real_server(tiny_model_dir, tmp_path):
    lines = write_trace(tmp_path / "on.jsonl", n=4, seed=5)
    out = tmp_path / "on.json"
    rc = main(
        [
            "bench",
            "--online",
            "--concurrency",
            "2",
            "--model",
            tiny_model_dir,
            "--dtype",
            "float32",
            "--num-gpu-blocks-override",
            "128",
            "--trace",
            str(tmp_path / "on.jsonl"),
            "--shared-prefix",
            "32",
            "--out",
            str(out),
            "--no-progress",
            "--server-startup-timeout",
            "120",
        ]
    )
    assert rc == 0
    (r,) = json.loads(out.read_text())["runs"]
    assert r["mode"] == "online" and r["errors"] == 0 and r["requests"] == 4
    assert r["output_tokens"] == sum(x["output_tokens"] for x in lines)
    assert r["ttft"]["count"] == r["e2e"]["count"] == 4 and r["itl"]["count"] >= 1
    assert r["cached_tokens"] > 0 and r["prompt_tokens_computed"] < r["prompt_tokens"]
    assert r["peak_rss_mb"] > 0 and r["extra"]["concurrency"] == 2


def test_a_server_interrupted_while_it_starts_is_stopped(tiny_model_dir, monkeypatch):
    """SIGTERM (SystemExit, from the CLI's handler) or Ctrl-C while the bench waits for its server:
    `with` calls no __exit__ when __enter__ fails, and the server, in a session of its own, ran on
    after the bench had gone."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(httpx, "get", interrupted)  # the first readiness probe
    server = ServerProcess({"model": tiny_model_dir, "num_gpu_blocks_override": 16})
    try:
        with pytest.raises(KeyboardInterrupt), server:
            pytest.fail("the server cannot be ready")
        assert server.proc is not None and server.proc.poll() is not None
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


# ---------------------------------------------------------------- the load generator, against a fake server


def sse_body(n_tokens: int, cached: int) -> bytes:
    chunks = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(n_tokens)]
    chunks.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": n_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_load_generator_measures_streams_and_counts_errors():
    seen = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        await asyncio.sleep(0.01)
        if body["max_tokens"] == 99:
            return httpx.Response(400, json={"error": {"message": "too long"}})
        return httpx.Response(
            200,
            content=sse_body(body["max_tokens"], 4),
            headers={"content-type": "text/event-stream"},
        )

    reqs = [BenchRequest([1, 2, 3, 4, 5], n) for n in (3, 5, 99, 2)]
    wl = Workload("fake", "fake", reqs)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), base_url="http://test"
        ) as client:
            return await generate_load(client, "m", reqs, LoadSpec(concurrency=2))

    records = asyncio.run(go())
    assert all(
        b["stream"]
        and b["ignore_eos"]
        and b["temperature"] == 0
        and b["prompt"] == [1, 2, 3, 4, 5]
        and b["stream_options"] == {"include_usage": True}
        for b in seen
    )
    assert [len(r.chunk_times) for r in records] == [3, 5, 0, 2]
    assert records[2].error.startswith("HTTP 400") and "too long" in records[2].error
    before = {
        "prefix_cache_queries_total": 10.0,
        "prefix_cache_hits_total": 0.0,
        "num_preemptions_total": 1.0,
    }
    after = {
        "prefix_cache_queries_total": 30.0,
        "prefix_cache_hits_total": 12.0,
        "num_preemptions_total": 3.0,
    }
    series = {
        "t": [0.0, 0.5],
        "running": [2, 1],
        "waiting": [2, 0],
        "kv_usage": [0.2, 0.1],
        "kv_util": [0.9, 0.8],
    }
    r = records_result(records, 2.0, wl, "fake", {}, series, before, after, {})
    assert (r.requests, r.errors, r.output_tokens) == (3, 1, 10)
    assert r.output_tok_s == 5.0 and r.requests_per_s == 1.5
    assert r.ttft["count"] == 3 and r.itl["count"] == 10 - 3 and r.e2e["count"] == 3
    assert r.cached_tokens == 12 and r.prefix_hit_rate == 0.6 and r.preemptions == 2
    assert r.peak_running == 2 and r.kv_util_mean == pytest.approx(0.85) and r.kv_usage_peak == 0.2
    assert "too long" in r.extra["first_error"]


def test_poisson_arrivals_spread_requests():
    async def handler(request):
        return httpx.Response(200, content=sse_body(1, 0))

    reqs = [BenchRequest([7], 1)] * 6

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), base_url="http://t"
        ) as client:
            return await generate_load(client, "m", reqs, LoadSpec(request_rate=50.0, seed=1))

    starts = [r.start for r in asyncio.run(go())]
    assert starts == sorted(starts) and starts[-1] - starts[0] > 0.02


def test_engine_flags_and_metrics_parsing():
    assert engine_flags(
        {
            "block_size": 16,
            "enable_prefix_caching": False,
            "kv_cache_memory": None,
            "allocation_policy": "reserve-max",
        }
    ) == ["--block-size", "16", "--no-enable-prefix-caching", "--allocation-policy", "reserve-max"]
    text = (
        '# HELP x\npagedkv:num_requests_running{model_name="m"} 3.0\n'
        'pagedkv:prefix_cache_hits_total{model_name="m"} 48.0\nother_metric 1\n'
    )
    assert parse_metrics(text) == {"num_requests_running": 3.0, "prefix_cache_hits_total": 48.0}


# ---------------------------------------------------------------- peers

README = """# x
| peer | W1 | W2 | W3 |
|---|---:|---:|---:|
| HF static, batches of 16 / 64 | 39 / 40 | 81 / 90 | 21 |
| vLLM CPU, prefix caching on | 215–246 | 1,486 | – |

after the table
"""


def test_peers_from_readme_and_from_results(tmp_path):
    (tmp_path / "README.md").write_text(README)
    peers = from_readme(tmp_path / "README.md")
    assert [p.peer for p in peers] == [
        "HF static, batches of 16 / 64",
        "vLLM CPU, prefix caching on",
    ]
    assert (
        peers[0].tok_s == {"W1": 40.0, "W2": 90.0, "W3": 21.0} and peers[0].cells["W1"] == "39 / 40"
    )
    assert peers[1].tok_s == {"W1": 246.0, "W2": 1486.0, "W3": None}
    assert best_of(peers, "vllm", "W2") == (1486.0, "vLLM CPU, prefix caching on")
    assert best_of(peers, "vllm", "W3") is None
    results = tmp_path / "results"
    results.mkdir()
    (results / "hf_static_bfloat16.json").write_text(
        json.dumps(
            {
                "peer": "hf_static_bfloat16",
                "results": [
                    {"workload": "W1-mixed", "output_tok_s": 38.5, "batch_size": 16},
                    {"workload": "W1-mixed", "output_tok_s": 41.0, "batch_size": 64},
                ],
            }
        )
    )
    (results / "broken.json").write_text("{")
    measured = load_peers(str(results), tmp_path / "README.md")
    assert len(measured) == 1 and measured[0].tok_s == {"W1": 41.0, "W2": None, "W3": None}
    assert measured[0].source.startswith("measured")
    assert load_peers(str(tmp_path / "none"), tmp_path / "README.md")[0].source.startswith("README")
