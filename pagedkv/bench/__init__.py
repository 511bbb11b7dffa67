"""`pagedkv bench`: the shared workloads through the offline engine or the server, measured
and compared.

workloads.py (W1/W2/W3, traces) -> offline.py / online.py (one RunResult per run) ->
suite.py (what --suite runs, the issue's ratios) + peers.py -> report.py (JSON, markdown),
plot.py (PNGs).
"""
