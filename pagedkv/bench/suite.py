"""What `--suite` runs, and the ratios the bench issue asks for.

One run, one table: paged with prefix caching on and off on every workload;
then, on one workload (a given trace, else W1) at one small KV budget (so small
that reserving max_model_len per request limits concurrency, while paging fits
the whole batch), paged against the reservation policies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.bench.peers import PeerFigures, best_of
from pagedkv.bench.result import RunResult

PREFIX_ON, PREFIX_OFF = "paged, prefix on", "paged, prefix off"
POLICIES = ("paged", "reserve-output", "reserve-max")
NOISY_LOAD = 0.25  # other processes' average busy cores above which a timing is not trusted


@dataclass(frozen=True)
class RunSpec:
    label: str
    overrides: dict  # EngineConfig options on top of the command line's
    workloads: tuple[str, ...]


def equal_memory_label(policy: str, pool_tokens: int) -> str:
    return f"{policy} @ {pool_tokens:,}-token pool"


def suite_specs(
    keys: list[str],
    *,
    equal_memory_workload: str | None,
    pool_tokens: int,
    max_model_len: int,
    block_size: int,
) -> list[RunSpec]:
    keys_ = tuple(keys)
    specs = [
        RunSpec(PREFIX_ON, {"allocation_policy": "paged", "enable_prefix_caching": True}, keys_),
        RunSpec(PREFIX_OFF, {"allocation_policy": "paged", "enable_prefix_caching": False}, keys_),
    ]
    if equal_memory_workload is not None:
        for policy in POLICIES:
            specs.append(
                RunSpec(
                    equal_memory_label(policy, pool_tokens),
                    {
                        "allocation_policy": policy,
                        "enable_prefix_caching": False,
                        "max_model_len": max_model_len,
                        "num_gpu_blocks_override": pool_tokens // block_size,
                    },
                    (equal_memory_workload,),
                )
            )
    return specs


@dataclass
class Ratio:
    name: str
    value: float | None
    target: str  # "≥ 2", "≤ 0.25", or "" for information only
    met: bool | None
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _find(results: list[RunResult], label: str, workload: str) -> RunResult | None:
    return next((r for r in results if r.label == label and r.workload == workload), None)


def _ratio(
    name: str,
    num: float | None,
    den: float | None,
    target: float | None = None,
    at_most: bool = False,
    note: str = "",
) -> Ratio:
    value = round(num / den, 3) if num is not None and den else None
    if target is None:
        return Ratio(name, value, "", None, note)
    met = None if value is None else (value <= target if at_most else value >= target)
    return Ratio(name, value, f"{'≤' if at_most else '≥'} {target:g}", met, note)


def _timed_ratio(
    name: str,
    num: RunResult | float | None,
    den: RunResult | float | None,
    target: float | None = None,
    note: str = "",
) -> Ratio:
    """A throughput ratio; when one of its runs overlapped other work, its verdict is withheld."""

    def tok_s(x):
        return x.output_tok_s if isinstance(x, RunResult) else x

    ratio = _ratio(name, tok_s(num), tok_s(den), target, note=note)
    loads = [
        x.other_load for x in (num, den) if isinstance(x, RunResult) and x.other_load is not None
    ]
    if loads and max(loads) >= NOISY_LOAD:
        ratio.met = None
        ratio.note = "; ".join(
            filter(
                None,
                [
                    note,
                    f"not trustworthy: other work kept {max(loads):.2f} cores busy during a run",
                ],
            )
        )
    return ratio


def suite_ratios(
    results: list[RunResult], peers: list[PeerFigures], pool_tokens: int
) -> list[Ratio]:
    """The issue's targets, each computed from runs of this invocation.

    Peers' figures are as their source says."""
    ratios = _equal_memory_ratios(results, pool_tokens)
    ratios.append(
        _timed_ratio(
            "W2 prefix caching on / off throughput",
            _find(results, PREFIX_ON, "W2"),
            _find(results, PREFIX_OFF, "W2"),
            2,
        )
    )
    w2 = _find(results, PREFIX_ON, "W2")
    ratios.append(
        _ratio(
            "W2 prompt tokens computed / sent, prefix on",
            w2.prompt_tokens_computed if w2 else None,
            w2.prompt_tokens if w2 else None,
            0.25,
            at_most=True,
        )
    )
    paged_labels = {PREFIX_ON, PREFIX_OFF, equal_memory_label("paged", pool_tokens)}
    ratios += _peer_ratios(results, peers, paged_labels)
    return [r for r in ratios if r.value is not None]


def _equal_memory_ratios(results: list[RunResult], pool_tokens: int) -> list[Ratio]:
    """Paged against both reservation policies at one KV budget, and paged's utilization."""
    paged_eq = next(
        (r for r in results if r.label == equal_memory_label("paged", pool_tokens)), None
    )
    if paged_eq is None:
        return []
    wl = paged_eq.workload
    ratios = [
        _timed_ratio(
            f"{wl} paged / {policy} throughput, equal KV memory",
            paged_eq,
            _find(results, equal_memory_label(policy, pool_tokens), wl),
            target,
        )
        for policy, target in (("reserve-max", 2), ("reserve-output", None))
    ]
    ratios.append(
        Ratio(
            f"{wl} KV token utilization, paged, block {paged_eq.extra.get('block_size')}",
            paged_eq.kv_util_mean,
            "≥ 0.99",
            None if paged_eq.kv_util_mean is None else paged_eq.kv_util_mean >= 0.99,
            "mean over steps of tokens held / slots allocated",
        )
    )
    return ratios


def _peer_ratios(
    results: list[RunResult], peers: list[PeerFigures], paged_labels: set[str]
) -> list[Ratio]:
    """Our best paged run on each workload against each peer's best figure."""
    ratios = []
    for key in ("W1", "W2", "W3"):
        ours = max(
            (r for r in results if r.workload == key and r.label in paged_labels),
            key=lambda r: r.output_tok_s,
            default=None,
        )
        for match, target in (("static", 3 if key == "W1" else None), ("vllm", 1), ("llama", None)):
            best = best_of(peers, match, key)
            if best is not None and ours is not None:
                ratios.append(
                    _timed_ratio(
                        f"{key} pagedkv (best paged run: {ours.label}) / {best[1]}",
                        ours,
                        best[0],
                        target,
                        note=_source(peers, best[1]),
                    )
                )
    return ratios


def _source(peers: list[PeerFigures], name: str) -> str:
    return next((p.source for p in peers if p.peer == name), "")
