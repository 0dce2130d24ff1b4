"""The integration API (trainer/integration.py) and its runnable example, on the embedded bus."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from collector import topics
from collector.bus import Bus, Consumer, OnAssign, RawMessage, TopicPartition
from collector.codec import decode
from collector.embedded import EmbeddedBus
from collector.events import (AckStatus, CommandAck, Coords, Heartbeat, IterationSummary, PlanCurrent,
                              ProbeRequest, ProbeResult, RankIteration, ReconfigureCommand)
from collector.plan import Plan
from tests.fixtures.payloads import payload_as
from tests.fixtures.signing import factory
from trainer.integration import (CommandListener, EpochFence, ResiHPReporter, best_seconds, coords_in, new_command,
                                 probe_answer, seq_lens_from_cu_seqlens)

REPO = Path(__file__).resolve().parents[1]


def _events(path: Path, topic: str) -> list:
    """Every decodable event of ``topic`` in the embedded log at ``path`` (read raw: no group state)."""
    with EmbeddedBus(path) as bus, bus.consumer("test-reader", [topic]) as consumer:
        out = []
        while records := consumer.poll(timeout_s=0):
            out += [decode(r.value) for r in records]
        return out


def _plan(epoch: int = 0, microbatches: int = 4) -> Plan:
    return Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=microbatches, epoch=epoch)


# ---- telemetry --------------------------------------------------------------------------------------


def test_published_telemetry_matches_what_the_loop_recorded(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    recorded: list[tuple[int, list, list]] = []
    with EmbeddedBus(path) as bus:
        reporter = ResiHPReporter("job-a", rank=5, coords=(1, 0, 1), bus=bus, node=0, heartbeat_s=0.05)
        for i in range(3):
            with reporter.iteration(i) as it:
                it.chunk("F", 0, seq_lens=[100, 28], start_s=0.0, duration_s=0.010)
                it.chunk("B", 0, tokens=128, seq_lens=[100, 28], duration_s=0.020)
                with it.time_chunk("F", 1, 64, [64]):
                    sum(range(1000))
                it.comm_wait("pp_recv", peer=3, microbatch=1, duration_s=0.002, start_s=0.011)
                with it.time_comm("dp_allreduce", nbytes=4096):
                    pass
                if i == 2:
                    it.summary(tokens=1024, loss=2.5)
            recorded.append((i, it.recorder.chunks, it.recorder.comm))
        reporter.close()
        assert reporter.dropped == 0
    events = _events(path, topics.TELEMETRY)
    iterations = [e for e in events if isinstance(e.payload, RankIteration)]
    assert [e.payload.iteration for e in iterations] == [0, 1, 2]
    for e, (_, chunks, comm) in zip(iterations, recorded):
        p = e.payload
        assert (e.job, e.source, p.rank, p.node, p.epoch) == ("job-a", "rank-5", 5, 0, 0)
        assert p.coords == Coords(tp=1, pp=0, dp=1)
        assert p.chunks == chunks and p.waits().rows() == comm
        assert [(c.kind.value, c.microbatch, c.tokens, c.seq_lens) for c in p.chunks] == [
            ("F", 0, 128, [100, 28]), ("B", 0, 128, [100, 28]), ("F", 1, 64, [64])]
        assert [(c.op.value, c.peer, c.bytes) for c in p.waits().rows()] == [("pp_recv", 3, None), ("dp_allreduce", None, 4096)]
        assert p.wall_s >= max(c.start_s + c.duration_s for c in p.chunks[2:])
    summaries = [e.payload for e in events if isinstance(e.payload, IterationSummary)]
    assert [(s.iteration, s.tokens, s.loss) for s in summaries] == [(2, 1024, 2.5)]
    assert summaries[0].wall_s == iterations[-1].payload.wall_s
    assert any(isinstance(e.payload, Heartbeat) and e.payload.rank == 5 for e in events)


def test_an_iteration_that_raises_is_not_reported(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    with EmbeddedBus(path) as bus:
        with ResiHPReporter("job-a", 0, (0, 0, 0), bus=bus) as reporter:
            with pytest.raises(RuntimeError, match="peer died"):
                with reporter.iteration(0) as it:
                    it.chunk("F", 0, tokens=8, duration_s=0.1)
                    raise RuntimeError("peer died")
            with reporter.iteration(0) as it:
                it.chunk("F", 0, tokens=8, duration_s=0.1)
    reports = [e.payload for e in _events(path, topics.TELEMETRY) if isinstance(e.payload, RankIteration)]
    assert len(reports) == 1


def test_follow_moves_the_rank_to_its_coordinates_in_the_new_plan(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    old = _plan()
    swapped = [{**p.model_dump(), "replica": 1 - p.replica} for p in reversed(old.pipelines)]
    new = Plan.model_validate({**old.model_dump(), "epoch": 1, "pipelines": swapped})
    with EmbeddedBus(path) as bus, ResiHPReporter("job-a", 5, coords_in(old, 5), bus=bus) as reporter:
        reporter.follow(new)
        with reporter.iteration(7) as it:
            it.chunk("F", 0, tokens=8, duration_s=0.1)
    p = next(e.payload for e in _events(path, topics.TELEMETRY) if isinstance(e.payload, RankIteration))
    assert (p.epoch, p.coords) == (1, Coords(tp=1, pp=0, dp=0))  # device 5 was replica 1, now replica 0


def test_chunk_refuses_lengths_that_do_not_fit_its_tokens(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus, ResiHPReporter("j", 0, (0, 0, 0), bus=bus) as reporter:
        with reporter.iteration(0) as it:
            with pytest.raises(ValueError, match="seq_lens sum to 300"):
                it.chunk("F", 0, tokens=256, seq_lens=[200, 100], duration_s=0.1)
            with pytest.raises(ValueError, match="needs tokens or seq_lens"):
                it.chunk("B", 0, duration_s=0.1)


def test_seq_lens_come_from_cu_seqlens_and_skip_padding_slots() -> None:
    assert seq_lens_from_cu_seqlens([0, 100, 128, 512, 512]) == [100, 28, 384]
    with pytest.raises(ValueError, match="must not decrease"):
        seq_lens_from_cu_seqlens([0, 10, 5])


class _HeldBus(Bus):
    """A bus whose publish blocks until released, and which notes the thread that published."""

    name = "held"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()  # the publisher thread is inside publish, held
        self.published: list[RawMessage] = []
        self.from_caller = False
        self.caller = threading.current_thread()

    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        if threading.current_thread() is self.caller:
            self.from_caller = True  # the training thread must never publish; do not block it
        else:
            self.entered.set()
            self.release.wait()
        self.published += messages

    def consumer(self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None,
                 instance_id: str | None = None) -> Consumer:
        raise NotImplementedError

    def end_offsets(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        return {}

    def close(self) -> None:
        pass


def test_a_blocked_bus_never_blocks_the_loop_and_overflow_drops_the_oldest() -> None:
    bus = _HeldBus()
    reporter = ResiHPReporter("job-a", 1, (0, 0, 0), bus=bus, max_queued=4, heartbeat_s=60)
    assert bus.entered.wait(60)  # its first heartbeat holds the publisher thread before the loop starts
    for i in range(30):  # the bus is held for the whole loop
        with reporter.iteration(i) as it:
            for m in range(8):
                it.chunk("F", m, tokens=16, seq_lens=[16], duration_s=0.001)
                it.chunk("B", m, tokens=16, seq_lens=[16], duration_s=0.002)
    assert not bus.release.is_set() and not bus.from_caller
    assert reporter.dropped == 30 - 4  # the queue holds the newest 4 of the 30 iteration reports
    bus.release.set()
    reporter.close()
    iterations = [payload_as(event, RankIteration).iteration for m in bus.published if m.topic == topics.TELEMETRY
                  and (event := decode(m.value)).kind == "telemetry.iteration"]
    assert iterations[-4:] == [26, 27, 28, 29]  # the newest survive


# ---- commands ---------------------------------------------------------------------------------------


RUN = "run-a"  # the run the command tests' listeners resume, and their commands name


def _publish_commands(path: Path, job: str, commands: list[ReconfigureCommand]) -> None:
    with EmbeddedBus(path) as bus:
        bus.publish([factory(job, "remediation").make(c) for c in commands])


def _acks(path: Path) -> dict[str, CommandAck]:
    """The first acknowledgement of each command id (a duplicate's comes later)."""
    out: dict[str, CommandAck] = {}
    for e in _events(path, topics.CONTROL):
        if isinstance(e.payload, CommandAck):
            out.setdefault(e.payload.command_id, e.payload)
    return out


def test_listener_hands_over_epoch_plus_one_and_acks_duplicates_and_stale_as_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    first = new_command(_plan(epoch=1, microbatches=3), "p1", run=RUN)
    duplicate = first.model_copy()
    late = new_command(_plan(epoch=1, microbatches=5), "p1-late", run=RUN)  # epoch 1 again, after 1 is running
    skipping = new_command(_plan(epoch=3), "p3", run=RUN)
    other_job = new_command(_plan(epoch=1), "other", run=RUN)
    with EmbeddedBus(path) as bus:
        listener = CommandListener("job-a", _plan(), bus=bus, run=RUN)
        listener.announce_plan(layer_state_bytes=1024, tokens_per_microbatch=128, model_name="toy")
        _publish_commands(path, "job-b", [other_job])
        _publish_commands(path, "job-a", [first, duplicate, late, skipping])
        got = listener.poll(timeout_s=1.0)
        assert got is not None and got.command_id == first.command_id
        assert listener.poll() is got  # still pending: handed over again, nothing else judged
        assert _acks(path) == {}  # nothing judged behind the pending command yet
        listener.ack_applied(got, pause_s=0.75, pause_iterations=1)
        assert listener.poll() is None
        assert listener.running.epoch == 1
        listener.close()
    acks = _acks(path)
    assert set(acks) == {first.command_id, late.command_id, skipping.command_id}  # the other job's: untouched
    assert (acks[first.command_id].status, acks[first.command_id].pause_s, acks[first.command_id].pause_iterations,
            acks[first.command_id].running_epoch) == (AckStatus.APPLIED, 0.75, 1, 1)
    assert acks[late.command_id].status is AckStatus.IGNORED_STALE
    assert acks[skipping.command_id].status is AckStatus.IGNORED_STALE
    assert "skips epochs" in acks[skipping.command_id].detail
    control = _events(path, topics.CONTROL)
    dup_acks = [e.payload for e in control if isinstance(e.payload, CommandAck) and e.payload.command_id ==
                first.command_id]
    assert [a.status for a in dup_acks] == [AckStatus.APPLIED, AckStatus.IGNORED_DUPLICATE]
    announced = [e.payload for e in control if isinstance(e.payload, PlanCurrent)]
    assert [(a.plan.epoch, a.reason, a.layer_state_bytes) for a in announced] == [(0, "start", 1024),
                                                                                  (1, "reshape", 1024)]
    assert all(e.source == "trainer" for e in control if e.kind in ("command.ack", "plan.current"))


def test_listener_fails_a_plan_its_check_refuses_and_keeps_the_running_epoch(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    wrong = new_command(Plan.uniform(tp=1, pp=1, dp=1, num_layers=8, microbatches_per_replica=4, epoch=1), run=RUN)
    right = new_command(_plan(epoch=1), run=RUN)

    def check(plan: Plan) -> str | None:
        return None if plan.num_layers == 4 else f"plan has {plan.num_layers} layers, the model 4"

    with EmbeddedBus(path) as bus, CommandListener("job-a", _plan(), bus=bus, check=check, run=RUN) as listener:
        _publish_commands(path, "job-a", [wrong, right])
        got = listener.poll(timeout_s=1.0)
        assert got is not None and got.command_id == right.command_id
        listener.ack_failed(got, "rendezvous timed out")
        with pytest.raises(ValueError, match="not the one awaiting"):
            listener.ack_applied(got, pause_s=1.0)
        assert listener.running.epoch == 0
    acks = _acks(path)
    assert (acks[wrong.command_id].status, acks[wrong.command_id].detail) == (
        AckStatus.FAILED, "plan has 8 layers, the model 4")
    assert (acks[right.command_id].status, acks[right.command_id].running_epoch) == (AckStatus.FAILED, 0)


def test_fence_marks_each_command_once() -> None:
    fence = EpochFence(running_epoch=2)
    cmd = new_command(_plan(epoch=3))
    assert fence.judge(cmd) == (None, "")
    assert fence.judge(cmd)[0] is AckStatus.IGNORED_DUPLICATE
    assert fence.judge(new_command(_plan(epoch=2)))[0] is AckStatus.IGNORED_STALE


# ---- probes -----------------------------------------------------------------------------------------


def test_probe_answer_is_against_the_median_and_only_for_asked_ranks() -> None:
    request = ProbeRequest(probe_id="p", ranks=[4, 5], target="compute")
    everyone = [1.0, 1.1, 0.9, 1.0, 1.05, 3.0, 1.0, 0.95]  # rank 5 is slow; the median ignores it
    slow, peer = probe_answer(request, 5, 3.0, everyone), probe_answer(request, 4, 1.05, everyone)
    assert slow is not None and peer is not None
    assert (slow.rank, slow.duration_s, slow.reference_s) == (5, 3.0, 1.0)
    assert peer.duration_s / peer.reference_s == pytest.approx(1.05)
    assert probe_answer(request, 0, 1.0, everyone) is None
    alone = probe_answer(ProbeRequest(probe_id="l", ranks=[0], target="link"), 0, 0.0, [0.0])
    assert alone is not None
    assert (alone.duration_s, alone.reference_s) == (0.0, 1.0)  # nothing to time: not slow
    with pytest.raises(ValueError, match="needs every rank's time"):
        probe_answer(request, 5, 3.0, [])


def test_best_seconds_keeps_the_fastest_repeat_and_syncs_around_each() -> None:
    calls: list[str] = []
    delays = iter([0.03, 0.002, 0.02])
    import time as _time

    def run() -> None:
        calls.append("run")
        _time.sleep(next(delays))

    seconds = best_seconds(run, 3, sync=lambda: calls.append("sync"))
    assert 0.002 <= seconds < 0.02
    assert calls == ["sync", "run", "sync"] * 3
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        best_seconds(lambda: None, 0)


def test_listener_hands_each_probe_of_its_job_over_once(tmp_path: Path) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    listener = CommandListener("job", _plan(), bus=bus)
    analytics = factory("job", "analytics")
    mine = ProbeRequest(probe_id="p1", ranks=[3], target="link")
    bus.publish([analytics.make(mine), analytics.make(mine),  # a re-published request runs once
                 factory("other", "analytics").make(ProbeRequest(probe_id="p2", ranks=[3]))])
    assert listener.poll() is None
    assert listener.take_probes() == [mine]
    assert listener.take_probes() == []
    listener.close()
    reporter = ResiHPReporter("job", 3, (0, 0, 0), bus=bus)
    with pytest.raises(ValueError, match="probe result for rank 4 given to rank 3's reporter"):
        reporter.answer_probe(ProbeResult(probe_id="p1", rank=4, duration_s=1.0, reference_s=1.0))
    reporter.close()
    bus.close()


PROBE_RANK = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist
    from collector.embedded import EmbeddedBus
    from collector.plan import Plan
    from trainer.integration import CommandListener, ResiHPReporter, best_seconds, coords_in, probe_answer

    rank, world, bus_path, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    plan = Plan.uniform(tp=1, pp=1, dp=world, num_layers=2, microbatches_per_replica=1)
    bus = EmbeddedBus(bus_path)
    reporter = ResiHPReporter("job", rank, coords_in(plan, rank), bus=bus)
    listener = CommandListener("job", plan, bus=bus, from_beginning=True) if rank == 0 else None
    if listener:
        listener.poll()
    shared = [listener.take_probes() if listener else None]
    dist.broadcast_object_list(shared, src=0)
    slow = 3.0 if rank == 2 else 1.0  # this rank's device is three times slower
    for request in shared[0]:
        seconds = best_seconds(lambda: time.sleep(0.02 * slow), request.repeats)
        everyone = [0.0] * world
        dist.all_gather_object(everyone, seconds)
        reporter.answer_probe(probe_answer(request, rank, seconds, everyone))
    reporter.close()
    if listener:
        listener.close()
    bus.close()
    dist.destroy_process_group()
    """
)


@pytest.mark.processes
def test_ranks_of_a_real_process_group_answer_a_probe_through_the_api(tmp_path: Path) -> None:
    """Four gloo ranks: rank 0's listener reads the request, every rank runs it, the asked ones
    (1 and 2, a TP pair) answer, and the slow one stands out against the world's median."""
    path, world = tmp_path / "bus.sqlite", 4
    with EmbeddedBus(path) as bus:
        bus.publish([factory("job", "analytics").make(
            ProbeRequest(probe_id="p", ranks=[1, 2], target="compute", repeats=3))])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE_RANK, str(r), str(world), str(path), str(tmp_path / "store")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    results = {e.payload.rank: e.payload for e in _events(path, topics.CONTROL) if isinstance(e.payload, ProbeResult)}
    assert sorted(results) == [1, 2]
    ratio = {r: p.duration_s / p.reference_s for r, p in results.items()}
    assert ratio[2] > 2.0 and ratio[1] < 1.5, ratio


# ---- the example ------------------------------------------------------------------------------------


def _run_example(tmp_path: Path, *args: str) -> Path:
    """Run examples/megatron_style_loop.py as job "example" on an embedded log; returns the log's path."""
    path = tmp_path / "bus.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "megatron_style_loop.py"), "--bus-path", str(path),
         "--job", "example", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.mark.processes
def test_megatron_style_example_runs_and_its_events_land(tmp_path: Path) -> None:
    path = _run_example(tmp_path, "--iterations", "2", "--command-at", "0")
    telemetry = _events(path, topics.TELEMETRY)
    reports = [e.payload for e in telemetry if isinstance(e.payload, RankIteration)]
    assert [r.iteration for r in reports] == [0, 1]
    assert all(e.job == "example" for e in telemetry)
    for r in reports:
        kinds = sorted({c.kind.value for c in r.chunks})
        assert kinds == ["B", "F"]
        assert all(c.seq_lens and sum(c.seq_lens) == c.tokens for c in r.chunks)
        assert [w.op.value for w in r.waits().rows()] == ["dp_allreduce"]
    # four micro-batches, until the command published after iteration 0 moves the job to three
    assert [len(r.chunks) // 2 for r in reports] == [4, 3]
    assert [r.epoch for r in reports] == [0, 1]
    assert [e.payload.tokens for e in telemetry if isinstance(e.payload, IterationSummary)] == [4 * 256, 3 * 256]
    control = _events(path, topics.CONTROL)
    acks = [e.payload for e in control if isinstance(e.payload, CommandAck)]
    assert [(a.status, a.epoch) for a in acks] == [(AckStatus.APPLIED, 1)]
    assert [(e.payload.reason, e.payload.plan.epoch) for e in control if isinstance(e.payload, PlanCurrent)] == [
        ("start", 0), ("reshape", 1)]


@pytest.mark.processes
def test_the_example_answers_the_probe_it_is_sent(tmp_path: Path) -> None:
    path = _run_example(tmp_path, "--iterations", "3", "--probe-at", "0")
    (result,) = [e.payload for e in _events(path, topics.CONTROL) if isinstance(e.payload, ProbeResult)]
    assert result.probe_id == "example-probe-0" and result.rank == 0
    assert result.duration_s > 0 and result.reference_s == result.duration_s  # one device: its own reference
