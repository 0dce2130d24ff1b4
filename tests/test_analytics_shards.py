"""Sharded analytics in process: per-replica summaries from N shards, merged, give the incidents of
the single detector; the merge's scores are the single detector's; copies of a summary are dropped;
rank reports are keyed by replica on the bus."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from analytics.detection.detector import Detector
from analytics.detection.config import DetectorConfig
from analytics.sharding.in_process import run_sharded
from analytics.sharding.merge import JobMerge
from analytics.sharding.shards import ReplicaShard
from collector.events import (
    Coords, DetectorFits, EventFactory, Heartbeat, IncidentOpened, IterationPrediction, RankIteration, ReplicaSummary,
    TracingDeclared,
)
from collector.topics import PartitionKeys, replica_partition, to_every_partition
from test_detect_detector import opened, run, synth



def _incidents(out) -> list[tuple]:
    return [(p.iteration, p.locations[0].target, p.locations[0].rank, p.locations[0].replica)
            for p in out if isinstance(p, IncidentOpened)]


def test_one_and_three_shards_raise_the_single_detectors_incidents() -> None:
    events = synth(slow={7: 1.3}, start=10, plan=True)
    _, single = run(events)
    expected = _incidents(single)
    assert [(t, r) for _, t, r, _ in expected] == [("compute", 7)]
    for n in (1, 3):
        merge, out = run_sharded(events, n)
        assert _incidents(out) == expected, n
        assert merge.duplicates == 0
        assert merge.detector.stats.frames == 24


def test_a_replayed_shard_doubles_nothing() -> None:
    events = synth(slow={7: 1.3}, start=10, plan=True)
    merge, out = run_sharded(events, 3, replay=1)
    assert len(opened(out)) == 1
    assert merge.duplicates == 24  # shard 0 holds one replica: each of its 24 summaries came twice
    assert merge.detector.stats.frames == 24


def test_the_merge_scores_every_rank_and_link_as_the_single_detector() -> None:
    events = synth(iterations=6, plan=True, slow={7: 1.3}, start=3)
    single, single_out = run(events)
    merge, merged_out = run_sharded(events, 3)
    stages = [[p.stages for p in out if isinstance(p, IterationPrediction)][-1] for out in (single_out, merged_out)]
    assert len(stages[0]) == 9 and stages[0] == stages[1]  # every (replica, stage) of tp2·pp3·dp3
    a, b = single.last_score, merge.detector.last_score
    assert a is not None and b is not None
    assert single.last_frame is not None and merge.detector.last_frame is not None
    assert np.array_equal(single.last_frame.rank, merge.detector.last_frame.rank)
    assert np.allclose(a.z, b.z, equal_nan=True, atol=1e-9)
    assert np.allclose(a.z_by_kind, b.z_by_kind, equal_nan=True, atol=1e-6)  # sent as float32
    assert np.array_equal(a.link_src, b.link_src) and np.allclose(a.link_z, b.link_z, equal_nan=True, atol=1e-9)


def test_without_sequence_lengths_the_merge_scores_close_to_the_single_detector() -> None:
    """Inferred predictions level classes over the shard's replicas, not the job's: close, not equal."""
    events = synth(iterations=6, plan=True, seq_lens=False, slow={4: 1.5}, start=3)
    single, _ = run(events)
    merge, _ = run_sharded(events, 3)
    a, b = single.last_score, merge.detector.last_score
    assert a is not None and b is not None
    assert float(np.nanmax(np.abs(a.z - b.z))) < 0.03
    assert int(np.nanargmax(a.z)) == int(np.nanargmax(b.z)) == 4


def _fail_stops(out) -> list[tuple]:
    return [(p.iteration, p.locations[0].target, p.locations[0].rank, p.category) for p in out
            if isinstance(p, IncidentOpened) and p.category == "fail_stop"]


def test_a_dead_rank_raises_the_single_detectors_fail_stop_through_shards() -> None:
    events = synth(dead=(7, 12), plan=True, iterations=20)
    single_det, single = run(events)
    expected = _fail_stops(single)
    assert [r for _, _, r, _ in expected] == [7]
    for n in (1, 3):
        merge, out = run_sharded(events, n)
        got = _fail_stops(out)
        assert [x[1:] for x in got] == [x[1:] for x in expected], n
        assert abs(got[0][0] - expected[0][0]) <= 1, n
        assert merge.detector.stats.frames == single_det.stats.frames, n  # the death's iteration judged too


def _liveness_rows(ranks: int, iterations: int, dies: tuple[int, int], reshape_at: int) -> np.ndarray:
    """Rows (kind, rank, epoch, iteration, time_s, interval_s) of a job whose streams interleave
    unevenly: each rank reports and heartbeats once per iteration at a jittered time, rank
    ``dies[0]`` goes silent from iteration ``dies[1]`` (the others then only heartbeat, stalled), and
    the job moves to epoch 1 at ``reshape_at``."""
    rng = np.random.default_rng(3)
    rows = []
    for it in range(iterations):
        epoch = int(it >= reshape_at)
        for r in range(ranks):
            if r == dies[0] and it >= dies[1]:
                continue
            t = 10.0 + it + rng.uniform(0, 0.4)
            if it < dies[1]:
                rows.append((0, r, epoch, it, t, 0.0))
            rows.append((1, r, epoch, min(it, dies[1]) + 1, t + 0.05, 1.0))
    out = np.array(rows)
    return out[np.argsort(out[:, 4], kind="stable")]


def test_a_liveness_batch_leaves_the_watch_as_its_events_one_by_one_do() -> None:
    """The merge's array path (FailStopWatch.ingest) against the single process's event path:
    the same streams, the same dead rank at the same iteration; only when within a batch it is named
    differs (at the batch's end)."""
    from analytics.detection.config import DetectorConfig
    from analytics.detection.fail_stop import FailStopWatch

    rows = _liveness_rows(ranks=48, iterations=30, dies=(17, 20), reshape_at=8)
    one, batched = FailStopWatch(DetectorConfig()), FailStopWatch(DetectorConfig())
    for w in (one, batched):
        w.plan_announced(0, set(range(48)))
    by_one, by_batch = [], []
    for k, r, e, i, t, dt in rows.tolist():
        if k:
            by_one += one.heartbeat(Heartbeat(rank=int(r), epoch=int(e), iteration=int(i), interval_s=dt), t)
        else:
            by_one += one.telemetry(int(r), int(e), int(i), t)
    fast = 0
    for b in range(0, len(rows), 40):
        part = rows[b:b + 40]
        got = batched.ingest(part[:, 0].astype(int), part[:, 1].astype(int), part[:, 2].astype(int),
                             part[:, 3].astype(int), part[:, 4], part[:, 5])
        assert got is not None  # nothing here needs the one-by-one rules
        by_batch += got
        fast += 1
    assert [(c.rank, c.alive, c.iteration) for c in by_batch] == [(c.rank, c.alive, c.iteration) for c in by_one]
    assert [c.rank for c in by_one] == [17] and one.dead == batched.dead == {17}
    for col in ("time_s", "hb_time_s", "hb_interval_s", "epoch", "reported", "started", "watched"):
        a, b_ = getattr(one.table, col), getattr(batched.table, col)
        assert np.array_equal(a[np.argsort(one.table.rank)], b_[np.argsort(batched.table.rank)], equal_nan=True), col
    assert (one.top_iteration(1), one.reference_s(), one.interval_s()) == (
        batched.top_iteration(1), batched.reference_s(), batched.interval_s())


def test_a_batch_the_array_path_cannot_settle_goes_event_by_event() -> None:
    """A clock far ahead of the job (and a dead rank's heartbeat) leave the watch untouched on the
    array path; the detector then applies the rows one by one, as the single process does."""
    from analytics.detection.detector import Detector

    rows = _liveness_rows(ranks=8, iterations=6, dies=(99, 99), reshape_at=99)
    det, ref = Detector("j"), Detector("j")
    cols = lambda a: (a[:, 0].astype(int), a[:, 1].astype(int), a[:, 2].astype(int), a[:, 3].astype(int),  # noqa: E731
                      a[:, 4], a[:, 5])
    det.on_liveness(*cols(rows))
    jump = rows[-3:].copy()
    jump[0, 4] += 1e4  # one rank's clock jumps ahead: not believed, counted
    assert det.fail_stop.ingest(*cols(jump)) is None
    det.on_liveness(*cols(jump))
    for k, r, e, i, t, dt in np.concatenate([rows, jump]).tolist():
        if k:
            ref.on_heartbeat(Heartbeat(rank=int(r), epoch=int(e), iteration=int(i), interval_s=dt), t)
        else:
            ref.report_seen(int(r), int(e), int(i), t)
    assert det.fail_stop.untrusted_times == ref.fail_stop.untrusted_times == 1
    assert det.fail_stop.reference_s() == ref.fail_stop.reference_s()


def test_a_liveness_batch_whose_arrays_do_not_match_its_layout_is_counted_not_applied() -> None:
    from analytics.sharding.replica_summary import pack
    from collector.events import LivenessBatch

    merge = JobMerge("j")
    f = EventFactory("j", "shard")
    short = dict(zip(("kind", "rank", "epoch", "iteration", "time_s"), np.ones((5, 3))))
    short["interval_s"] = np.ones(2)  # one array shorter than the rest
    layout, blob = pack(short)
    assert merge.on_event(f.make(LivenessBatch(rows=3, layout=layout, blob=blob))) == []
    with pytest.raises(ValidationError, match="layout names 12"):  # fewer bytes than named: never built
        LivenessBatch(rows=3, layout=[("kind", "<i4", 3)], blob=b"AAAA")
    assert merge.settle() == [] and merge.malformed == 1
    assert merge.detector.fail_stop.table.n == 0  # nothing of them reached the watch


def test_an_untraced_rank_that_stops_raises_the_hidden_stop_through_shards() -> None:
    """Megatron-style tracing (one rank per TP group reports; the declaration travels on the
    telemetry topic, so shards forward it to the merge): an untraced rank stops, the job hangs, and
    the merge's hidden-stop watch names the same group as the single process."""
    from analytics.detection.detector import Detector
    from trainer.fault_spec import FaultSpec
    from trainer.sim.engine import SimEngine
    from trainer.sim.scenario import load_scenario
    from pathlib import Path

    sc = load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "fail_stop_gpu.yaml")
    engine = SimEngine(sc.model_copy(update={"iterations": 20, "dialect": "megatron", "faults": []}).sim_config(),
                       [FaultSpec(kind="stop_device", device=13, at_iteration=12)])
    events = []
    while engine.iteration < 20 and not engine.finished:
        events += engine.step()
    single_det = Detector(engine.config.job)
    single = [p for e in events for p in single_det.on_event(e)]
    _, sharded = run_sharded(events, 3, job=engine.config.job)
    expected = [(p.iteration, p.locations[0].tp_group) for p in single
                if isinstance(p, IncidentOpened) and p.category == "fail_stop"]
    assert len(expected) == 1 and 13 in (expected[0][1] or ())
    got = [(p.iteration, p.locations[0].tp_group) for p in sharded
           if isinstance(p, IncidentOpened) and p.category == "fail_stop"]
    assert got == expected


