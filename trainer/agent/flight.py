"""The flight record: the step each rank is in and the last op it entered, in a small file.

A rank stuck inside a collective cannot say so, and a stopped one cannot say anything, so each
rank keeps its record where the agent can read it without the rank's help: one fixed-size slot
per rank in ``$RESIHP_FLIGHT_DIR/local-<LOCAL_RANK>.flight``, rewritten in place (``pwrite``,
no fsync: the agent reads the page cache on the same host). Each write is one JSON object padded
to ``SLOT_BYTES``; a reader that catches a write half done sees invalid JSON and skips that read.

``seq`` counts the ops a rank entered since its current step began (so ranks compare alike even
when one of them missed steps, as a rank that rejoins a shrunk world has): when the world hangs,
the ranks waiting in a collective have entered one more op than the rank that keeps them waiting, which is how the
agent names the culprit and the op it is stuck in (trainer/agent/hang.py). Times are this host's
``time.time()``, compared only with the same host's clock.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field

from collector.settings import elastic_environment, environment

FLIGHT_DIR_ENV = "RESIHP_FLIGHT_DIR"
SLOT_BYTES = 1024
FINISHED = "finished"  # the op of a rank that is past its last step
LOST = "lost"  # the op the agent records for a rank that died while the job went on (--on-failure shrink)
RECENT_STEPS = 8  # iteration durations kept for the expected-step estimate


def flight_file_path(flight_dir: str, local_rank: int | str) -> str:
    return os.path.join(flight_dir, f"local-{local_rank}.flight")


@dataclass(frozen=True)
class FlightEntry:
    """What one rank last wrote: its step, the op it is in, and how long its recent steps took."""

    rank: int
    pid: int
    restart: int
    iteration: int
    step_started_s: float
    op: str
    op_entered_s: float
    seq: int
    recent_step_s: tuple[float, ...] = field(default_factory=tuple)
    stopped: bool = False  # set by the agent, not the rank: its process is stopped (SIGSTOP, a debugger)

    @classmethod
    def from_json(cls, text: str) -> FlightEntry:
        data = json.loads(text)
        data["recent_step_s"] = tuple(data.get("recent_step_s", ()))
        return cls(**data)


class FlightRecorder:
    """The writing side, one per rank process. ``step(i)`` when iteration ``i`` begins, ``enter(op)``
    before every op that can block (a collective, a send, a checkpoint write)."""

    def __init__(self, path: str, rank: int, restart: int = 0) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.rank, self.restart, self.pid = rank, restart, os.getpid()
        self.iteration = -1
        self.step_started_s = time.time()
        self.op, self.op_entered_s, self.seq = "start", self.step_started_s, 0
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._write()

    @classmethod
    def from_env(cls) -> FlightRecorder | None:
        """The recorder the agent asked for (None when the script runs without ``resihp run``)."""
        flight_dir = environment().flight_dir
        if not flight_dir:
            return None
        elastic = elastic_environment()
        return cls(flight_file_path(flight_dir, str(elastic.LOCAL_RANK)), elastic.RANK,
                   elastic.TORCHELASTIC_RESTART_COUNT)

    def step(self, iteration: int) -> None:
        now = time.time()
        if self.iteration >= 0:
            self._recent.append(now - self.step_started_s)
        self.iteration, self.step_started_s = iteration, now
        self.seq = 0
        self.enter("step")

    def enter(self, op: str) -> None:
        self.op, self.op_entered_s = op, time.time()
        self.seq += 1
        self._write()

    def _write(self) -> None:
        entry = {"rank": self.rank, "pid": self.pid, "restart": self.restart, "iteration": self.iteration,
                 "step_started_s": self.step_started_s, "op": self.op[:200], "op_entered_s": self.op_entered_s,
                 "seq": self.seq, "recent_step_s": [round(s, 6) for s in self._recent]}
        os.pwrite(self._fd, json.dumps(entry).encode().ljust(SLOT_BYTES), 0)

    def finish(self) -> None:
        """The rank is past its last step (teardown can be slow; it is not a hang)."""
        self.enter(FINISHED)
        os.close(self._fd)


def read_flight(path: str) -> FlightEntry | None:
    """The slot's record, or None while there is none or a write is half done."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SLOT_BYTES)
        return FlightEntry.from_json(raw.decode().strip())
    except (OSError, ValueError, TypeError, UnicodeDecodeError):
        return None
