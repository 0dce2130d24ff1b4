"""Sharded analytics in process: per-replica frames from N shards, merged, give the incidents of the
single detector; copies of a frame are dropped; rank reports are keyed by replica on the bus."""

from __future__ import annotations

import numpy as np

from analytics.frame import build_frame
from analytics.merge import JobMerge, concat_frames
from analytics.shards import ReplicaShard, shard_all
from collector.events import Coords, EventFactory, Heartbeat, IncidentOpened, RankIteration, ReplicaFrame
from collector.topics import PartitionKeys
from test_detect_detector import opened, run, synth


def _sharded(events, shards: int, *, replay: int = 0) -> tuple[JobMerge, list]:
    """Replicas dealt to ``shards`` shards (replica % shards, as a keyed partition would); their
    frames reach the merge interleaved by iteration, as concurrent shards publish them. ``replay``:
    shard 0 emits its frames that many more times (a successor rebuilding from the log)."""
    frames: list[ReplicaFrame] = []
    for i in range(shards):
        mine = [e for e in events if not isinstance(e.payload, RankIteration) or e.payload.coords.dp % shards == i]
        got = shard_all(ReplicaShard("j", f"s{i}"), mine)
        frames += got * (1 + replay if i == 0 else 1)
    frames.sort(key=lambda f: (f.epoch, f.iteration))
    merge = JobMerge("j")
    out: list = []
    for e in events:
        if e.kind.startswith("plan."):
            out += merge.on_event(e)
    f = EventFactory("j", "shard")
    for fr in frames:
        out += merge.on_event(f.make(fr))
    return merge, out + merge.flush()


def _incidents(out) -> list[tuple]:
    return [(p.iteration, p.locations[0].target, p.locations[0].rank, p.locations[0].replica)
            for p in out if isinstance(p, IncidentOpened)]


def test_one_and_three_shards_raise_the_single_detectors_incidents() -> None:
    events = synth(slow={7: 1.3}, start=10, plan=True)
    _, single = run(events)
    expected = _incidents(single)
    assert [(t, r) for _, t, r, _ in expected] == [("compute", 7)]
    for n in (1, 3):
        merge, out = _sharded(events, n)
        assert _incidents(out) == expected, n
        assert merge.duplicates == 0
        assert merge.detector.stats.frames == 24


def test_a_replayed_shard_doubles_nothing() -> None:
    events = synth(slow={7: 1.3}, start=10, plan=True)
    merge, out = _sharded(events, 3, replay=1)
    assert len(opened(out)) == 1
    assert merge.duplicates == 24  # shard 0 holds one replica: each of its 24 frames came twice
    assert merge.detector.stats.frames == 24


def test_the_merged_frame_is_the_single_frame() -> None:
    events = synth(iterations=1, plan=False)
    reports = [e.payload for e in events if isinstance(e.payload, RankIteration)]
    whole = build_frame(reports)
    shard = ReplicaShard("j")
    parts = [p for e in events for p in shard.on_event(e)] + shard.flush()
    merged = concat_frames(0, 0, parts[::-1])  # any order of replicas
    for name in ("rank", "dp", "wall_s", "c_rank", "c_kind", "c_own", "c_s2", "k_rank", "k_dur", "k_wait"):
        a, b = getattr(whole, name), getattr(merged, name)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), name


def test_a_shard_waits_for_every_rank_of_a_replica() -> None:
    events = [e for e in synth(iterations=3, plan=True) if not isinstance(e.payload, Heartbeat)]
    shard = ReplicaShard("j")
    held_back = [e for e in events if isinstance(e.payload, RankIteration) and e.payload.rank == 0
                 and e.payload.iteration == 1]
    emitted = [p for e in events if e not in held_back for p in shard.on_event(e)]
    assert (0, 1, 0) not in {(f.epoch, f.iteration, f.replica) for f in emitted}  # rank 0 of replica 0 missing
    late = shard.on_event(held_back[0])
    assert [(f.iteration, f.replica, f.ranks) for f in late] == [(1, 0, 6)]


def test_rank_reports_are_keyed_by_replica_and_heartbeats_follow_them() -> None:
    keys = PartitionKeys()
    h = Heartbeat(rank=13, epoch=0, iteration=0, interval_s=1.0)
    assert keys.key("j", "rank-13", h.KIND, h) == b"j/rank-13"  # before its first report: its own key
    r = RankIteration(epoch=0, iteration=0, rank=13, coords=Coords(tp=1, pp=0, dp=2), wall_s=1.0, chunks=[])
    assert keys.key("j", "rank-13", r.KIND, r) == b"j/replica-2"
    assert keys.key("j", "rank-13", h.KIND, h) == b"j/replica-2"  # then in its reports' partition, in order
    assert keys.key("other", "rank-13", h.KIND, h) == b"other/rank-13"


def test_shard_and_merge_workers_on_the_embedded_bus_publish_the_incident(tmp_path) -> None:
    from analytics.merge import MergeWorker
    from analytics.shards import ShardWorker
    from collector import topics
    from collector.bus import open_bus
    from collector.stream import EventStream

    with open_bus("embedded", path=str(tmp_path / "bus.sqlite")) as bus:
        bus.publish(synth(slow={7: 1.3}, start=10, plan=True))
        shard, merge = ShardWorker(bus, "j", "shards", name="s0"), MergeWorker(bus, "merge")
        while shard.step(timeout_s=0.05) or merge.step(timeout_s=0.05):
            pass
        shard.close()
        merge.close()
        with EventStream(bus, "reader", [topics.ANALYTICS]) as reader:
            got = [d.event.payload for d in reader.poll(100_000, 0.5)]
    (inc,) = [p for p in got if isinstance(p, IncidentOpened)]
    assert (inc.locations[0].target, inc.locations[0].rank) == ("compute", 7)
    assert sum(isinstance(p, ReplicaFrame) for p in got) == 3 * 24
