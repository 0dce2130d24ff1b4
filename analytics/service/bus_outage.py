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
reason, and published per job as an ``analytics.bus_outage`` event (start; end with its duration and
the ranks whose judgement waited), which the console shows on the job's page as a bus outage. The
events wait in memory until the bus takes them: the start is published after the bus is back.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from analytics.detection.fail_stop import FailStopWatch
from collector.auth import Signer, load_keyring
from collector.bus import Bus, Consumer
from collector.events import DURATION_MAX_S, BusOutage, Envelope, EventFactory

_NS = uuid.UUID("5c0e7b7a-41d2-4c1f-9b55-2f0d6a8e3c11")
SOURCE = "analytics"

log = logging.getLogger(__name__)


@dataclass
class OutageGuard:
    bus: Bus
    consumer: Consumer
    topics: Sequence[str]
    suspended: bool = False
    suspended_at: float = 0.0
    reason: str = ""
    _outages_seen: int = 0
    _announced: set[str] = field(default_factory=set)  # jobs told of the current outage's start
    _pending: list[Envelope] = field(default_factory=list)  # outage events the bus has not taken yet

    def after_step(self, consumed: int, watches: Mapping[str, FailStopWatch], publish: bool = True) -> None:
        """Suspend or resume ``watches`` (job -> its fail-stop watch) from what the bus client saw,
        and publish the outage's events once the bus takes them (``publish`` False: another
        consumer holds the analytics lease and speaks for the job)."""
        health = self.consumer.health
        if health.down or health.outages != self._outages_seen:
            self._outages_seen = health.outages
            if not self.suspended:  # the outage began at the client's first failure, not when this step saw it
                self.suspended, self.suspended_at = True, health.last_down_since or time.time()
                self.reason, self._announced = health.reason or "the bus was unreachable", set()
                self._say("fail_stop_suspended", reason=self.reason)
        if self.suspended:
            self._announce(watches)
            if health.down or consumed or not self._caught_up():
                for watch in watches.values():
                    watch.suspend()  # jobs first seen meanwhile too
            else:
                ended = time.time()
                for job, watch in watches.items():
                    self._pending.append(self._event(job, watch, ended))
                    watch.resume()
                self.suspended = False
                self._say("fail_stop_resumed", suspended_s=round(ended - self.suspended_at, 1))
        if self._pending and not health.down:
            self._flush(publish)

    def _announce(self, watches: Mapping[str, FailStopWatch]) -> None:
        for job, watch in watches.items():
            if job not in self._announced:
                self._announced.add(job)
                self._pending.append(self._event(job, watch, None))

    def _event(self, job: str, watch: FailStopWatch, ended: float | None) -> Envelope:
        outage_id = f"{job}/{self.suspended_at:.3f}"
        payload = BusOutage(outage_id=outage_id, started_s=self.suspended_at, ended_s=ended,
                            duration_s=None if ended is None else min(ended - self.suspended_at, DURATION_MAX_S),
                            reason=self.reason[:2000], ranks_suspended=len(watch.watched - watch.dead))
        event_id = uuid.uuid5(_NS, f"{outage_id}/{'start' if ended is None else 'end'}").hex
        factory = Signer(EventFactory(job, SOURCE), "analytics", load_keyring())
        return factory.make(payload, time_s=ended or self.suspended_at, event_id=event_id)

    def _flush(self, publish: bool) -> None:
        if not publish:
            self._pending = []
            return
        try:
            self.bus.publish(self._pending)
        except Exception as exc:  # noqa: BLE001 - the bus went again: the events wait for the next step
            log.debug("bus outage events not published yet: %s", exc)
            return
        self._pending = []

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
