"""`pagedkv simulate` from the outside: output, JSON, plots, and one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv import cli


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`pagedkv ARGS` as a user runs it: its own process, exit code and stderr as they are."""
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The same `pagedkv.cli.main`, in this process (fast): exit code, stdout, stderr."""
    try:
        rc = cli.main(list(args))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str) -> None:
    assert rc == 2, out
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("pagedkv ") and "error:" in err


def write_trace(tmp_path, lines: list[str], name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_default_run_prints_the_seed_table_and_the_ratio():
    out = run_cli("simulate")
    assert out.returncode == 0, out.stderr
    rows = {
        line.split()[0]: line.split() for line in out.stdout.splitlines() if len(line.split()) == 6
    }
    assert rows["reserve-max"][1] == "64" and rows["reserve-max"][5] == "84.5%"
    assert rows["paged:16"][4].startswith("99.")
    assert "paged:16 fits 2.3x as many requests as reserve-output" in out.stdout


def test_json_from_a_trace_file_is_exact(tmp_path):
    trace = write_trace(
        tmp_path,
        [
            '{"prompt_tokens": 100, "output_tokens": 50}',
            "",
            '{"prompt_tokens": 10, "output_tokens": 5, "note": "ignored"}',
            '{"prompt_tokens": 300, "output_tokens": 0}',
        ],
    )
    # pool = 1000 * 16 // 16 = 1000 slots; numbers as in test_simulate (worked by hand)
    out = run_cli(
        "simulate",
        "--trace",
        trace,
        "--kv-memory",
        "16000",
        "--bytes-per-token",
        "16",
        "--max-model-len",
        "400",
        "--max-output",
        "100",
        "--policies",
        "reserve-max,paged:16",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "pool_tokens": 1000,
        "policies": [
            {
                "policy": "reserve-max",
                "requests_fit": 2,
                "real_tokens": 165,
                "reserved_tokens": 800,
                "token_utilization": 165 / 800,
            },
            {
                "policy": "paged:16",
                "requests_fit": 6,
                "real_tokens": 930,
                "reserved_tokens": 960,
                "token_utilization": 930 / 960,
            },
        ],
    }


def test_plot_is_a_png(tmp_path, capsys):
    png = tmp_path / "fit.png"
    rc, _, err = run_main(capsys, "simulate", "--requests", "20", "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


BAD_TRACES = {
    "empty": [""],
    "not json": ['{"prompt_tokens": 100, "output_tokens": 5}', "{prompt_tokens: 3}"],
    "not an object": ["[100, 5]"],
    "missing key": ['{"prompt_tokens": 100}'],
    "negative": ['{"prompt_tokens": 100, "output_tokens": -1}'],
    "zero prompt": ['{"prompt_tokens": 0, "output_tokens": 4}'],
    "float": ['{"prompt_tokens": 10.5, "output_tokens": 4}'],
    "too long": ['{"prompt_tokens": 8000, "output_tokens": 1000}'],
}


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_bad_trace_is_one_line_and_exit_2(tmp_path, capsys, case):
    assert_one_line_error(
        *run_main(capsys, "simulate", "--trace", write_trace(tmp_path, BAD_TRACES[case]))
    )


def test_malformed_trace_in_a_real_process(tmp_path):
    out = run_cli(
        "simulate",
        "--trace",
        write_trace(tmp_path, ['{"prompt_tokens": 5, "output_tokens": 1}', "oops"]),
    )
    assert_one_line_error(out.returncode, out.stdout, out.stderr)
    assert "line 2" in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--trace", "/nonexistent/trace.jsonl"],
        ["--trace", "."],  # a folder, unreadable as a file
        ["--policies", "paged:0"],
        ["--policies", "reserve-everything"],
        ["--kv-memory", "lots"],
        ["--bytes-per-token", "0"],
        ["--bytes-per-token", "x"],
        ["--requests", "0"],
        ["--max-output", "0"],
        ["--max-model-len", "1000"],  # generated prompt + output can exceed it
        ["--trace", "t.jsonl", "--requests", "5"],
        ["--unknown-flag"],
        ["--plot", "/nonexistent/dir/fit.png"],
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, args):
    assert_one_line_error(*run_main(capsys, "simulate", *args))


def test_bad_flag_in_a_real_process():
    out = run_cli("simulate", "--policies", "paged:0")
    assert_one_line_error(out.returncode, out.stdout, out.stderr)


def test_dynamic_json_and_plot(tmp_path):
    png = tmp_path / "replay.png"
    out = run_cli(
        "simulate",
        "--dynamic",
        "--requests",
        "40",
        "--kv-memory",
        "2GiB",
        "--max-model-len",
        "4096",
        "--shared-prefix",
        "64",
        "--arrival-rate",
        "0.5",
        "--policies",
        "reserve-max,paged:16",
        "--json",
        "--plot",
        str(png),
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["pool_tokens"] == 16384 and [p["policy"] for p in d["policies"]] == [
        "reserve-max",
        "paged:16",
    ]
    assert set(d["policies"][1]) == {
        "policy",
        "block_size",
        "steps",
        "completed",
        "peak_running",
        "mean_running",
        "preemptions",
        "token_utilization_mean",
        "token_utilization_min",
        "prefix_queries",
        "prefix_hits",
    }
    rmax, paged = d["policies"]
    assert rmax["completed"] == paged["completed"] == 40
    # 1024 blocks, 256 per reservation, 10 kept free; the shared 4-block prefix is held once:
    # 256 + 3 * 252 = 1012 <= 1024 - 10 lets a 4th in
    assert rmax["peak_running"] == 4 < paged["peak_running"]
    assert paged["prefix_hits"] > 0 and paged["token_utilization_mean"] > 0.9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dynamic_table(capsys):
    rc, out, err = run_main(
        capsys, "simulate", "--dynamic", "--requests", "30", "--kv-memory", "2GiB"
    )
    assert rc == 0, err
    assert "replay through the block manager: 30 requests" in out
    assert (
        sum(
            line.startswith(("reserve-max", "reserve-output", "paged:16", "paged:256"))
            for line in out.splitlines()
        )
        == 4
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--arrival-rate", "-1"],
        ["--arrival-rate", "nan"],
        ["--shared-prefix", "-3"],
        ["--kv-memory", "64MiB"],  # 512 token slots: a generated request needs more
        ["--plot", "/nonexistent/dir/replay.png"],
    ],
)
def test_dynamic_bad_flags_are_one_line_and_exit_2(capsys, args):
    assert_one_line_error(*run_main(capsys, "simulate", "--dynamic", "--requests", "5", *args))


@pytest.mark.parametrize(
    "args, needle",
    [
        # the static count reads none of the replay's flags
        (["--arrival-rate", "nan"], "--arrival-rate without --dynamic"),
        (["--arrival-rate", "0.5"], "--arrival-rate without --dynamic"),
        (["--shared-prefix", "64"], "--shared-prefix without --dynamic"),
        (["--no-prefix-caching"], "--no-prefix-caching without --dynamic"),
        (["--tenants", "3"], "--tenants without --replicas"),
        (["--routing", "round-robin"], "--routing without --replicas"),
        (["--requests-per-replica", "5"], "--requests-per-replica without --replicas"),
        # nor does the single-pool replay read the replicas' flags
        (["--dynamic", "--tenants", "3"], "--tenants without --replicas"),
        (["--dynamic", "--routing", "prefix-aware"], "--routing without --replicas"),
    ],
)
def test_a_flag_of_another_mode_is_refused(capsys, args, needle):
    rc, out, err = run_main(capsys, "simulate", "--requests", "5", *args)
    assert_one_line_error(rc, out, err)
    assert needle in err


def test_replay_flags_still_apply_in_their_mode(capsys):
    def steps(*args: str) -> list[int]:
        rc, out, err = run_main(capsys, "simulate", "--dynamic", "--requests", "5", "--json", *args)
        assert rc == 0, err
        return [p["steps"] for p in json.loads(out)["policies"]]

    # arrivals spread over time: the replay takes longer than with all at step 0
    assert all(a > b for a, b in zip(steps("--arrival-rate", "0.05"), steps(), strict=True))
