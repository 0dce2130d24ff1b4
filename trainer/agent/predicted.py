"""The cost model's iteration time for the job, as the analytics consumer publishes it.

The analytics consumer fits the cost model (T_mb ≈ α·N + β·Σlᵢ² + γ) and the schedule DAG on the
job's healthy telemetry and publishes, per iteration, what the job should have taken
(``analytics.prediction``: ``predicted_s``). The agent's hang deadline is a multiple of that
(trainer/agent/hang.py): a step judged against what the job *should* take, not against its own
recent history, which a slow-but-alive rank has already stretched.

Read from the end of the analytics topic (older predictions describe another layout), without
blocking: the agent polls it from its monitor loop. A bus that cannot be read leaves the last
value (or none) in place; the deadline then falls back to the ranks' own step times. Only a
prediction analytics signed moves the deadline: a forged tiny one would call every step a hang.
"""

from __future__ import annotations

import logging

from collector import topics
from collector.auth import Gate
from collector.bus import Bus
from collector.events import IterationPrediction
from collector.stream import EventStream

log = logging.getLogger("resihp.agent")


class PredictedIteration:
    """The newest ``predicted_s`` the analytics consumer published for ``job``."""

    def __init__(self, bus: Bus, job: str, group: str) -> None:
        self.job = job
        self.latest_s: float | None = None
        self.iteration = -1
        self._bus = bus
        self._stream = EventStream(bus, group, [topics.ANALYTICS], job=job,
                                   on_assign=lambda tps: bus.end_offsets([tp.topic for tp in tps]))
        self._gate = Gate(group)

    def poll(self) -> float | None:
        """Read what arrived since the last poll; returns the newest prediction (None: none yet)."""
        try:
            for delivery in self._stream.poll(timeout_s=0):
                p = delivery.event.payload
                if delivery.event.job == self.job and isinstance(p, IterationPrediction) and \
                        p.iteration >= self.iteration and p.predicted_s > 0 and self._gate.admit(delivery.event):
                    self.latest_s, self.iteration = p.predicted_s, p.iteration
            if rejected := self._gate.take():
                self._bus.publish(rejected)
        except Exception as exc:  # noqa: BLE001 - the deadline falls back to the ranks' own steps
            log.warning("cannot read the cost model's predictions for %s: %s", self.job, exc)
        return self.latest_s

    def close(self) -> None:
        self._stream.close()
        self._bus.close()
