"""A second analytics consumer on one bus is detected, warns, and publishes no incidents
(analytics/service/lease.py); a successor that starts after its predecessor stopped is not a duplicate.
Leases travel on a real embedded bus and are read back through the consumers' own stream."""

from __future__ import annotations

import logging
from pathlib import Path

from analytics.service.lease import EXPIRY_INTERVALS, LEASE_INTERVAL_S, AnalyticsLeases
from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import AnalyticsLease
from collector.stream import EventStream

T0 = 1_800_000_000.0


def _read(stream: EventStream, *leases: AnalyticsLeases) -> None:
    deliveries = stream.poll(timeout_s=0.1)
    for lease in leases:
        lease.apply(None, deliveries)  # type: ignore[arg-type]  # no table: the connection is unused


def test_the_later_of_two_running_consumers_defers_and_says_so(tmp_path: Path, caplog) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    first = AnalyticsLeases(db="a.duckdb", instance="first", started_s=T0)
    second = AnalyticsLeases(db="b.duckdb", instance="second", started_s=T0 + 30)
    read_first = EventStream(bus, "analytics-a", [topics.ANALYTICS])
    read_second = EventStream(bus, "analytics-b", [topics.ANALYTICS])
    caplog.set_level(logging.WARNING)
    assert first.tick(bus, now_s=T0) is True
    assert second.tick(bus, now_s=T0 + 30) is True  # nothing seen yet: no evidence of another
    for k in range(1, 4):  # both renew while both run
        now = T0 + 30 + k * LEASE_INTERVAL_S
        first.tick(bus, now_s=now)
        _read(read_first, first)
        _read(read_second, second)
        second.tick(bus, now_s=now)
    assert second.deferring_to == "first" and second.tick(bus, now_s=T0 + 50) is False
    assert first.deferring_to is None and first.tick(bus, now_s=T0 + 50) is True
    said = caplog.text
    assert '"analytics_duplicate"' in said and '"deferring_to": "first"' in said
    assert '"analytics_duplicate_seen"' in said  # the holder warns too
    published = [d.event.payload for d in EventStream(bus, "check", [topics.ANALYTICS]).poll(timeout_s=0.1)]
    assert any(isinstance(p, AnalyticsLease) and p.instance == "second" and p.deferring_to == "first"
               for p in published)

    first.release(bus)
    _read(read_second, second)
    assert second.tick(bus, now_s=T0 + 55) is True and second.deferring_to is None


def test_a_successor_of_a_stopped_consumer_publishes_at_once(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    gone = AnalyticsLeases(instance="gone", started_s=T0)
    for k in range(3):
        gone.tick(bus, now_s=T0 + k * LEASE_INTERVAL_S)  # then it crashed: no release
    successor = AnalyticsLeases(instance="successor", started_s=T0 + 2 * LEASE_INTERVAL_S + 1)
    _read(EventStream(bus, "successor", [topics.ANALYTICS]), successor)
    assert successor.others["gone"].started_s == T0  # it did read the old leases
    assert successor.tick(bus, now_s=successor.started_s) is True
    assert successor.holder(now_s=T0 + EXPIRY_INTERVALS * LEASE_INTERVAL_S) is None