def test_a_shard_waits_for_the_fits_of_the_jobs_previous_iteration() -> None:
    events = synth(iterations=3, plan=True)
    shard = ReplicaShard("j")
    got = [s for e in events for s in shard.on_event(e)]
    assert {s.iteration for s in got} == {0}  # iteration 0 predicts with no fits; 1 waits for the merge's
    fits = DetectorFits(epoch=0, iteration=0, classes=[], planned_epochs=[0])
    later = shard.on_event(EventFactory("j", "analytics-merge").make(fits))
    assert {(s.iteration, s.fits_from) for s in later} == {(1, (0, 0))}


def test_a_shard_waits_for_every_rank_of_a_replica() -> None:
    events = [e for e in synth(iterations=3, plan=True) if not isinstance(e.payload, Heartbeat)]
    shard = ReplicaShard("j")
    held_back = [e for e in events if isinstance(e.payload, RankIteration) and e.payload.rank == 0
                 and e.payload.iteration == 1]
    emitted = [p for e in events if e not in held_back for p in shard.on_event(e)]
    assert (0, 1, 0) not in {(f.epoch, f.iteration, f.replica) for f in emitted}  # rank 0 of replica 0 missing
    fits = DetectorFits(epoch=0, iteration=0, classes=[], planned_epochs=[0])
    released = shard.on_event(EventFactory("j", "analytics-merge").make(fits))
    assert {(f.iteration, f.replica) for f in released} == {(1, 1), (1, 2)}  # replica 0 still lacks rank 0
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


