"""Retention on the embedded bus: old telemetry goes, offsets never restart, a consumer that lost
records says so, the control topic cannot be trimmed, and a trimmed log reuses its disk."""

from __future__ import annotations

import logging
import os

import pytest

from collector import embedded, topics
from collector.bus import RawMessage, TopicPartition
from collector.embedded import EmbeddedBus

TELEMETRY = TopicPartition(topics.TELEMETRY, 0)


class FakeClock:
    """Stands in for the ``time`` module inside collector.embedded: publish times are chosen."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(embedded, "time", fake)
    return fake


def publish(bus: EmbeddedBus, n: int, tag: str, size: int = 16) -> None:
    bus.publish_raw([RawMessage(topics.TELEMETRY, b"k", f"{tag}-{i}".encode().ljust(size, b".")) for i in range(n)])


def embedded_consumer(bus: EmbeddedBus, group: str) -> embedded.EmbeddedConsumer:
    """A consumer of the telemetry topic; the embedded one, which counts what retention took."""
    consumer = bus.consumer(group, [topics.TELEMETRY])
    assert isinstance(consumer, embedded.EmbeddedConsumer)
    return consumer


def read_all(consumer) -> list[bytes]:
    out: list[bytes] = []
    while batch := consumer.poll(1_000, timeout_s=0.0):
        out.extend(r.value.rstrip(b".") for r in batch)
    return out


def test_retention_deletes_expired_records_as_publishing_goes_on(tmp_path, clock):
    bus = EmbeddedBus(tmp_path / "bus.sqlite", retention_s={topics.TELEMETRY: 60.0})
    publish(bus, 5, "old")
    clock.now += 50
    publish(bus, 5, "mid")  # "old" is 50 s old: kept
    assert bus.consumer("g1", [topics.TELEMETRY]).poll(100, 0.0)[0].offset == 0
    clock.now += 20
    publish(bus, 5, "new")  # "old" is 70 s old: gone; "mid" is 20 s old: kept
    consumer = embedded_consumer(bus, "g2")
    assert read_all(consumer) == [f"mid-{i}".encode() for i in range(5)] + [f"new-{i}".encode() for i in range(5)]
    assert consumer.lost_to_retention == {TELEMETRY: 5}  # a new group starts at 0: those 5 are gone
    assert bus.end_offsets([topics.TELEMETRY]) == {TELEMETRY: 15}


def test_other_topics_keep_everything(tmp_path, clock):
    bus = EmbeddedBus(tmp_path / "bus.sqlite", retention_s={topics.TELEMETRY: 1.0})
    bus.publish_raw([RawMessage(topics.ANALYTICS, None, b"a")])
    clock.now += 100
    bus.publish_raw([RawMessage(topics.ANALYTICS, None, b"b")])
    publish(bus, 1, "t")
    assert [r.value for r in bus.consumer("g", [topics.ANALYTICS]).poll(10, 0.0)] == [b"a", b"b"]


def test_the_newest_record_stays_so_offsets_never_restart(tmp_path, clock):
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    publish(bus, 4, "a")
    assert bus.trim(topics.TELEMETRY, older_than_s=clock.now + 1e9) == 3
    publish(bus, 2, "b")
    consumer = bus.consumer("g", [topics.TELEMETRY])
    assert [r.offset for r in consumer.poll(10, 0.0)] == [3, 4, 5]
    assert bus.trim(topics.TELEMETRY, older_than_s=0.0) == 0


def test_a_consumer_behind_the_cut_continues_and_reports_what_it_lost(tmp_path, clock, caplog):
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    publish(bus, 10, "a")
    consumer = embedded_consumer(bus, "slow")
    assert len(consumer.poll(3, 0.0)) == 3
    consumer.commit()
    clock.now += 10
    publish(bus, 2, "b")
    assert bus.trim(topics.TELEMETRY, older_than_s=clock.now - 5) == 10
    with caplog.at_level(logging.WARNING, logger="collector.embedded"):
        assert read_all(consumer) == [b"b-0", b"b-1"]
    assert consumer.lost_to_retention == {TELEMETRY: 7}
    assert "group slow lost 7 offsets 3-9 of resihp.telemetry to retention" in caplog.text
    resumed = embedded_consumer(bus, "slow")  # from the committed offset 3: the same loss, once
    assert read_all(resumed) == [b"b-0", b"b-1"] and resumed.lost_to_retention == {TELEMETRY: 7}


def test_seeking_to_the_beginning_of_a_trimmed_log_is_no_loss(tmp_path, clock):
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    publish(bus, 6, "a")
    bus.trim(topics.TELEMETRY, older_than_s=clock.now + 1)
    consumer = embedded_consumer(bus, "g")
    consumer.seek_to_beginning()
    assert read_all(consumer) == [b"a-5"] and consumer.lost_to_retention == {}


@pytest.mark.parametrize("retention, message", [
    ({topics.CONTROL: 3600.0}, "resihp.control cannot have a retention: the remediation lifecycle"),
    ({topics.TELEMETRY: 0.0}, "retention of resihp.telemetry must be a positive number of seconds, got 0.0"),
    ({topics.TELEMETRY: float("nan")}, "must be a positive number of seconds, got nan"),
])
def test_a_retention_that_would_lose_the_record_is_refused(tmp_path, retention, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EmbeddedBus(tmp_path / "bus.sqlite", retention_s=retention)
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    with pytest.raises(ValueError, match="resihp.control cannot be trimmed"):
        bus.trim(topics.CONTROL, older_than_s=0.0)


def test_the_environment_sets_the_telemetry_retention(tmp_path, monkeypatch):
    monkeypatch.setenv(embedded.RETENTION_ENV, "90")
    assert EmbeddedBus(tmp_path / "a.sqlite").retention_s == {topics.TELEMETRY: 90.0}
    assert EmbeddedBus(tmp_path / "b.sqlite", retention_s={}).retention_s == {}  # an explicit choice wins
    monkeypatch.setenv(embedded.RETENTION_ENV, "a day")
    with pytest.raises(ValueError, match="RESIHP_EMBEDDED_TELEMETRY_RETENTION_S='a day': give the telemetry"):
        EmbeddedBus(tmp_path / "c.sqlite")


def test_a_log_under_retention_stops_growing_on_disk(tmp_path, clock):
    """Deleted pages are reused: a steady stream under retention holds a steady file."""
    path = tmp_path / "bus.sqlite"
    bus = EmbeddedBus(path, retention_s={topics.TELEMETRY: 10.0})
    sizes = []
    for second in range(120):
        publish(bus, 20, f"s{second}", size=4_000)  # 80 KB a second, 10 s kept: ~0.8 MB live
        clock.now += 1
        if second % 30 == 29:
            bus._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes.append(os.path.getsize(path))
    assert sizes[-1] < 1.25 * sizes[0], sizes  # without retention the file would be 4x its size at 30 s
    assert bus.end_offsets([topics.TELEMETRY]) == {TELEMETRY: 2_400}
