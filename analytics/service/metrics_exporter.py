"""The analytics consumer's ``/metrics``: the goodput projection's figures, the consumer's lag and
dead letters, refreshed after every committed transaction and served from a daemon thread.

A scrape renders the snapshot taken after the last commit, so what it shows is always one whole
transaction's state: never half a batch, and (the projection's state being stored with the
offsets) never less than the last scrape before a restart.
"""

from __future__ import annotations

import sys
import time

from analytics.projections.goodput_projection import GoodputProjection
from analytics.service.metrics import AnalyticsCollector, AnalyticsSnapshot, MetricsServer, consumer_lag
from collector.bus import Bus
from collector.stream import EventStream


class AnalyticsExporter:
    """Owns the snapshot the collector renders; :meth:`refresh` after each ``Projector.step``."""

    def __init__(self, projection: GoodputProjection, bus: Bus, stream: EventStream, *, port: int,
                 host: str = "127.0.0.1", lag_every_s: float = 1.0) -> None:
        self.projection = projection
        self.bus = bus
        self.stream = stream
        self.lag_every_s = lag_every_s
        self._snapshot = AnalyticsSnapshot()
        self._lag: dict[tuple[str, str], int] = {}
        self._lag_at = float("-inf")
        self.server = MetricsServer(AnalyticsCollector(lambda: self._snapshot), host, port).start()
        self.refresh(force=True)

    @property
    def url(self) -> str:
        return self.server.url

    def refresh(self, *, changed: bool = True, force: bool = False) -> None:
        """Take a new snapshot: the projection's figures when a transaction committed, the lag at
        most every ``lag_every_s`` (it asks the bus for the end of every topic)."""
        now = time.monotonic()
        lag_due = force or now - self._lag_at >= self.lag_every_s
        if not (changed or lag_due):
            return
        if lag_due:
            self._lag = consumer_lag(self.bus, self.stream.group, self.stream.consumer.positions())
            self._lag_at = now
        jobs = self.projection.snapshot() if (changed or force) else self._snapshot.jobs
        self._snapshot = AnalyticsSnapshot(jobs=jobs, lag=dict(self._lag),
                                           dead_letters={self.stream.group: self.stream.counters.dead_letters})

    def announce(self) -> None:
        print(f'{{"event": "metrics", "url": "{self.url}"}}', file=sys.stderr, flush=True)

    def close(self) -> None:
        self.server.close()