def test_a_jobs_replicas_spread_evenly_over_the_partitions_and_each_stays_in_one() -> None:
    for job in ("j", "bench", "a/b", "train-0042"):
        for dp, partitions in ((32, 8), (6, 8), (781, 8), (10, 3)):
            where = [replica_partition(f"{job}/replica-{d}".encode(), partitions) for d in range(dp)]
            per = np.bincount(np.array(where), minlength=partitions)
            assert per.max() - per.min() <= 1, (job, dp, per)  # the key's hash gave 8 and 2 of 32
            assert where == [replica_partition(f"{job}/replica-{d}".encode(), partitions) for d in range(dp)]
    assert replica_partition(b"j/rank-3", 8) is None  # other keys: Kafka's default hash
    assert replica_partition(b"j/replica-x", 8) is None
    assert replica_partition(None, 8) is None


def _assert_the_slow_rank_raised_and_every_summary_out(bus) -> None:
    """What the analytics topic holds after shards and merge ran ``synth(slow={7: 1.3}, ...)``."""
    from collector import topics
    from collector.stream import EventStream

    with EventStream(bus, "reader", [topics.ANALYTICS]) as reader:
        got = [d.event.payload for d in reader.poll(100_000, 0.5)]
    (inc,) = [p for p in got if isinstance(p, IncidentOpened)]
    assert (inc.locations[0].target, inc.locations[0].rank) == ("compute", 7)
    assert sum(isinstance(p, ReplicaSummary) for p in got) == 3 * 24


