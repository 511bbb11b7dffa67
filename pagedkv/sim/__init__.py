"""The seeds' reservation-vs-paging experiment (`pagedkv simulate`) and the capacity planner
(`pagedkv plan`).

`simulate` and the trace helpers are pure Python (no torch), fast enough for
the dashboard's Play panel to call on every change.
"""

from pagedkv.sim.simulate import DEFAULT_POLICIES, PolicyResult, SimResult, fit_ratio, simulate
from pagedkv.sim.trace import TraceRequest, generate_trace, load_trace

__all__ = [
    "DEFAULT_POLICIES",
    "PolicyResult",
    "SimResult",
    "TraceRequest",
    "fit_ratio",
    "generate_trace",
    "load_trace",
    "simulate",
]
