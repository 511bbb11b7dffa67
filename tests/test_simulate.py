"""The seeds' static arithmetic, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.config import ConfigError
from pagedkv.sim.dynamic import Replay, arrival_steps, replay
from pagedkv.sim.simulate import Policy, fit_ratio, parse_policies, simulate
from pagedkv.sim.trace import TraceRequest, generate_trace

# final lengths 150, 15, 300
TRACE = [TraceRequest(100, 50), TraceRequest(10, 5), TraceRequest(300, 0)]


def run(trace, pool, policy, max_model_len=400, max_output=100):
    (r,) = simulate(
        trace,
        pool_tokens=pool,
        max_model_len=max_model_len,
        max_output=max_output,
        policies=[policy],
    ).policies
    return r.requests_fit, r.real_tokens, r.reserved_tokens, r.token_utilization


def test_reserve_max_reserves_max_model_len():
    # 400 + 400 = 800 fits in 1000, a third 400 does not
    assert run(TRACE, 1000, "reserve-max") == (2, 165, 800, 165 / 800)


def test_reserve_output_reserves_prompt_plus_max_output_and_cycles():
    # reservations 200, 110, 400 -> 710; cycling: +200 = 910; +110 = 1020 > 1000
    assert run(TRACE, 1000, "reserve-output") == (4, 615, 910, 615 / 910)


def test_paged_rounds_each_request_up_to_whole_blocks():
    # blocks of 16: 160, 16, 304 = 480 a pass; two passes 960, then 160 > 40 left
    assert run(TRACE, 1000, "paged:16") == (6, 930, 960, 930 / 960)
    # blocks of 256: 256, 256, 512; the third ends at 1024 > 1000
    assert run(TRACE, 1000, "paged:256") == (2, 165, 512, 165 / 512)
    # blocks of 1 waste nothing: 465 a pass, two passes 930, then 150 > 70 left
    assert run(TRACE, 1000, "paged:1") == (6, 930, 930, 1.0)


def test_admission_stops_at_the_first_request_that_does_not_fit():
    trace = [TraceRequest(100, 0), TraceRequest(500, 0), TraceRequest(10, 0)]
    # 100 fits, 500 would end at 600 > 550: stop, although the 10-token request would fit
    assert run(trace, 550, "paged:1", max_model_len=1000) == (1, 100, 100, 1.0)


def test_a_reservation_that_exactly_fills_the_pool_is_admitted():
    assert run(TRACE, 800, "reserve-max")[:3] == (2, 165, 800)


def test_nothing_fits_gives_zero_utilization_not_a_division_error():
    assert run(TRACE, 399, "reserve-max") == (0, 0, 0, 0.0)
    assert run(TRACE, 0, "paged:16") == (0, 0, 0, 0.0)


def test_pool_comes_from_memory_divided_by_bytes_per_token_rounded_down():
    result = simulate(
        TRACE,
        kv_memory="1MiB",
        bytes_per_token=1000,
        max_model_len=400,
        max_output=100,
        policies="reserve-max",
    )
    assert result.pool_tokens == 1048  # 1048576 // 1000
    assert result.policies[0].requests_fit == 2  # 3 * 400 = 1200 > 1048


def test_many_passes_match_one_request_at_a_time():
    # 2**20 slots, paged:16 reserves 480 a pass: 2184 passes (1048320), 256 left: 160 + 16 fit, 304 not
    r = simulate(
        TRACE, pool_tokens=2**20, max_model_len=400, max_output=100, policies="paged:16"
    ).policies[0]
    assert (r.requests_fit, r.real_tokens, r.reserved_tokens) == (
        2184 * 3 + 2,
        2184 * 465 + 165,
        2184 * 480 + 176,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 100)), min_size=1, max_size=8),
    st.integers(0, 5000),
    st.sampled_from(["reserve-max", "reserve-output", "paged:1", "paged:7", "paged:64"]),
)
def test_agrees_with_admitting_one_request_at_a_time(lengths, pool, policy):
    trace = [TraceRequest(p, o) for p, o in lengths]
    block = int(policy.split(":")[1]) if policy.startswith("paged") else 0

    def reservation(req):
        if policy == "reserve-max":
            return 400
        if policy == "reserve-output":
            return req.prompt_tokens + 100
        return -(-req.total_tokens // block) * block

    fit = real = reserved = 0
    while reserved + reservation(trace[fit % len(trace)]) <= pool:
        req = trace[fit % len(trace)]
        reserved += reservation(req)
        real += req.total_tokens
        fit += 1
    assert run(trace, pool, policy)[:3] == (fit, real, reserved)


def test_policies_parse_and_name_themselves():
    names = [p.name for p in parse_policies("reserve-max, reserve-output,paged:16,paged:1")]
    assert names == ["reserve-max", "reserve-output", "paged:16", "paged:1"]
    assert parse_policies([Policy("paged", 32)])[0].name == "paged:32"


@pytest.mark.parametrize(
    "bad",
    [
        "paged",
        "paged:0",
        "paged:-4",
        "paged:x",
        "paged:\u00b2",
        "reserve",
        "",
        "reserve-max,,paged:16",
    ],
)
def test_bad_policies_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_policies(bad)


@pytest.mark.parametrize(
    "trace, message",
    [
        ([], "no requests"),
        ([TraceRequest(100, 101)], "--max-output"),
        ([TraceRequest(350, 60)], "--max-model-len"),
        ([TraceRequest(0, 5)], "prompt_tokens"),
    ],
)
def test_requests_outside_the_limits_are_rejected(trace, message):
    with pytest.raises(ConfigError, match=message):
        simulate(trace, pool_tokens=1000, max_model_len=400, max_output=100)


@pytest.mark.parametrize("memory, bpt", [("0", 1), ("abc", 1), ("1GiB", 0), ("1GiB", -5)])
def test_bad_memory_or_bytes_per_token_are_config_errors(memory, bpt):
    with pytest.raises(ConfigError):
        simulate(TRACE, kv_memory=memory, bytes_per_token=bpt, max_model_len=400, max_output=100)


def test_generated_trace_is_deterministic_and_within_bounds():
    trace = generate_trace(200, 0)
    assert trace == generate_trace(200, 0)
    assert trace != generate_trace(200, 1)
    assert all(200 <= r.prompt_tokens <= 1500 and 1 <= r.output_tokens <= 2048 for r in trace)
    assert sum(r.output_tokens <= 300 for r in trace) > 120  # mostly short answers
    assert (
        max(generate_trace(500, 3, output_cap=700), key=lambda r: r.output_tokens).output_tokens
        == 700
    )


def test_default_run_lands_on_the_seeds_table():
    result = simulate(generate_trace(200, 0))
    rmax, rout, p16, p256 = (
        result.get(p) for p in ("reserve-max", "reserve-output", "paged:16", "paged:256")
    )
    assert result.pool_tokens == 2**19  # 64 GiB / 128 KiB
    assert (
        rmax.requests_fit == 64 and 0.84 <= 1 - rmax.token_utilization <= 0.855
    )  # seeds: 84.5% empty
    assert 0.42 <= rout.token_utilization <= 0.44  # seeds: 42.8%
    assert (
        0.99 <= p16.token_utilization <= 0.997 and 400 <= p16.requests_fit <= 420
    )  # seeds: 99.4%, 411
    assert (
        0.905 <= p256.token_utilization <= 0.915 and 370 <= p256.requests_fit <= 390
    )  # seeds: 91.0%, 376
    assert round(fit_ratio(result), 1) == 2.3  # seeds: 2.3x


def test_json_shape_is_the_one_design_md_fixes():
    d = simulate(
        TRACE, pool_tokens=1000, max_model_len=400, max_output=100, policies="paged:16"
    ).to_dict()
    assert d == {
        "pool_tokens": 1000,
        "policies": [
            {
                "policy": "paged:16",
                "requests_fit": 6,
                "real_tokens": 930,
                "reserved_tokens": 960,
                "token_utilization": 930 / 960,
            }
        ],
    }


# ---- replay through the block manager (--dynamic) ------------------------------------------------


def replay_one(trace, policy, pool, *, max_model_len=64, max_output=16, **kw):
    (r,) = replay(
        trace,
        parse_policies(policy),
        pool_tokens=pool,
        max_model_len=max_model_len,
        max_output=max_output,
        **kw,
    )
    return r


def test_replay_one_token_per_step_and_completion_frees():
    # paged:4, 4 blocks. step 0: A prefills 3 (1 block), B 2 (1 block): 5 of 8 slots.
    # step 1: A 4, B 3 = 7/8, B done. step 2: A 5 takes a 2nd block: 5/8, done.
    r = replay_one([TraceRequest(3, 2), TraceRequest(2, 1)], "paged:4", 16)
    assert (r.steps, r.completed, r.peak_running, r.preemptions) == (3, 2, 2, 0)
    assert r.running == [2, 2, 1] and r.utilization == [5 / 8, 7 / 8, 5 / 8]
    assert r.token_utilization_mean == pytest.approx(17 / 24) and r.token_utilization_min == 5 / 8
    assert r.mean_running == pytest.approx(5 / 3)


def test_replay_preempts_the_youngest_and_recomputes_it():
    # paged:2, 2 blocks. step 0: A holds 2 (1 block), B 1 (1 block). step 1: A needs a 2nd block:
    # B is preempted (its block freed), A grows to 3 and finishes. step 2: B re-prefills 1 token;
    # step 3: 2 tokens; step 4: 3 tokens in 2 blocks, done.
    r = replay_one([TraceRequest(2, 1), TraceRequest(1, 2)], "paged:2", 4)
    assert (r.steps, r.completed, r.preemptions, r.peak_running) == (5, 2, 1, 2)
    assert r.running == [2, 1, 1, 1, 1]
    assert r.utilization == [3 / 4, 3 / 4, 1 / 2, 1.0, 3 / 4]


def test_replay_reserve_max_holds_whole_reservations():
    # reserve-max with max_model_len 32 takes 2 blocks of 16 each; the pool has 4 blocks, so
    # the third request waits until the first two finish at step 2.
    r = replay_one([TraceRequest(10, 2)] * 3, "reserve-max", 64, max_model_len=32)
    assert r.running == [2, 2, 2, 1, 1, 1]
    assert r.utilization == [20 / 64, 22 / 64, 24 / 64, 10 / 32, 11 / 32, 12 / 32]


def test_replay_counts_prefix_hits_and_shared_blocks_once():
    # two prompts of 10 tokens sharing 8: the second reuses 2 full blocks of 4 (8 hit tokens);
    # 20 tokens held in 4 physical blocks, 8 of them shared: 12 distinct tokens in 16 slots
    r = replay_one([TraceRequest(10, 1)] * 2, "paged:4", 64, shared_prefix=8)
    assert (r.prefix_queries, r.prefix_hits) == (20, 8)
    assert r.utilization == [12 / 16, 14 / 16]
    off = replay_one(
        [TraceRequest(10, 1)] * 2, "paged:4", 64, shared_prefix=8, enable_prefix_caching=False
    )
    assert (off.prefix_hits, off.utilization) == (0, [20 / 24, 22 / 24])


def test_replay_poisson_arrivals_are_deterministic_and_ordered():
    steps = arrival_steps(50, 0.5, seed=1)
    assert steps == sorted(steps) == arrival_steps(50, 0.5, seed=1) and steps[-1] > 50
    assert arrival_steps(3, 0, seed=1) == [0, 0, 0]
    for bad in (-1.0, 1e-300, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            arrival_steps(3, bad, seed=1)
    r = replay_one([TraceRequest(5, 3)] * 50, "paged:16", 4096, arrival_rate=0.5, seed=1)
    assert r.steps >= steps[-1] + 4 and r.completed == 50
    slow = replay_one([TraceRequest(5, 3)] * 5, "paged:16", 4096, arrival_rate=0.001, seed=1)
    assert slow.steps > 1000 and len(slow.times) == 5 * 4  # idle steps between arrivals are skipped


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 16)), min_size=1, max_size=12),
    st.sampled_from(["paged:1", "paged:4", "paged:16", "reserve-output", "reserve-max"]),
    st.integers(64, 160),
    st.integers(0, 24),
    st.one_of(st.just(0.0), st.floats(0.001, 2)),
)
def test_replay_utilization_matches_the_manager_stats_every_step(
    lengths, policy, pool, shared, rate
):
    trace = [TraceRequest(p, o) for p, o in lengths]
    rp = Replay(
        trace,
        parse_policies(policy)[0],
        pool_tokens=pool,
        max_model_len=64,
        max_output=16,
        arrivals=arrival_steps(len(trace), rate, 0),
        shared_prefix=shared,
    )
    while not rp.done():
        rp.step()
        stats = rp.kv.stats()
        assert (rp.tokens_held(), rp.token_slots()) == (stats.tokens_held, stats.token_slots)
        assert rp.running_series[-1] <= len(trace)
        rp.kv.check_integrity()
    assert rp.completed == len(trace) and rp.kv.num_free_blocks() == rp.kv.num_blocks


def test_replay_rejects_a_request_the_pool_can_never_hold():
    with pytest.raises(ConfigError, match="kv-memory"):
        replay_one([TraceRequest(40, 10)], "paged:16", 32)