def test_shard_and_merge_workers_on_the_embedded_bus_publish_the_incident(tmp_path) -> None:
    from analytics.sharding.merge import MergeWorker
    from analytics.sharding.shards import ShardWorker
    from collector.bus import open_bus

    with open_bus("embedded", path=str(tmp_path / "bus.sqlite")) as bus:
        bus.publish(synth(slow={7: 1.3}, start=10, plan=True))
        shard, merge = ShardWorker(bus, "j", "shards", name="s0"), MergeWorker(bus, "merge")
        while shard.step(timeout_s=0.05) or merge.step(timeout_s=0.05):
            pass
        shard.close()
        merge.close()
        _assert_the_slow_rank_raised_and_every_summary_out(bus)


def _summary(replica: int, units: int, class_keys: list, u_class: list[int]):
    """A ReplicaSummary of one 2-rank replica with ``units`` unit rows, arrays filled with markers."""
    from analytics.sharding.replica_summary import LINK_ARRAYS, RANK_ARRAYS, SCORE_ARRAYS, UNIT_ARRAYS, pack
    from collector.events import ReplicaSummary

    arrays = {n: np.full(2, replica, float) for n in (*RANK_ARRAYS, *SCORE_ARRAYS)}
    arrays["rank"] = np.array([2 * replica, 2 * replica + 1])
    arrays.update({n: np.zeros(0) for n in LINK_ARRAYS})
    arrays.update({n: np.arange(units, dtype=float) + 100 * replica for n in UNIT_ARRAYS})
    arrays["u_class"] = np.array(u_class)
    arrays.update(s_stage=np.zeros(1), s_observed=np.ones(1), s_predicted=np.ones(1))
    layout, blob = pack(arrays)
    return ReplicaSummary(epoch=0, iteration=1, replica=replica, ranks=2, inferred=False, explained_s=1.0,
                          pipeline_s=1.0, dp_wait_s=0.0, tokens=1, wall_s=1.0, class_keys=json.dumps(class_keys),
                          layout=layout, blob=blob)


