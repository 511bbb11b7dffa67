"""SIGTERM before a command's own handling takes over: an exit through Python, so that what was
started is undone (the default action kills the process where it stands)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def exit_on_sigterm(message: str) -> Iterator[None]:
    """SIGTERM ends the process through Python's exit (status 143, as the signal's own), so that
    what was started is undone: -tp workers stopped and their rendezvous folder deleted, a bench's
    server stopped (the default action left the folder, and the server running). uvicorn puts its
    own handler over this one while it serves. `message` goes to stderr after the handler, which
    must not write: stderr may be mid-write (a progress line) when the signal comes."""
    if threading.current_thread() is not threading.main_thread():  # (signal.signal refuses)
        yield
        return
    stopped = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopped.set()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if stopped.is_set():
            print(message, file=sys.stderr, flush=True)
