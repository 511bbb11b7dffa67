"""Tokens per engine step, as a cumulative histogram read at scrape time
(vLLM's iteration_tokens_total).

Written by the engine thread, read by /metrics: plain integer updates, so a
scrape sees a consistent-enough snapshot without a lock on the step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepTokens:
    buckets: tuple[int, ...] = ITERATION_BUCKETS
    counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_BUCKETS) + 1)
    )  # last: +Inf
    total: int = 0

    def observe(self, tokens: int) -> None:
        if tokens > 0:
            self.counts[bisect.bisect_left(self.buckets, tokens)] += 1
            self.total += tokens

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, count of steps with at most le tokens)] with '+Inf' last, as Prometheus wants."""
        out, running = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], list(self.counts)):
            running += n
            out.append((le, running))
        return out