def test_joining_summaries_gives_the_per_replica_arrays_in_replica_order_whether_or_not_layouts_agree() -> None:
    """``unpack_all`` joins same-layout summaries as one block: it must give what reading each
    summary and concatenating gives, and the class indices must map through each replica's own list."""
    from analytics.sharding.replica_summary import replica_job_view, unpack, unpack_all

    same = [_summary(r, 3, [["F", 0], ["B", 0]], [0, 1, 1]) for r in range(3)]
    mixed = [_summary(0, 3, [["F", 0], ["B", 0]], [0, 1, 1]), _summary(1, 2, [["B", 0], ["F", 0]], [0, 1])]
    for parts in (same, mixed):
        names = [n for n, _, _ in parts[0].layout]
        joined = unpack_all(parts, names)
        for n in names:
            want = np.concatenate([unpack(p.layout, p.blob)[n] for p in parts])
            assert joined[n].dtype == want.dtype and joined[n].tolist() == want.tolist(), n
    view = replica_job_view(0, 1, mixed, None)
    assert view.u_keys == [("F", 0), ("B", 0)]
    assert view.u_class.tolist() == [0, 1, 1, 1, 0]  # replica 1 listed B first
    assert view.u_tokens.tolist() == [0, 1, 2, 100, 101]
    assert replica_job_view(0, 1, same, None).u_class.tolist() == [0, 1, 1] * 3


def test_a_summarys_unit_rows_are_every_row_of_a_small_class_and_evenly_spread_ones_of_a_larger_one() -> None:
    """What a replica sends the merge's fit, per class: its live rows when it has at most
    ``per_class``, otherwise the ones ``np.linspace`` spreads evenly over them, in row order."""
    from analytics.sharding.replica_summary import _thin

    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(0, 200))
        classes, live = rng.integers(0, int(rng.integers(1, 30)), n), rng.random(n) < 0.8
        per_class = int(rng.integers(1, 8))
        expected: list[int] = []
        for c in sorted(set(classes[live].tolist())):
            rows = np.flatnonzero(live & (classes == c))
            expected += (rows if len(rows) <= per_class
                         else rows[np.linspace(0, len(rows) - 1, per_class).astype(np.int64)]).tolist()
        assert _thin(classes, live, per_class).tolist() == sorted(expected)
        assert _thin(classes, live, None).tolist() == np.flatnonzero(live).tolist()


def test_a_summary_whose_arrays_the_merge_cannot_join_is_counted_and_left_out() -> None:
    """A summary of another build decodes (its blob matches its own layout) but lacks an array the
    merge joins, or has rank or link rows of different lengths: the merge must log and count it as
    it does a malformed liveness batch, never raise on it when the iteration is judged."""
    from analytics.sharding.replica_summary import pack, summary_shape_problem, unpack

    good = _summary(0, 3, [["F", 0]], [0, 0, 0])
    assert summary_shape_problem(good) is None

    def altered(change) -> ReplicaSummary:
        arrays = dict(unpack(good.layout, good.blob))
        change(arrays)
        layout, blob = pack(arrays)
        return good.model_copy(update={"layout": layout, "blob": blob})

    no_x_f = altered(lambda a: a.pop("x_f"))
    short_link = altered(lambda a: a.update(l_src=np.zeros(1)))
    more_ranks = altered(lambda a: a.update({n: np.zeros(3) for n in ("rank", "tp", "pp", "dp", "cp", "node", "x",
                                                                     "x_f", "x_b", "x_w", "own_s", "pred_s")}))
    assert "['x_f'] missing" in (summary_shape_problem(no_x_f) or "")
    assert "different lengths [0, 1]" in (summary_shape_problem(short_link) or "")
    assert "3 rank rows but ranks=2" in (summary_shape_problem(more_ranks) or "")

    merge = JobMerge("j")
    f = EventFactory("j", "shard")
    for bad in (no_x_f, short_link, more_ranks):
        assert merge.on_event(f.make(bad)) == []
    assert merge.malformed == 3 and merge.flush() == []
    merge.on_event(f.make(good))
    assert merge.malformed == 3  # a usable summary is taken


