"""Sharded analytics on the real Kafka broker: the same recorded telemetry through one shard and
through three shards of one consumer group gives the same incidents, while one of the three leaves
the group mid-run (a rebalance hands its partitions over): nothing lost, nothing doubled. (One run
covers both claims: three shards of which one is killed; a run of three undisturbed shards costs
another ~30 s of CI for nothing the killed run does not show.)"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from analytics.sharding.merge import JobMerge
from analytics.sharding.shards import ShardWorker
from collector import topics
from collector.events import DetectorFits, EventFactory, Heartbeat, IncidentOpened, RankIteration, TracingDeclared
from collector.kafka_bus import KafkaBus
from collector.stream import EventStream
from collector.topics import replica_partition
from tests.fixtures.payloads import payload_as
from test_detect_detector import opened, run, synth

pytestmark = pytest.mark.kafka

ITERATIONS = 24


def _recording() -> list:
    # 6 replicas (tp2·pp3·dp6) so that 3 shards each hold some of the 8 telemetry partitions' keys
    return synth(dp=6, slow={7: 1.3}, start=10, iterations=ITERATIONS, plan=True)


def _sharded_run(bootstrap: str, events: list, shards: int, kill_at: int | None = None) -> tuple[JobMerge, list, list]:
    """Publish the recording to a fresh namespace, run ``shards`` workers in one group (a thread
    each, as separate processes would poll) and the merge, which publishes its fits for them, until
    every iteration is judged; workers read a few records per poll, as a loaded shard does.
    ``kill_at``: once the first worker emitted that many summaries, it stops and leaves the group without another commit (its partitions, and
    its replicas half read, are rebuilt by the others from the log)."""
    bus = KafkaBus(bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}.")
    bus.publish(events)
    workers = [ShardWorker(bus, "j", "analytics-shards", name=f"s{i}") for i in range(shards)]
    stops = [threading.Event() for _ in workers]
    give_up = time.monotonic() + 240  # a guard against hanging, not a speed bound: the asserts say what failed

    def loop(i: int) -> None:
        w = workers[i]
        while not stops[i].is_set() and time.monotonic() < give_up:
            w.step(max_records=40, timeout_s=0.05)
            if i == 0 and kill_at is not None and w.shard.emitted >= kill_at:
                break
        w.close()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(shards)]
    for t in threads:
        t.start()
    merge = JobMerge("j")
    merge_in = EventStream(bus, "analytics-merge", [topics.ANALYTICS, topics.CONTROL])
    fits = EventFactory("j", "analytics-merge")
    out: list = []
    try:
        while merge.detector.stats.frames < ITERATIONS and time.monotonic() < give_up:
            for d in merge_in.poll(10_000, 0.1):
                got = merge.on_event(d.event)
                out += got
                bus.publish([fits.make(p) for p in got if isinstance(p, DetectorFits)])  # what the shards predict with
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join()
    try:  # what shards emitted after the last iteration was judged: read, so every summary counts once
        idle = 0
        while idle < 3:
            batch = merge_in.poll(10_000, 0.2)
            idle = 0 if batch else idle + 1
            for d in batch:
                out += merge.on_event(d.event)
        return merge, out, workers
    finally:
        merge_in.close()
        bus.close()


def _incidents(out) -> list[tuple]:
    return [(p.iteration, p.locations[0].target, p.locations[0].rank) for p in out if isinstance(p, IncidentOpened)]


def _read_all(bus: KafkaBus, expect: int) -> list:
    """Every telemetry record (``expect`` of them) through a fresh group: polled until they are all
    read, not once — a fresh broker's group coordinator can take more than a poll to answer."""
    got: list = []
    deadline = time.monotonic() + 120
    with EventStream(bus, "reader", [topics.TELEMETRY]) as reader:
        while len(got) < expect:
            assert time.monotonic() < deadline, f"read {len(got)} of {expect} records"
            got += reader.poll(100_000, 1.0)
    return got


def test_on_kafka_each_replica_lands_in_the_partition_its_rule_names(kafka_bootstrap: str) -> None:
    """The producer's partitioner puts replica D of a job where ``replica_partition`` says (not
    where the key's hash would), reports and the heartbeats that follow them alike."""
    bus = KafkaBus(kafka_bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}.")
    try:
        events = synth(dp=6, iterations=2, plan=True)
        bus.publish(events)
        got = _read_all(bus, sum(topics.TELEMETRY in topics.topics_for(e.kind) for e in events))
        reports = [d for d in got if isinstance(d.event.payload, RankIteration)]
        assert len(reports) == 6 * 6 * 2
        rule = {d: replica_partition(f"j/replica-{d}".encode(), topics.PARTITIONS[topics.TELEMETRY]) for d in range(6)}
        assert len(set(rule.values())) == 6  # six replicas, six partitions of the eight
        placed = [(payload_as(d.event, RankIteration), d.partition) for d in reports]
        assert {(report.coords.dp, partition) for report, partition in placed} == set(rule.items())
        replica_of = {report.rank: report.coords.dp for report, _ in placed}
        beats = [d for d in got if isinstance(d.event.payload, Heartbeat) and d.event.payload.rank in replica_of]
        assert beats and all(d.partition == rule[replica_of[payload_as(d.event, Heartbeat).rank]] for d in beats)
    finally:
        bus.close()


def test_on_kafka_a_tracing_declaration_reaches_every_partition_once_each(kafka_bootstrap: str) -> None:
    """Every shard must read which ranks and steps are traced: the declaration goes to each
    telemetry partition, the copies sharing one event id."""
    bus = KafkaBus(kafka_bootstrap, namespace=f"t{uuid.uuid4().hex[:10]}.")
    try:
        declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=[0, 2], seq_lens=False, tokens=False,
                                   fused_p2p=True)
        bus.publish([EventFactory("j", "trainer").make(declared)])
        got = _read_all(bus, topics.PARTITIONS[topics.TELEMETRY])
        assert sorted(d.partition for d in got) == list(range(topics.PARTITIONS[topics.TELEMETRY]))
        assert len({d.event.id for d in got}) == 1 and all(d.event.payload == declared for d in got)
    finally:
        bus.close()


def test_one_and_three_shards_on_kafka_and_a_shard_killed_mid_run(kafka_bootstrap: str) -> None:
    events = _recording()
    _, single = run(events)
    (reference,) = _incidents(single)
    assert reference[1:] == ("compute", 7)

    m1, out1, _ = _sharded_run(kafka_bootstrap, events, 1)
    mk, outk, workers = _sharded_run(kafka_bootstrap, events, 3, kill_at=8)  # three shards, one of them killed
    for merge, out in ((m1, out1), (mk, outk)):
        assert merge.detector.stats.frames == ITERATIONS  # every iteration judged once, none lost
        (inc,) = _incidents(out)
        assert inc[1:] == reference[1:] and abs(inc[0] - reference[0]) <= 1
        assert len(opened(out)) == 1  # nothing doubled
    assert m1.duplicates == 0
    emitted = sum(w.shard.emitted for w in workers)
    assert emitted >= 6 * ITERATIONS and mk.duplicates == emitted - 6 * ITERATIONS
    killed, survivors = workers[0].shard, workers[1:]
    handed_over = killed.replicas_emitted() & set().union(*(w.shard.replicas_emitted() for w in survivors))
    assert killed.emitted and handed_over, "the killed shard's replicas were not taken over by the others"
