"""SIGINT stops the analytics loops at a step boundary (analytics/service/stopping.py): noted, never
raised into a DuckDB query. The process-level run is tests/test_analytics_kill.py's SIGINT test."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import duckdb
import pytest

from analytics.service.stopping import STOPPED_BY_SIGINT, StopRequest

LONG_QUERY = "SELECT count(*) FROM range(400000000) t(i) WHERE i % 7 = 3"  # about a second or more


@pytest.fixture(autouse=True)
def sigint_at_its_default() -> Iterator[None]:
    """Python's own SIGINT handler, whatever this run inherited: a shell's background job (as
    `make test` runs the fast tier) starts with SIGINT ignored, which StopRequest leaves alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _sigint_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_a_sigint_during_a_duckdb_query_is_noted_and_the_query_finishes() -> None:
    conn = duckdb.connect()
    with StopRequest() as stop:
        timer = _sigint_in(0.2)
        (count,) = conn.execute(LONG_QUERY).fetchone() or (None,)
        timer.join()
    assert count == len(range(3, 400000000, 7)) and stop.requested and stop.exit_code() == STOPPED_BY_SIGINT


def test_without_it_duckdb_turns_the_sigint_into_an_interrupted_query() -> None:
    """What the handler is for: Python's default handler raises, and DuckDB aborts the query."""
    conn = duckdb.connect()
    timer = _sigint_in(0.2)
    with pytest.raises((KeyboardInterrupt, RuntimeError, duckdb.Error)):
        conn.execute(LONG_QUERY).fetchone()
    timer.join()


def test_a_second_sigint_raises_and_the_old_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and StopRequest().exit_code() == 0


def test_an_ignored_sigint_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
        assert not stop.requested
    finally:
        signal.signal(signal.SIGINT, previous)