def test_a_shard_catching_up_on_a_backlog_reads_only_a_few_iterations_past_the_merges_fits(tmp_path) -> None:
    from analytics.sharding.merge import MergeWorker
    from analytics.sharding.shards import READ_AHEAD, ShardWorker
    from collector.bus import open_bus

    with open_bus("embedded", path=str(tmp_path / "bus.sqlite")) as bus:
        bus.publish(synth(slow={7: 1.3}, start=10, plan=True))  # 24 iterations, 36 records each
        shard = ShardWorker(bus, "j", "shards", name="s0")
        while shard.step(max_records=40, timeout_s=0.05):  # no merge yet: no fits after iteration 0
            pass
        held = {k[1] for k in shard.shard._pending}
        assert max(held) <= 1 + READ_AHEAD + 1, held  # iteration 1 waits; not the whole backlog
        merge = MergeWorker(bus, "merge")
        while shard.step(max_records=40, timeout_s=0.05) or merge.step(timeout_s=0.05):
            pass
        shard.close()
        merge.close()
        _assert_the_slow_rank_raised_and_every_summary_out(bus)


def test_in_the_megatron_dialect_three_shards_judge_every_iteration_as_it_comes() -> None:
    """One traced rank per TP group: a shard that did not read the tracing declaration waited for
    its replicas' untraced ranks for ever (the declaration was keyed to one partition)."""
    from pathlib import Path

    from trainer.sim.engine import SimEngine
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "fail_slow_compute_x2.yaml")
    engine = SimEngine(sc.model_copy(update={"iterations": 24, "dialect": "megatron", "faults": []}).sim_config(), [])
    events = []
    while engine.iteration < 24 and not engine.finished:
        events += [e for e in engine.step() if not e.kind.startswith("truth")]
    keys = PartitionKeys()
    declared = [e for e in events if isinstance(e.payload, TracingDeclared)]
    assert declared and all(to_every_partition(keys.key(e.job, e.source, e.kind, e.payload)) for e in declared)
    live, _ = run_sharded(events, 3, job=engine.config.job, flush=False)
    assert live.detector.stats.frames >= 23


def test_in_the_sampled_dialect_shards_raise_the_single_detectors_incident_as_the_iterations_come() -> None:
    """Every second replica and every second step traced (TracingDeclared), a ×2 GPU on an untraced
    replica. The merge must not wait for the untraced replicas' summaries (it held every iteration
    to the end of the log), the shards must predict with the fits of the previous traced step (they
    waited for fits of steps nobody traces), and the merge, which has no chunks, must still tell
    time lost outside the traced ranks from a slow link (it opened a link incident)."""
    from pathlib import Path

    from trainer.fault_spec import FaultSpec
    from trainer.sim.engine import SimEngine
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "fail_slow_compute_x2.yaml")
    fault = FaultSpec(kind="slow_compute", device=30, factor=2.0, at_iteration=26, duration_iterations=26)
    engine = SimEngine(sc.model_copy(update={"iterations": 64, "dialect": "sampled", "faults": []}).sim_config(), [fault])
    events = []
    while engine.iteration < 64 and not engine.finished:
        events += [e for e in engine.step() if not e.kind.startswith("truth")]
    job = engine.config.job
    det = Detector(job, DetectorConfig())
    single_out = [p for e in events for p in det.on_event(e)] + det.flush()
    expected = _incidents(single_out)
    assert [(t, r) for _, t, r, _ in expected] == [("compute", None)]  # opened on the untraced ranks, unplaced
    for n in (1, 3):
        merge, out = run_sharded(events, n, job=job)
        assert _incidents(out) == expected, n
        assert merge.detector.stats.frames == 32  # the 32 traced steps
        live, _ = run_sharded(events, n, job=job, flush=False)
        assert live.detector.stats.frames >= 31  # judged as they came, not held to the end of the log
