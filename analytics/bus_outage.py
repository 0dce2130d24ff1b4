"""Fail-stop judgement through a bus outage: suspended while the bus is down and until caught up.

A broker outage stops every rank's events at once, and when the broker is back their partitions
(and their producers' reconnections) resume unevenly: judged as usual, ranks whose events come
back last look dead (an 88 s outage once produced 275 false fail-stops). The outage is the bus
client's to see — its connection errors and failed metadata (``BusHealth``, collector/bus.py) —
not the detector's: missing heartbeats are what an outage and a dead rank have in common.

So the analytics consumer, after each step, asks its bus client. From the first sign of an outage
(the bus down now, or an outage counted since the last look, however short) every job's fail-stop
watch is suspended; it resumes once the bus is up and this consumer has read to the end of every
partition it owns (a poll returned nothing and its positions reached the log's end offsets). Both
moments are logged as one JSON line (``fail_stop_suspended`` / ``fail_stop_resumed``) with the
reason, so an operator sees why nothing was judged meanwhile.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from analytics.fail_stop import FailStopWatch
from collector.bus import Bus, Consumer

log = logging.getLogger(__name__)


@dataclass
class OutageGuard:
    bus: Bus
    consumer: Consumer
    topics: Sequence[str]
    suspended: bool = False
    suspended_at: float = 0.0
    _outages_seen: int = 0

    def after_step(self, consumed: int, watches: Iterable[FailStopWatch]) -> None:
        """Suspend or resume ``watches`` (every job's) from what the bus client saw."""
        health = self.consumer.health
        if health.down or health.outages != self._outages_seen:
            self._outages_seen = health.outages
            if not self.suspended:
                self.suspended, self.suspended_at = True, time.time()
                self._say("fail_stop_suspended", reason=health.reason or "the bus was unreachable")
        if not self.suspended:
            return
        if health.down or consumed or not self._caught_up():
            for watch in watches:
                watch.suspend()  # jobs first seen meanwhile too
            return
        for watch in watches:
            watch.resume()
        self.suspended = False
        self._say("fail_stop_resumed", suspended_s=round(time.time() - self.suspended_at, 1))

    def _caught_up(self) -> bool:
        """This consumer's positions reached the end of every partition it owns."""
        positions = self.consumer.positions()
        if not positions:
            return False
        try:
            ends = self.bus.end_offsets(list(self.topics))
        except Exception as exc:  # noqa: BLE001 - any failure to ask means "not yet"; the next step asks again
            log.debug("end offsets unavailable: %s", exc)
            return False
        return all(positions.get(tp, 0) >= end for tp, end in ends.items() if tp in positions)

    @staticmethod
    def _say(event: str, **fields: object) -> None:
        log.warning("%s", json.dumps({"event": event, **fields}))
