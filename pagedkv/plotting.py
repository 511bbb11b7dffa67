"""matplotlib on demand.

Plots are an optional extra (`pip install "pagedkv[plot]"`), never needed by the server.
"""

from __future__ import annotations

from types import ModuleType

from pagedkv.config import ConfigError


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (no display needed).

    Without matplotlib, a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError('--plot needs matplotlib: pip install "pagedkv[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
