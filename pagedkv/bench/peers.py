"""The peers' figures (output tok/s per workload): measured result files when present, else
the README's table.

Result files are what `shared/bench/peers/*` write to /tmp/peers/results (or
$PEERS_RESULTS): {"peer": name, "results": [{"workload": "W1-mixed",
"output_tok_s": ...}, ...]}. Without them the figures come from
shared/bench/README.md, labelled as not measured in this run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedkv.bench.workloads import WORKLOAD_KEYS

DEFAULT_RESULTS_DIR = "/tmp/peers/results"
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


@dataclass
class PeerFigures:
    peer: str
    tok_s: dict[str, float | None]  # workload key -> best output tok/s
    cells: dict[str, str]  # workload key -> what to print (the README's text, or the number)
    source: str  # "measured <path>" or "README (earlier runs, not this one)"

    def to_json(self) -> dict:
        return asdict(self)


def _workload_key(name: str) -> str | None:
    key = name.split("-", 1)[0]
    return key if key in WORKLOAD_KEYS else None


def from_results(results_dir: str | Path) -> list[PeerFigures]:
    """One PeerFigures per result file; several rows for a workload (batch sizes) keep the best."""
    peers = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            rows = data["results"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        best: dict[str, float] = {}
        for row in rows:
            key = _workload_key(str(row.get("workload", "")))
            value = row.get("output_tok_s")
            if key and isinstance(value, (int, float)):
                best[key] = max(best.get(key, 0.0), float(value))
        if best:
            tok_s = {k: best.get(k) for k in WORKLOAD_KEYS}
            cells = {k: (f"{v:.0f}" if v is not None else "–") for k, v in tok_s.items()}
            peers.append(PeerFigures(data.get("peer", path.stem), tok_s, cells, f"measured {path}"))
    return peers


def from_readme(readme: str | Path) -> list[PeerFigures]:
    """The `| peer | W1 | W2 | W3 |` table of shared/bench/README.md.

    A cell's number is its best figure."""
    try:
        lines = Path(readme).read_text().splitlines()
    except OSError:
        return []
    peers, in_table = [], False
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = cells[:4] == ["peer", *WORKLOAD_KEYS]
            continue
        if not line.startswith("|"):
            break
        if set(cells[0]) <= set("-: "):
            continue
        values = dict(zip(WORKLOAD_KEYS, cells[1:4]))
        tok_s = {k: _best(v) for k, v in values.items()}
        peers.append(PeerFigures(cells[0], tok_s, values, "README (earlier runs, not this one)"))
    return peers


def _best(cell: str) -> float | None:
    numbers = [float(n.replace(",", "")) for n in _NUMBER.findall(cell)]
    return max(numbers) if numbers else None


def load_peers(
    results_dir: str | None = None, readme: str | Path | None = None
) -> list[PeerFigures]:
    """Measured results when any exist, else the README's figures (empty when neither is found)."""
    results_dir = results_dir or os.environ.get("PEERS_RESULTS", DEFAULT_RESULTS_DIR)
    peers = from_results(results_dir) if Path(results_dir).is_dir() else []
    if peers:
        return peers
    if readme is None:
        repo = Path(__file__).resolve().parents[2]
        readme = next(
            (
                p
                for p in (repo.parent / "shared/bench/README.md", repo / "shared/bench/README.md")
                if p.is_file()
            ),
            None,
        )
    return from_readme(readme) if readme else []


def best_of(peers: list[PeerFigures], match: str, key: str) -> tuple[float, str] | None:
    """The best figure on workload `key` among peers whose name contains `match`.

    The match ignores case."""
    found = [
        (tok_s, p.peer)
        for p in peers
        if match.lower() in p.peer.lower() and (tok_s := p.tok_s.get(key))
    ]
    return max(found) if found else None
