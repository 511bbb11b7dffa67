"""The bench's outputs: one JSON document and a markdown report (runs, peers, ratios)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagedkv.bench.peers import PeerFigures
from pagedkv.bench.result import RunResult
from pagedkv.bench.suite import Ratio

RUN_COLUMNS = (
    "config",
    "workload",
    "mode",
    "wall s",
    "out tok/s",
    "total tok/s",
    "req/s",
    "peak running",
    "KV util",
    "KV peak",
    "prefix hit",
    "prompt computed / sent",
    "preempt",
    "TTFT p50 / p99 s",
    "ITL p50 / p99 ms",
    "e2e p50 s",
    "peak RSS MiB",
    "other load",
)


def build_document(
    *,
    command: list[str],
    machine: dict,
    commit: str | None,
    workloads: list[dict],
    results: list[RunResult],
    peers: list[PeerFigures],
    ratios: list[Ratio],
    settings: dict,
) -> dict:
    return {
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "commit": commit,
        "machine": machine,
        "settings": settings,
        "workloads": workloads,
        "runs": [r.to_json() for r in results],
        "peers": [p.to_json() for p in peers],
        "ratios": [r.to_json() for r in ratios],
    }


def write_json(doc: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def _f(value, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _pair(d: dict, scale: float, fmt: str) -> str:
    if not d.get("count"):
        return "–"
    return f"{fmt.format(d['p50'] * scale)} / {fmt.format(d['p99'] * scale)}"


def run_row(r: RunResult) -> list[str]:
    computed = (
        f"{r.prompt_tokens_computed:,} / {r.prompt_tokens:,}"
        if r.prompt_tokens_computed is not None
        else "–"
    )
    return [
        r.label,
        r.workload,
        r.mode,
        _f(r.wall_s, "{:.1f}"),
        _f(r.output_tok_s, "{:.1f}"),
        _f(r.total_tok_s, "{:.1f}"),
        _f(r.requests_per_s),
        _f(r.peak_running, "{}"),
        _f(r.kv_util_mean, "{:.1%}"),
        _f(r.kv_usage_peak, "{:.1%}"),
        _f(r.prefix_hit_rate, "{:.1%}"),
        computed,
        _f(r.preemptions, "{}"),
        _pair(r.ttft, 1, "{:.2f}"),
        _pair(r.itl, 1000, "{:.0f}"),
        _f(r.e2e.get("p50"), "{:.1f}"),
        _f(r.peak_rss_mb, "{:.0f}"),
        _f(r.other_load, "{:.2f}"),
    ]


def table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def runs_table(results: list[RunResult]) -> str:
    return table(RUN_COLUMNS, [run_row(r) for r in results])


def peers_table(peers: list[PeerFigures]) -> str:
    return table(
        ("peer", "W1", "W2", "W3", "source"),
        [
            [
                p.peer,
                p.cells.get("W1", "–"),
                p.cells.get("W2", "–"),
                p.cells.get("W3", "–"),
                p.source,
            ]
            for p in peers
        ],
    )


def ratios_table(ratios: list[Ratio]) -> str:
    def met(r: Ratio) -> str:
        return "" if r.met is None else ("yes" if r.met else "no")

    return table(
        ("ratio", "value", "target", "met", "note"),
        [[r.name, _f(r.value, "{:.3g}"), r.target, met(r), r.note] for r in ratios],
    )


NOTES = (
    "Output tok/s counts generated tokens, total tok/s adds the prompt tokens sent; "
    "KV util is the mean over steps of tokens held / slots allocated; "
    "other load is the average number of cores that other processes kept busy during the run "
    "(0 = a clean measurement)."
)


def markdown(
    results: list[RunResult], peers: list[PeerFigures], ratios: list[Ratio], workloads: list[dict]
) -> str:
    parts = ["### Runs", "", runs_table(results), "", NOTES, ""]
    if workloads:
        parts += [
            "Workloads: "
            + "; ".join(
                f"{w['key']} = {w['requests']} requests, {w['prompt_tokens']:,} prompt "
                f"+ {w['output_tokens']:,} output tokens (checksum {w['checksum']})"
                for w in workloads
            ),
            "",
        ]
    if peers:
        parts += ["### Peers (output tok/s)", "", peers_table(peers), ""]
    if ratios:
        parts += ["### Ratios", "", ratios_table(ratios), ""]
    return "\n".join(parts)
