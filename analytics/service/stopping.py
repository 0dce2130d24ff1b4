"""A clean stop on SIGINT for the analytics loops: the request is noted, and the loop ends at its
next step boundary with everything it read committed.

Why not Python's own ``KeyboardInterrupt``: DuckDB checks for signals while a query runs and turns
the interrupt into ``RuntimeError: Query interrupted`` inside the projection's transaction. The
batch rolls back (nothing is lost or doubled: the offsets commit with the rows), but the process
ends with a traceback and exit 1 where it was asked to stop. A handler that only notes the request
runs inside DuckDB's check, returns, and the query goes on. A second SIGINT raises
``KeyboardInterrupt`` at once: an operator who presses Ctrl-C twice means now.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOPPED_BY_SIGINT = 130  # the shell's code for a process ended by SIGINT


class StopRequest:
    """``with StopRequest() as stop: while not stop.requested: …`` — SIGINT sets ``requested``.

    Installed only in the main thread, and not where SIGINT is ignored (a process started in the
    background by a shell inherits it ignored and must stay so)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> StopRequest:
        """Take SIGINT over (see the class); :meth:`restore` gives it back."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def __enter__(self) -> StopRequest:
        return self.install()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def exit_code(self) -> int:
        """What the loop's process returns: 130 when SIGINT stopped it, else 0."""
        return STOPPED_BY_SIGINT if self.requested else 0
