"""One analytics consumer publishes per bus: leases on the analytics topic tell a second one apart.

Two ``resihp analytics`` processes on one bus with different DuckDB files would each run the
detector and publish every incident twice, silently. So each publishes an ``analytics.lease``
(its random instance id, start time and DuckDB file) every ``LEASE_INTERVAL_S`` and a released one
when it stops, and reads the others' (this is a projection with no table: it only watches).

The instance that started first holds the bus. A later one that sees the holder's lease renewed
while it runs — so both run now, not one after the other — defers: it logs an
``analytics_duplicate`` JSON line at error level, says whom it defers to in its own leases
(``deferring_to``), and publishes nothing from its detector (analytics/service/consumer.py empties
its outbox) until the holder releases or stops renewing for ``EXPIRY_INTERVALS`` intervals. The
holder goes on and logs that it sees a duplicate. A successor that starts after its predecessor
stopped never defers: the predecessor's last lease came before the successor started.

On Kafka a second consumer in the same consumer group gets part of the partitions instead; the
leases of all instances share one key, so whichever instance reads that partition sees both.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb

from collector.bus import Bus
from collector.events import AnalyticsLease, EventFactory
from collector.stream import Delivery

LEASE_INTERVAL_S = 5.0
EXPIRY_INTERVALS = 3.0
LEASE_JOB = "resihp"  # leases are about the bus, not a job
log = logging.getLogger(__name__)


@dataclass
class _Seen:
    started_s: float
    last_s: float
    released: bool


@dataclass
class AnalyticsLeases:
    db: str = ""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started_s: float = field(default_factory=time.time)
    deferring_to: str | None = None
    others: dict[str, _Seen] = field(default_factory=dict)
    _next_s: float = 0.0
    _seen_duplicates: set[str] = field(default_factory=set)
    _factory: EventFactory | None = None
    tables: tuple[str, ...] = ()

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        """No table: leases are live state, not history."""

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            p = d.event.payload
            if isinstance(p, AnalyticsLease) and p.instance != self.instance:
                seen = self.others.get(p.instance)
                last = max(d.event.time_s, seen.last_s if seen else float("-inf"))
                self.others[p.instance] = _Seen(p.started_s, last, p.released or bool(seen and seen.released))

    def _concurrent(self, now_s: float) -> dict[str, _Seen]:
        """Other instances renewing now that also renewed since this one started."""
        expiry = EXPIRY_INTERVALS * LEASE_INTERVAL_S
        return {i: s for i, s in self.others.items()
                if not s.released and s.last_s >= self.started_s and now_s - s.last_s <= expiry}

    def holder(self, now_s: float | None = None) -> str | None:
        """The instance this one defers to (an older concurrent one), or None: this one publishes."""
        now_s = time.time() if now_s is None else now_s
        older = [(s.started_s, i) for i, s in self._concurrent(now_s).items()
                 if (s.started_s, i) < (self.started_s, self.instance)]
        return min(older)[1] if older else None

    def tick(self, bus: Bus, now_s: float | None = None) -> bool:
        """Renew the lease when due and decide whether this one defers; True while it publishes."""
        now_s = time.time() if now_s is None else now_s
        holder = self.holder(now_s)
        if holder != self.deferring_to:
            self.deferring_to = holder
            if holder is not None:
                log.error("%s", json.dumps({"event": "analytics_duplicate", "instance": self.instance, "db": self.db,
                                            "deferring_to": holder, "what": "another analytics consumer runs on this "
                                            "bus; this one publishes no incidents until it stops"}))
            else:
                log.warning("%s", json.dumps({"event": "analytics_lease_held", "instance": self.instance}))
        for other in self._concurrent(now_s):
            if other not in self._seen_duplicates and holder is None:
                self._seen_duplicates.add(other)
                log.error("%s", json.dumps({"event": "analytics_duplicate_seen", "instance": self.instance,
                                            "other": other, "what": "a second analytics consumer runs on this bus; "
                                            "it defers to this one"}))
        if now_s >= self._next_s:
            self._publish(bus, released=False, now_s=now_s)
            self._next_s = now_s + LEASE_INTERVAL_S
        return self.deferring_to is None

    def release(self, bus: Bus) -> None:
        """Say this one stopped, so a successor need not wait for the lease to expire."""
        self._publish(bus, released=True, now_s=time.time())

    def _publish(self, bus: Bus, *, released: bool, now_s: float) -> None:
        lease = AnalyticsLease(instance=self.instance, started_s=self.started_s, db=self.db,
                               deferring_to=self.deferring_to, released=released)
        if self._factory is None:  # one source per instance, so (source, seq) never collides
            self._factory = EventFactory(LEASE_JOB, f"analytics:{self.instance}")
        bus.publish([self._factory.make(lease, time_s=now_s)])
