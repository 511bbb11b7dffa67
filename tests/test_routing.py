"""Routing policies (pagedkv.routing) and the multi-replica simulator that runs them; no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.config import ConfigError
from pagedkv.kv.hashing import hash_block_tokens
from pagedkv.kv.manager import KVCacheManager
from pagedkv.routing import LeastLoaded, PrefixAware, RoundRobin, make_policy, prompt_block_hashes
from pagedkv.sim.replicas import run_replicas, tenant_trace

REPO = Path(__file__).resolve().parent.parent
BS = 16


def tenant_hashes(tenant: int, user: int, blocks: int = 8) -> list[bytes]:
    """`blocks` blocks: the tenant's system prompt (all but the last), then the user's own."""
    ids = [1000 * tenant + j for j in range((blocks - 1) * BS)] + [
        10**6 + 100 * user + j for j in range(BS)
    ]
    return prompt_block_hashes(ids, BS)


def test_block_hashes_are_the_prefix_caches_keys():
    ids = list(range(3 * BS + 5))
    hashes = prompt_block_hashes(ids, BS)
    assert len(hashes) == 3  # full blocks only
    assert hashes[1] == hash_block_tokens(hash_block_tokens(None, ids[:BS]), ids[BS : 2 * BS])
    kv = KVCacheManager(8, BS)
    assert kv.block_hashes(ids).hashes == hashes
    assert kv.allocate_slots("a", kv.block_hashes(ids), len(ids)) is not None
    kv.free("a")
    # the manager finds the blocks those hashes name
    assert len(kv.lookup_prefix(kv.block_hashes(ids)).block_ids) == 3
    assert len(prompt_block_hashes(ids, BS, max_blocks=2)) == 2


def test_prefix_aware_keeps_a_tenant_on_its_replica_and_spreads_tenants():
    policy, loads = PrefixAware(), {"a": 0, "b": 0}
    homes = {}
    for user in range(20):
        for tenant in range(8):
            replica = policy.choose(tenant_hashes(tenant, user), loads)
            assert homes.setdefault(tenant, replica) == replica
    assert set(homes.values()) == {"a", "b"}  # 8 new prefixes at equal load do not all land on one


def test_prefix_aware_prefers_the_longest_match():
    policy = PrefixAware()
    ids = list(range(6 * BS))
    policy.choose(prompt_block_hashes(ids[: 2 * BS], BS), {"a": 0})  # "a" holds 2 blocks of it
    policy.choose(prompt_block_hashes(ids, BS), {"b": 0})  # "b" holds all 6
    assert policy.choose(prompt_block_hashes(ids, BS), {"a": 0, "b": 1}) == "b"


def test_a_hot_prefix_spills_within_the_load_bound():
    policy, loads = PrefixAware(load_factor=1.25, slack=2), {"a": 0, "b": 0, "c": 0}
    for user in range(60):  # nothing finishes: every request stays in flight
        loads[policy.choose(tenant_hashes(0, user), loads)] += 1
        mean = sum(loads.values()) / len(loads)
        assert max(loads.values()) <= 1.25 * mean + 3
    assert min(loads.values()) > 0


def test_a_dead_replica_gets_nothing_and_its_prefixes_are_forgotten():
    policy = PrefixAware()
    home = policy.choose(tenant_hashes(1, 0), {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    assert (
        policy.choose(tenant_hashes(1, 1), {other: 0}) == other
    )  # Ray dropped `home`: not offered
    policy.forget(home)
    policy.forget(other)
    assert policy.num_entries() == 0


def test_round_robin_and_least_loaded():
    rr = RoundRobin()
    assert [rr.choose([], {"b": 0, "a": 9}) for _ in range(4)] == ["a", "b", "a", "b"]
    ll = LeastLoaded()
    assert ll.choose([], {"a": 3, "b": 1, "c": 2}) == "b"
    assert {ll.choose([], {"a": 0, "b": 0}) for _ in range(2)} == {"a", "b"}  # ties go round
    with pytest.raises(ConfigError, match="unknown routing"):
        make_policy("random")


@pytest.mark.parametrize("replicas", [2, 8])
def test_simulated_prefix_aware_computes_fewer_prompt_tokens(replicas):
    trace = tenant_trace(40 * replicas, tenants=8, seed=1)
    runs = {
        name: run_replicas(
            trace,
            replicas,
            name,
            pool_tokens=8192,
            block_size=BS,
            max_model_len=8192,
            arrival_rate=0.1,
            seed=1,
        )
        for name in ("round-robin", "prefix-aware")
    }
    rr, pa = runs["round-robin"], runs["prefix-aware"]
    assert rr.requests == pa.requests == len(trace)
    assert pa.hit_rate > rr.hit_rate and pa.prompt_tokens_computed < rr.prompt_tokens_computed
    assert rr.imbalance == 1.0 and pa.imbalance < 1.6


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def test_simulate_replicas_cli():
    r = run_cli(
        "simulate",
        "--replicas",
        "2",
        "--requests-per-replica",
        "20",
        "--kv-memory",
        "1GiB",
        "--arrival-rate",
        "0.1",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert [x["routing"] for x in results] == ["round-robin", "least-loaded", "prefix-aware"]
    assert all(x["requests"] == 40 and 0 < x["hit_rate"] < 1 for x in results)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2", "--routing", "random"], "unknown routing"),
        (["--replicas", "2", "--trace", "x.jsonl"], "--trace is not supported"),
        (
            ["--replicas", "2", "--dynamic", "--requests", "5"],
            "--requests, --dynamic does not apply",
        ),
    ],
)
def test_simulate_replicas_bad_flags_are_one_line_exit_2(args, message):
    r = run_cli("simulate", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )


def test_default_paths_never_import_ray_and_a_missing_ray_is_one_line():
    code = (
        "import sys; import pagedkv.server.app, pagedkv.server.cli, pagedkv.cli, pagedkv.routing, "
        "pagedkv.sim.replicas; assert 'ray' not in sys.modules; sys.modules['ray'] = None; "
        "from pagedkv.cli import main; "
        "sys.exit(main(['serve', '--data-parallel-size', '2', '--port', '8123']))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert r.returncode == 2, r.stderr
    assert 'pip install "pagedkv[ray]"' in r.stderr and "Traceback" not in r.stderr


def test_routing_without_replicas_is_one_line_exit_2(capsys):
    from pagedkv.cli import main

    assert main(["serve", "--routing", "round-robin"]) == 2
    err = capsys.readouterr().err
    assert "--data-parallel-size" in err and len(err.strip().splitlines()) == 1


def test_replica_metrics_merge_sums_counts_and_averages_ratios():
    from prometheus_client import generate_latest

    from pagedkv.server.aggregate import merge_metrics

    one = (
        "# HELP pagedkv:prompt_tokens_total p\n# TYPE pagedkv:prompt_tokens_total counter\n"
        'pagedkv:prompt_tokens_total{model_name="m"} 2.0\n'
        "# HELP pagedkv:kv_cache_usage_perc u\n# TYPE pagedkv:kv_cache_usage_perc gauge\n"
        'pagedkv:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    two = one.replace("} 2.0", "} 3.0").replace("} 0.5", "} 0.1")
    text = generate_latest(merge_metrics([one, two])).decode()
    assert 'pagedkv:prompt_tokens_total{model_name="m"} 5.0' in text
    assert 'pagedkv:kv_cache_usage_perc{model_name="m"} 0.3' in text
