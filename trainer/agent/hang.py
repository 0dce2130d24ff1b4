"""Judging a hang from the flight records, and the report that names the stuck op.

A rank is hung when it has made no progress — entered no op, begun no step — for longer than its
deadline: ``factor`` × the expected step time, never less than ``floor_s``. Progress, not the
step's length: a rank slowed ×4 still enters its ops one after the other (it is fail-slow, the
detector's to size), while a stopped or deadlocked one enters none. A rank that has not finished a
step in this world yet is warming up (loading a checkpoint, compiling) and is not judged. The expected time is, first found: ``--expected-step-s``; the iteration time the
analytics consumer's cost model predicts for the job (its newest ``analytics.prediction``, read
from the bus by trainer/agent/predicted.py); the median of the ranks' own recent steps. Before any
of these exists nothing is judged (the rendezvous and first-step warm-up are covered by torch's
own timeouts). The report says which one set the deadline.

The culprit is the rank that fell behind: the world's ranks enter the same ops in the same order,
so when one rank stops, the others enter the next collective and wait there, one op ahead of it.
The ranks with the lowest (iteration, seq) are named, with the op they last entered; when every
rank is at the same op (a collective that never completes, a network hang) all are named and the
op is the collective, unless some of them are stopped processes (their agent says so in the
record): a rank stopped inside the collective has entered it like its peers, yet it is the one
they wait for, so the stopped ones are named. Stacks come from faulthandler (trainer/agent/child.py): a stopped process
cannot dump, and the report says so rather than waiting.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.agent.child import STACK_SIGNAL
from trainer.agent.flight import FINISHED, LOST, FlightEntry

STACK_CHARS = 4000  # per rank, the newest part of its dump


@dataclass(frozen=True)
class HangPolicy:
    factor: float = 3.0
    floor_s: float = 5.0
    expected_step_s: float | None = None

    def expected_s(self, entries: Mapping[int, FlightEntry],
                   predicted_s: float | None = None) -> tuple[float, str] | None:
        """The expected step time and where it came from (None: no estimate yet)."""
        if self.expected_step_s:
            return self.expected_step_s, "--expected-step-s"
        if predicted_s:
            return predicted_s, "the cost model's prediction"
        recent = [s for e in entries.values() for s in e.recent_step_s]
        return (statistics.median(recent), "the ranks' recent steps") if recent else None

    def deadline_s(self, expected_s: float) -> float:
        return max(self.floor_s, self.factor * expected_s)


@dataclass(frozen=True)
class HangReport:
    iteration: int
    expected_s: float
    deadline_s: float
    stuck_for_s: float
    culprits: tuple[int, ...]
    op: str
    ops: dict[int, str]
    stacks: dict[int, str] = field(default_factory=dict)
    expected_from: str = "the ranks' recent steps"

    def summary(self) -> str:
        waiting = sorted(set(self.ops) - set(self.culprits))
        waiting_ops = sorted({self.ops[r] for r in waiting})
        tail = f"; ranks {waiting} wait in {', '.join(waiting_ops)}" if waiting else ""
        return (f"hang: rank{'s' if len(self.culprits) > 1 else ''} {list(self.culprits)} stuck in '{self.op}' at "
                f"iteration {self.iteration} for {self.stuck_for_s:.1f} s (deadline {self.deadline_s:.1f} s = "
                f"max(floor, {self.expected_s:.2f} s expected step × factor), expected from {self.expected_from}){tail}")


def judge_hang(entries: Mapping[int, FlightEntry], policy: HangPolicy, now_s: float | None = None,
               predicted_s: float | None = None) -> HangReport | None:
    """The hang report for these ranks' flight records (one restart of one world), or None.
    ``predicted_s``: the cost model's iteration time for the job, when the bus has one."""
    entries = {r: e for r, e in entries.items() if e.op not in (FINISHED, LOST)}
    if not entries:
        return None
    now_s = time.time() if now_s is None else now_s
    estimate = policy.expected_s(entries, predicted_s)
    if estimate is None:
        return None
    expected, expected_from = estimate
    deadline = policy.deadline_s(expected)
    behind_key = min((e.iteration, e.seq) for e in entries.values())
    culprits = tuple(sorted(r for r, e in entries.items() if (e.iteration, e.seq) == behind_key))
    stopped = tuple(r for r in culprits if entries[r].stopped)
    if stopped and len(stopped) < len(culprits):
        culprits = stopped
    if any(not entries[r].recent_step_s for r in culprits):
        return None  # warming up in this world: the rendezvous and first step are torch's timeouts' to judge
    stuck_for = max(now_s - max(entries[r].op_entered_s, entries[r].step_started_s) for r in culprits)
    if stuck_for <= deadline:
        return None
    first = entries[culprits[0]]
    return HangReport(iteration=first.iteration, expected_s=expected, deadline_s=deadline, stuck_for_s=stuck_for,
                      culprits=culprits, op=first.op, ops={r: e.op for r, e in sorted(entries.items())},
                      expected_from=expected_from)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T for stopped, Z, …; '?' if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def collect_stacks(pids: Mapping[int, int], stack_files: Mapping[int, str], wait_s: float = 0.5) -> dict[int, str]:
    """Every thread's stack of each rank (rank → text), by SIGUSR1 to its faulthandler."""
    sizes = {r: _size(stack_files[r]) for r in pids}
    stopped = {r for r, pid in pids.items() if process_state(pid) == "T"}
    for r, pid in pids.items():
        if r not in stopped:
            try:
                os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
    time.sleep(wait_s)
    stacks = {}
    for r, pid in pids.items():
        if r in stopped:
            stacks[r] = f"(pid {pid} is stopped (state T: SIGSTOP or a debugger); it cannot dump a stack until it runs)"
            continue
        try:
            with open(stack_files[r], "rb") as f:
                f.seek(sizes[r])
                text = f.read().decode(errors="replace")
        except OSError as exc:
            text = f"(no stack file: {exc})"
        stacks[r] = text[-STACK_CHARS:] or f"(pid {pid} wrote no stack within {wait_s:.1f} s; state {process_state(pid)})"
    return stacks


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
