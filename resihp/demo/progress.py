"""The live status line: what the demo is doing now, from the log the watcher folded.

On a terminal it is one line rewritten in place on stderr; otherwise (a log file, a test) a line
is printed whenever the phase changes, and at most every ``quiet_s`` seconds otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from resihp.demo.watch import LogState


def phase(state: LogState, components: str) -> str:
    """The latest milestone of the story, in words."""
    milestones: list[tuple[float, str]] = []
    for f in state.injected:
        where = f"device {f.location.rank}" if f.location.rank is not None else f"node {f.location.node}"
        milestones.append((f.time_s, f"fault injected: {f.category} on {where}"))
    for i in state.incidents.values():
        milestones.append((i.opened_at_s, f"detected: {i.summary}"))
    for p in state.plans.values():
        milestones.append((p.proposed_time_s, f"planned {p.plan_id} ({p.strategy}, epoch {p.base_epoch}→{p.epoch})"))
        if p.applied_time_s is not None:
            verdict = f"; {p.status.replace('_', ' ')}" if p.status in ("verified", "rolled_back") else ""
            milestones.append((p.applied_time_s + 1e-6, f"applied {p.plan_id}: epoch {p.epoch} "
                               f"(decided by {p.decided_by}, pause {p.pause_s:.1f} s){verdict}"))
    if milestones:
        text = max(milestones)[1]
    elif state.summaries:
        text = "healthy warm-up"
    else:
        text = f"starting {components}"
    return text


def recent_tokens_per_s(state: LogState, iterations: int = 5) -> float | None:
    last = state.summaries[-iterations:]
    wall = sum(s.wall_s for s in last)
    return sum(s.tokens for s in last) / wall if wall > 0 else None


class Progress:
    def __init__(self, stream: TextIO | None = None, quiet_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.quiet_s = quiet_s
        self.t0 = time.monotonic()
        self._last_phase = ""
        self._last_print = 0.0
        self._width = 0

    def update(self, state: LogState, components: str) -> None:
        now = time.monotonic()
        ph = phase(state, components)
        rate = recent_tokens_per_s(state)
        n_open = len(state.open_incidents)
        applied = sum(1 for p in state.plans.values() if p.applied_time_s is not None)
        line = (f"[demo {now - self.t0:5.0f}s] iteration {max(state.iteration, 0)} · epoch {state.epoch} · "
                f"{'-' if rate is None else f'{rate:,.0f}'} tok/s · incidents {n_open} open/{len(state.incidents)} · "
                f"plans {applied} applied/{len(state.plans)} · {ph}")
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
            self.stream.flush()
        elif ph != self._last_phase or now - self._last_print >= self.quiet_s:
            print(line, file=self.stream, flush=True)
            self._last_print = now
        self._last_phase = ph

    def message(self, text: str) -> None:
        """A line of its own (the status line, if any, is finished first)."""
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
