"""A bus outage is an event, not only a log line (analytics/service/bus_outage.py): the analytics consumer
publishes ``analytics.bus_outage`` for each job whose fail-stop judgement it suspended — the start
and, once caught up, the end with its duration — and the console folds them into the job's page as
a bus outage. On the embedded bus with the bus client's own health marked down and up; the real
broker's outage is tests/test_bus_outage.py."""

from __future__ import annotations

import uuid
from pathlib import Path

from analytics.service.bus_outage import OutageGuard
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from collector import topics
from collector.auth import load_keyring
from collector.bus import BusHealth, Consumer
from collector.embedded import EmbeddedBus
from collector.events import BusOutage, Envelope, EventFactory
from collector.stream import EventStream
from ui.read_model import ReadModel
from tests.fixtures.payloads import payload_as, payloads_as


def _outage_events(bus: EmbeddedBus) -> list[Envelope]:
    with EventStream(bus, f"check-{uuid.uuid4().hex}", [topics.ANALYTICS]) as stream:
        return [d.event for d in stream.poll(timeout_s=0.2) if isinstance(d.event.payload, BusOutage)]


def test_an_outage_publishes_its_start_and_end_per_job_once_the_bus_is_back(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        consumer = bus.consumer("analytics", [topics.TELEMETRY])
        consumer.health = BusHealth()  # this consumer's own, as a Kafka consumer has its bus's
        guard = OutageGuard(bus, consumer, [topics.TELEMETRY])
        watches = {"job-a": FailStopWatch(DetectorConfig(), dead={3}), "job-b": FailStopWatch(DetectorConfig())}
        watches["job-a"].new_epoch({0, 1, 2, 3})
        watches["job-b"].new_epoch({0, 1})
        consumer.poll(timeout_s=0)  # assigned, at the end of an empty log

        consumer.health.mark_down("broker unreachable: connection refused")
        guard.after_step(0, watches)
        assert all(w.suspended for w in watches.values())
        assert _outage_events(bus) == []  # the bus is down: the start waits for it

        consumer.health.mark_up()
        guard.after_step(0, watches)
        assert not any(w.suspended for w in watches.values())
        events = _outage_events(bus)
        by_job = {(e.job, payload_as(e, BusOutage).ended_s is None): e for e in events}
        assert len(events) == 4 and set(by_job) == {("job-a", True), ("job-a", False), ("job-b", True), ("job-b", False)}
        end = payload_as(by_job[("job-a", False)], BusOutage)
        assert end.outage_id == payload_as(by_job[("job-a", True)], BusOutage).outage_id and end.ranks_suspended == 3
        assert end.duration_s is not None and end.duration_s >= 0 and "connection refused" in end.reason
        assert all(load_keyring().verify(e) is None for e in events)  # signed as analytics

        guard.after_step(0, watches)
        assert len(_outage_events(bus)) == 4  # said once

    model = ReadModel()
    for e in events:
        model.apply(e)
    (shown,) = model.jobs["job-a"].outages.values()
    assert shown.ended_s is not None and shown.ranks_suspended == 3
    assert [m.kind for m in model.jobs["job-a"].marks] == ["outage"]
    # a forged outage (unsigned) is not shown: it is a rejection
    forged = EventFactory("job-c", "analytics").make(BusOutage(outage_id="x", started_s=1.0, ended_s=2.0, duration_s=1.0))
    model.apply(forged)
    assert "job-c" not in model.jobs and forged.id in {r.event_id for r in model.security.rejected}


def _one_job_guard(bus: EmbeddedBus) -> tuple[Consumer, OutageGuard, dict[str, FailStopWatch]]:
    """A consumer with its own bus health, assigned at the end of an empty log, guarding one job of one rank."""
    consumer = bus.consumer("analytics", [topics.TELEMETRY])
    consumer.health = BusHealth()
    watches = {"job-a": FailStopWatch(DetectorConfig())}
    watches["job-a"].new_epoch({0})
    consumer.poll(timeout_s=0)
    return consumer, OutageGuard(bus, consumer, [topics.TELEMETRY]), watches


def test_a_consumer_that_defers_to_another_publishes_no_outage(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        consumer, guard, watches = _one_job_guard(bus)
        consumer.health.mark_down("gone")
        guard.after_step(0, watches, publish=False)
        consumer.health.mark_up()
        guard.after_step(0, watches, publish=False)
        assert not watches["job-a"].suspended and _outage_events(bus) == []


def test_an_outage_starts_at_the_clients_first_failure_even_when_seen_after_it_ended(tmp_path: Path) -> None:
    """The consumer may look at its client only after a long poll: the outage's start is when the
    client first failed, not when the step saw it, so the console's duration is the outage's."""
    import time

    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        consumer, guard, watches = _one_job_guard(bus)
        consumer.health.mark_down("broker unreachable")
        failed_at = consumer.health.down_since
        consumer.health.mark_up()  # down and up again between two looks
        time.sleep(0.05)
        guard.after_step(0, watches)
        (start, end) = sorted(payloads_as(_outage_events(bus), BusOutage), key=lambda o: o.ended_s is not None)
        assert start.started_s == end.started_s == failed_at
        assert end.duration_s is not None and end.duration_s >= 0.05
