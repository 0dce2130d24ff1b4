"""One conformance suite, run unchanged against every bus backend (embedded log and real Kafka)."""

from __future__ import annotations

import base64

import pytest

from collector import topics
from collector.bus import RawMessage, TopicPartition
from collector.codec import decode, encode
from collector.events import Chunk, Coords, DeadLetter, EventFactory, Heartbeat, RankIteration
from collector.stream import EventStream


def telemetry(factory: EventFactory, rank: int, iteration: int) -> RankIteration:
    return RankIteration(
        epoch=0, iteration=iteration, rank=rank, coords=Coords(tp=0, pp=rank % 4, dp=rank // 4), wall_s=1.0,
        chunks=[
            Chunk(kind="F", microbatch=m, tokens=4096, seq_lens=[1024, 2048, 1024], start_s=0.1 * m, duration_s=0.05)
            for m in range(4)
        ],
    )


def publish_ranks(bus, ranks: int, iterations: int, job: str = "job-a") -> list:
    factories = {r: EventFactory(job, f"rank-{r}") for r in range(ranks)}
    events = []
    for it in range(iterations):
        batch = [factories[r].make(telemetry(factories[r], r, it)) for r in range(ranks)]
        bus.publish(batch)
        events.extend(batch)
    return events


def drain(stream: EventStream, expect: int, rounds: int = 60) -> list:
    out = []
    for _ in range(rounds):
        out.extend(stream.poll(max_records=5000, timeout_s=1.0))
        if len(out) >= expect:
            break
    return out


def test_published_events_are_consumed_identically(bus):
    sent = publish_ranks(bus, ranks=3, iterations=4)
    with EventStream(bus, "g-identity", [topics.TELEMETRY]) as stream:
        got = drain(stream, len(sent))
    assert sorted(d.event.id for d in got) == sorted(e.id for e in sent)
    by_id = {e.id: e for e in sent}
    assert all(d.event == by_id[d.event.id] for d in got)


def test_one_sources_events_stay_in_order(bus):
    sent = publish_ranks(bus, ranks=5, iterations=6)
    with EventStream(bus, "g-order", [topics.TELEMETRY]) as stream:
        got = drain(stream, len(sent))
    assert len(got) == len(sent)
    per_source: dict[str, list[int]] = {}
    for d in got:
        per_source.setdefault(d.event.source, []).append(d.event.seq)
    assert len(per_source) == 5
    assert all(seqs == sorted(seqs) for seqs in per_source.values())


def test_committed_offsets_resume_the_group(bus_factory):
    bus = bus_factory()
    sent = publish_ranks(bus, ranks=2, iterations=5)  # 10 events
    with EventStream(bus, "g-resume", [topics.TELEMETRY]) as first:
        got_first = drain(first, len(sent))
        assert len(got_first) == len(sent)
        # commit only the first half (by per-partition position) of what was read
        half = {}
        for d in got_first[: len(sent) // 2]:
            half[TopicPartition(d.topic, d.partition)] = d.offset + 1
        first.commit(half)
    done = {d.event.id for d in got_first[: len(sent) // 2]}
    with EventStream(bus_factory(), "g-resume", [topics.TELEMETRY]) as second:
        got_second = drain(second, len(sent) - len(done))
    resumed = {d.event.id for d in got_second}
    assert resumed.isdisjoint(done)
    assert resumed | done == {e.id for e in sent}


def test_a_new_group_reads_from_the_beginning(bus):
    sent = publish_ranks(bus, ranks=1, iterations=3)
    with EventStream(bus, "g-one", [topics.TELEMETRY]) as one:
        assert len(drain(one, len(sent))) == len(sent)
        one.commit()
    with EventStream(bus, "g-two", [topics.TELEMETRY]) as two:
        assert {d.event.id for d in drain(two, len(sent))} == {e.id for e in sent}


def test_seek_to_beginning_replays_everything(bus):
    sent = publish_ranks(bus, ranks=2, iterations=2)
    with EventStream(bus, "g-replay", [topics.TELEMETRY]) as stream:
        first = drain(stream, len(sent))
        stream.seek_to_beginning()
        again = drain(stream, len(sent))
    assert [d.event.id for d in first] and sorted(d.event.id for d in again) == sorted(e.id for e in sent)


def test_positions_from_on_assign_win_over_committed_offsets(bus):
    sent = publish_ranks(bus, ranks=1, iterations=6)
    with EventStream(bus, "g-stored", [topics.TELEMETRY]) as stream:
        drain(stream, len(sent))
        stream.commit()  # the group says "all done" ...

    # ... but the consumer's own store says it has applied only the first two records.
    def stored(partitions):
        return {tp: 2 for tp in partitions}

    with EventStream(bus, "g-stored", [topics.TELEMETRY], on_assign=stored) as stream:
        got = drain(stream, len(sent) - 2)
    assert sorted(d.event.seq for d in got) == [2, 3, 4, 5]


def test_kinds_are_routed_to_their_topics(bus):
    f = EventFactory("job-a", "rank-0")
    hb = f.make(Heartbeat(rank=0, epoch=0, iteration=0, interval_s=1.0))
    bus.publish([hb])
    with EventStream(bus, "g-route", [topics.TELEMETRY, topics.CONTROL]) as stream:
        got = drain(stream, 1)
    assert [(d.topic, d.event.id) for d in got] == [(topics.TELEMETRY, hb.id)]
    end = bus.end_offsets([topics.CONTROL])
    assert sum(end.values()) == 0


@pytest.mark.parametrize(
    "raw, reason_part",
    [
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b'{"id": "x"', "Invalid JSON"),
        (b'{"id":"a","kind":"telemetry.nope","schema_version":1}', "does not match any of the expected tags"),
        (b"", "empty record"),
    ],
)
def test_bad_records_go_to_the_dead_letter_topic_with_reason_and_bytes(bus, raw, reason_part):
    f = EventFactory("job-a", "rank-0")
    good = f.make(Heartbeat(rank=0, epoch=0, iteration=0, interval_s=1.0))
    bus.publish_raw([RawMessage(topics.TELEMETRY, b"job-a/rank-0", raw)])
    bus.publish([good])
    with EventStream(bus, "g-dlq", [topics.TELEMETRY]) as stream:
        got = drain(stream, 1)
        assert [d.event.id for d in got] == [good.id]
        assert stream.counters.dead_letters == 1
    with EventStream(bus, "g-dlq-reader", [topics.DEADLETTER]) as dlq:
        letters = drain(dlq, 1)
    assert len(letters) == 1
    letter = letters[0].event.payload
    assert isinstance(letter, DeadLetter)
    assert reason_part in letter.reason
    assert base64.b64decode(letter.raw_b64) == raw
    assert letter.topic == topics.TELEMETRY and letter.group == "g-dlq"


def test_the_same_bad_record_read_twice_gives_the_same_dead_letter_id(bus):
    bus.publish_raw([RawMessage(topics.TELEMETRY, None, b"not json")])
    ids = []
    for _ in range(2):  # a consumer that crashed before committing reads it again
        with EventStream(bus, "g-dlq-twice", [topics.TELEMETRY]) as stream:
            drain(stream, 0, rounds=2)
    with EventStream(bus, "g-dlq-twice-reader", [topics.DEADLETTER]) as dlq:
        ids = [d.event.id for d in drain(dlq, 2)]
    assert len(ids) == 2 and len(set(ids)) == 1


def test_encoded_bytes_on_the_bus_decode_to_the_published_event(bus):
    f = EventFactory("job-a", "rank-3")
    report = telemetry(f, 3, 7)
    event = f.make(report)
    bus.publish([event])
    consumer = bus.consumer("g-raw", [topics.TELEMETRY])
    try:
        records = []
        for _ in range(30):
            records.extend(consumer.poll(10, 1.0))
            if records:
                break
    finally:
        consumer.close()
    assert len(records) == 1
    assert records[0].value == encode(event)
    assert records[0].key == f"job-a/replica-{report.coords.dp}".encode()  # rank reports: keyed by replica
    assert decode(records[0].value) == event


def test_a_consumer_that_only_polls_without_waiting_still_gets_records(bus):
    """Trainers and simulators check for commands between iterations with timeout 0."""
    f = EventFactory("job-a", "remediation")
    hb = f.make(Heartbeat(rank=0, epoch=0, iteration=0, interval_s=1.0))
    bus.publish([hb])
    with EventStream(bus, "g-nowait", [topics.TELEMETRY]) as stream:
        got = []
        for _ in range(400):
            got.extend(stream.poll(100, 0.0))
            if got:
                break
    assert [d.event.id for d in got] == [hb.id]
