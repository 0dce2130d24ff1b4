"""`resihp import`: torch.profiler traces of a real two-process gloo pipeline job become our contract,
and bad input to import / detect / replay ends in one line naming the file (exit 2), never a traceback.

The job is real: two processes (torch.multiprocessing spawn), PP=2, a tensor sent forward and a
gradient sent back per micro-batch, profiled with ``profile(schedule=...)`` and ``record_function``
names as torch.distributed.pipelining's runtime schedules make them (``PP:{stage}F{mb}``). Its cost is
each process importing torch and the profiler's first step importing torch._inductor (~15 s of CPU
per process); the job runs once per module and both tests read its traces.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from collector.events import ChunkKind, CommOp, FaultCategory, PlanCurrent, RankIteration, TracingDeclared
from collector.profiler_import import ImportProblem, Layout, RankLayout, import_traces, read_kineto
from collector.trace import TraceWriter, read_trace
from resihp.cli import main

MICROBATCHES = 2
ACTIVE_STEPS = 4
WAIT_STEPS = 1
WARMUP_STEPS = 1
LAYOUT = {"job": "pp2-gloo", "schedule": "1f1b", "microbatches": MICROBATCHES, "num_layers": 2,
          "ranks": [{"rank": 0, "pp": 0, "node": 0}, {"rank": 1, "pp": 1, "node": 0}]}


def _pipeline_worker(rank: int, port: int, out: str) -> None:
    """One stage of a PP=2 job: forward sends activations 0 -> 1, backward sends gradients 1 -> 0."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    layer = torch.nn.Linear(32, 32)
    sched = schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=ACTIVE_STEPS)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched) as prof:
        for _ in range(WAIT_STEPS + WARMUP_STEPS + ACTIVE_STEPS):
            saved = []
            for mb in range(MICROBATCHES):
                with record_function(f"PP:{rank}F{mb}"):
                    if rank == 0:
                        x = torch.randn(16, 32)
                    else:
                        x = torch.empty(16, 32)
                        dist.recv(x, src=0)
                        x.requires_grad_()
                    y = torch.tanh(layer(x))
                    if rank == 0:
                        dist.send(y.detach(), dst=1)
                    saved.append((x, y))
            for mb in range(MICROBATCHES):
                with record_function(f"PP:{rank}B{mb}"):
                    x, y = saved[mb]
                    if rank == 1:
                        y.sum().backward()
                        assert x.grad is not None
                        dist.send(x.grad, dst=0)
                    else:
                        grad = torch.empty(16, 32)
                        dist.recv(grad, src=1)
                        y.backward(grad)
            for p in layer.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
            prof.step()
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def profiled_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-rank Chrome traces of the real job, and its layout, in one folder."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("profiled")
    traces = folder / "traces"
    traces.mkdir()
    mp.spawn(_pipeline_worker, args=(_free_port(), str(traces)), nprocs=2, join=True)
    (folder / "layout.yaml").write_text(json.dumps(LAYOUT))
    return folder


def _import(folder: Path, out: Path, *extra: str) -> int:
    return main(["import", str(folder / "traces"), "--layout", str(folder / "layout.yaml"), "--out", str(out), *extra])


# ---- the real job ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_profiled_pipeline_job_imports_as_one_report_per_rank_per_step(profiled_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported.parquet"
    assert _import(profiled_job, out) == 0
    events = read_trace(out)
    assert [e.kind for e in events[:2]] == ["plan.current", "telemetry.tracing"]
    current = events[0].payload
    assert isinstance(current, PlanCurrent)
    plan = current.plan
    assert plan.shape() == "TP1·PP2·DP1" and plan.global_microbatches == MICROBATCHES
    assert [plan.role_of(r).stage for r in (0, 1)] == [0, 1]
    declared = events[1].payload
    assert isinstance(declared, TracingDeclared)
    assert declared.dialect == "profiler" and declared.traced_ranks is None
    assert (declared.seq_lens, declared.tokens) == (False, False)

    reports = [e.payload for e in events if isinstance(e.payload, RankIteration)]
    steps = sorted({r.iteration for r in reports})
    assert steps == list(range(WAIT_STEPS + WARMUP_STEPS, WAIT_STEPS + WARMUP_STEPS + ACTIVE_STEPS))
    assert sorted((r.iteration, r.rank) for r in reports) == [(s, r) for s in steps for r in (0, 1)]
    for r in reports:
        assert (r.coords.pp, r.coords.tp, r.coords.dp, r.coords.cp, r.node) == (r.rank, 0, 0, 0, 0)
        assert sorted((c.kind, c.microbatch) for c in r.chunks) == sorted(
            (k, mb) for k in (ChunkKind.FORWARD, ChunkKind.BACKWARD) for mb in range(MICROBATCHES))
        for c in r.chunks:
            assert c.tokens is None and c.seq_lens is None
            assert 0 < c.duration_s < r.wall_s
            assert c.start_s + c.duration_s <= r.wall_s + 1e-6
        p2p = [w for w in r.waits().rows() if w.op in (CommOp.PP_SEND, CommOp.PP_RECV)]
        # stage 0 sends each forward and receives each gradient; stage 1 the mirror image
        assert sorted((w.op, w.microbatch) for w in p2p) == sorted(
            (op, mb) for op in (CommOp.PP_SEND, CommOp.PP_RECV) for mb in range(MICROBATCHES))
        assert {w.peer for w in p2p} == {1 - r.rank}
        assert all(w.includes_wait and w.group == "pp" and w.duration_s > 0 for w in p2p)
        assert [w.op for w in r.waits().rows() if w.op not in (CommOp.PP_SEND, CommOp.PP_RECV)] == [CommOp.DP_ALLREDUCE] * 2
        # the chunk is its span less the blocking recv inside it: compute and waits add up to no more
        # than the step, all on this rank's clock
        assert sum(c.duration_s for c in r.chunks) + sum(w.duration_s for w in r.waits().rows()) <= r.wall_s + 1e-6


@pytest.mark.slow
def test_the_detector_runs_over_an_imported_job_and_calls_no_rank_dead(profiled_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported.parquet"
    assert _import(profiled_job, out) == 0
    incidents = tmp_path / "incidents.jsonl"
    assert main(["detect", str(out), "--out", str(incidents), "--all"]) == 0
    lines = [json.loads(x) for x in incidents.read_text().splitlines()]
    predictions = [x for x in lines if x["kind"] == "analytics.prediction"]
    assert predictions, "the detector judged no iteration of the imported job"
    opened = [x["payload"] for x in lines if x["kind"] == "incident.opened"]
    assert not [o for o in opened if o["category"] == FaultCategory.FAIL_STOP.value], opened


# ---- the conversion rules, on hand-made traces ---------------------------------------------------


def _kineto(rank: int, events: list[dict]) -> dict:
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events,
            "somethingNewInAFutureTorch": {"kept": "ignored"}}


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def test_a_step_without_micro_batch_spans_becomes_one_forward_and_one_backward(tmp_path: Path) -> None:
    events = [_x("ProfilerStep#7", 1000, 100),
              _x("aten::linear", 1005, 30, cat="cpu_op"),
              _x("autograd::engine::evaluate_function: AddmmBackward0", 1050, 20, cat="cpu_op"),
              _x("autograd::engine::evaluate_function: TBackward0", 1075, 10, cat="cpu_op"),
              _x("c10d::allreduce_", 1090, 8, cat="cpu_op"),
              _x("gloo:all_reduce", 1093, 5, tid=2)]  # the backend's own thread: not this step's time
    (tmp_path / "a.json").write_text(json.dumps(_kineto(0, events)))
    layout = Layout(microbatches=1, num_layers=1, ranks=[RankLayout(rank=0, pp=0)])
    result = import_traces([tmp_path / "a.json"], layout, job="j")
    (report,) = [e.payload for e in result.events if isinstance(e.payload, RankIteration)]
    assert report.iteration == 7 and report.wall_s == pytest.approx(100e-6)
    assert [(c.kind, round(c.start_s * 1e6), round(c.duration_s * 1e6)) for c in report.chunks] == [
        (ChunkKind.FORWARD, 0, 50), (ChunkKind.BACKWARD, 50, 35)]
    assert [(w.op, round(w.duration_s * 1e6)) for w in report.waits().rows()] == [(CommOp.DP_ALLREDUCE, 8)]


def test_gpipe_spans_give_chunks_and_a_recv_inside_a_forward_is_waiting_not_compute(tmp_path: Path) -> None:
    events = [_x("ProfilerStep#3", 0, 1000),
              _x("Forward 0", 10, 400), _x("c10d::recv_", 20, 300, cat="cpu_op"), _x("gloo:recv", 30, 295),
              _x("Backward 0", 500, 200), _x("c10d::send", 650, 40, cat="cpu_op")]
    (tmp_path / "rank1.json").write_text(json.dumps(_kineto(1, events)))
    layout = Layout(microbatches=1, num_layers=2, ranks=[RankLayout(rank=0, pp=0), RankLayout(rank=1, pp=1)])
    result = import_traces([tmp_path / "rank1.json"], layout, job="j")
    declared = result.events[1].payload
    assert isinstance(declared, TracingDeclared)
    assert declared.traced_ranks == [1]  # rank 0 has no trace: not traced, not dead
    (report,) = [e.payload for e in result.events if isinstance(e.payload, RankIteration)]
    assert [(c.kind, round(c.duration_s * 1e6)) for c in report.chunks] == [
        (ChunkKind.FORWARD, 400 - 305), (ChunkKind.BACKWARD, 200 - 40)]
    assert [(w.op, w.peer, w.microbatch, round(w.duration_s * 1e6)) for w in report.waits().rows()] == [
        (CommOp.PP_RECV, 0, 0, 305), (CommOp.PP_SEND, 0, 0, 40)]


# ---- bad input: one line naming the file, exit code 2, nothing already written lost -------------


def _one_line_error(capsys: pytest.CaptureFixture[str], command: str, names: Path, problem: str) -> None:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"resihp {command}: error: ") and str(names) in err and problem in err, err


@pytest.fixture()
def layout_file(tmp_path: Path) -> Path:
    p = tmp_path / "layout.yaml"
    p.write_text(json.dumps(LAYOUT))
    return p


def test_import_of_a_non_trace_file_fails_in_one_line_and_keeps_the_old_output(
        tmp_path: Path, layout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.parquet"
    out.write_bytes(b"an earlier import")
    bad = tmp_path / "rank0.json"
    bad.write_text("this is a log file, not a trace\n")
    assert main(["import", str(bad), "--layout", str(layout_file), "--out", str(out)]) == 2
    _one_line_error(capsys, "import", bad, "not JSON")
    assert out.read_bytes() == b"an earlier import"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_import_of_a_truncated_trace_fails_in_one_line_and_keeps_the_old_output(
        tmp_path: Path, layout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.parquet"
    out.write_bytes(b"an earlier import")
    whole = json.dumps(_kineto(0, [_x("ProfilerStep#1", 0, 10), _x("PP:0F0", 1, 5)]))
    cut = tmp_path / "rank0.json"
    cut.write_text(whole[: len(whole) // 2])
    assert main(["import", str(cut), "--layout", str(layout_file), "--out", str(out)]) == 2
    _one_line_error(capsys, "import", cut, "truncated")
    assert out.read_bytes() == b"an earlier import"


def test_import_of_a_gzip_trace_that_inflates_past_the_limit_fails_in_one_line_and_the_flag_raises_it(
        tmp_path: Path, layout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A gzip bomb: 3 MiB of JSON (a trace padded with whitespace) in a few kilobytes. With the limit
    at 1 MiB it is refused, naming the file, the limit and the flag, before it is all in memory;
    --max-trace-mib 4 reads it."""
    import gzip

    doc = json.dumps(_kineto(0, [_x("ProfilerStep#1", 0, 10), _x("PP:0F0", 1, 5)]))
    bomb = tmp_path / "rank0.pt.trace.json.gz"
    bomb.write_bytes(gzip.compress((doc + " " * (3 << 20)).encode()))
    assert bomb.stat().st_size < 64 << 10
    out = tmp_path / "job.parquet"
    assert main(["import", str(bomb), "--layout", str(layout_file), "--out", str(out), "--max-trace-mib", "1"]) == 2
    _one_line_error(capsys, "import", bomb, "decompresses to more than 1,048,576 bytes (--max-trace-mib 1)")
    assert not out.exists()
    assert main(["import", str(bomb), "--layout", str(layout_file), "--out", str(out), "--max-trace-mib", "4"]) == 0
    assert out.exists()


def test_import_with_an_unknown_layout_field_fails_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(_kineto(0, [_x("ProfilerStep#1", 0, 10)])))
    layout = tmp_path / "layout.yaml"
    layout.write_text(json.dumps({**LAYOUT, "pipeline_flavour": "spicy"}))
    assert main(["import", str(tmp_path / "rank0.json"), "--layout", str(layout), "--out",
                 str(tmp_path / "o.parquet")]) == 2
    _one_line_error(capsys, "import", layout, "pipeline_flavour")
    assert not (tmp_path / "o.parquet").exists()


def test_reading_a_trace_without_profiler_steps_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(_kineto(0, [_x("PP:0F0", 1, 5)])))
    with pytest.raises(ImportProblem, match=r"rank0\.json: no ProfilerStep#N spans.*prof\.step\(\)"):
        read_kineto(tmp_path / "rank0.json")


def _trace_with_an_unknown_field(path: Path) -> None:
    from collector.codec import encode
    from collector.events import EventFactory, Heartbeat

    good = EventFactory("j", "rank-0").make(Heartbeat(rank=0, epoch=0, iteration=1, interval_s=1.0))
    bad = EventFactory("j", "rank-0", first_seq=1).make(Heartbeat(rank=0, epoch=0, iteration=2, interval_s=1.0))
    raw = json.loads(encode(bad))
    raw["payload"]["mood"] = "sunny"
    with TraceWriter(path) as w:
        w.write([good])
        w.write_encoded(bad, json.dumps(raw).encode())


@pytest.mark.parametrize("command", ["detect", "replay"])
def test_detect_and_replay_refuse_bad_traces_in_one_line(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--speed", "0", "--bus-path", str(tmp_path / "bus.sqlite")] if command == "replay" else []
    text = tmp_path / "notes.txt"
    text.write_text("not a trace")
    assert main([command, str(text), *extra]) == 2
    _one_line_error(capsys, command, text, "not a ResiHP trace")

    whole = tmp_path / "whole.parquet"
    _trace_with_an_unknown_field(whole)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main([command, str(truncated), *extra]) == 2
    _one_line_error(capsys, command, truncated, "not a complete Parquet file")

    assert main([command, str(whole), *extra]) == 2
    _one_line_error(capsys, command, whole, "row 1: invalid event: telemetry.heartbeat.payload.mood: Extra inputs")
    assert not (tmp_path / "bus.sqlite").exists()  # replay checked the whole trace before publishing


def test_a_failed_detect_keeps_the_previous_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole = tmp_path / "whole.parquet"
    _trace_with_an_unknown_field(whole)
    out = tmp_path / "incidents.jsonl"
    out.write_text("yesterday's incidents\n")
    assert main(["detect", str(whole), "--out", str(out)]) == 2
    assert out.read_text() == "yesterday's incidents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incidents.jsonl", "whole.parquet"]


def test_a_ranks_profiling_cycles_in_several_gzipped_files_import_as_one_series(tmp_path: Path) -> None:
    import gzip

    for cycle, step in enumerate((4, 8)):  # tensorboard_trace_handler(use_gzip=True): a file per cycle
        doc = _kineto(0, [_x(f"ProfilerStep#{step}", 0, 100), _x("PP:0F0", 10, 40), _x("PP:0B0", 50, 40)])
        (tmp_path / f"host_{cycle}.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    layout = Layout(microbatches=1, num_layers=1, ranks=[RankLayout(rank=0, pp=0)])
    from collector.profiler_import import trace_files

    result = import_traces(trace_files([tmp_path]), layout, job="j")
    assert result.steps == [4, 8]
    declared = result.events[1].payload
    assert isinstance(declared, TracingDeclared)
    assert (declared.step_every, declared.step_offset, declared.traced_ranks) == (4, 0, None)
    with pytest.raises(ImportProblem, match="rank 0 step 4 again"):
        import_traces(trace_files([tmp_path, tmp_path / "host_0.pt.trace.json.gz"]), layout, job="j")


@pytest.mark.parametrize(("tp", "group_size", "inside"), [
    (2, None, CommOp.TP_ALLREDUCE),  # TP > 1: an all-reduce in a chunk is the layer's reduction
    (1, None, CommOp.DP_ALLREDUCE),  # TP 1: it can only be data-parallel (DDP reduces during backward)
    (2, 4, CommOp.DP_ALLREDUCE),     # the trace's group size decides when it records one
])
def test_an_all_reduce_is_tensor_parallel_only_when_the_layout_or_the_trace_says_so(
        tmp_path: Path, tp: int, group_size: int | None, inside: CommOp) -> None:
    reduce_in_chunk = _x("c10d::allreduce_", 20, 10, cat="cpu_op")
    if group_size is not None:
        reduce_in_chunk["args"]["Group size"] = group_size
    events = [_x("ProfilerStep#1", 0, 200), _x("PP:0B0", 10, 50), reduce_in_chunk,
              _x("c10d::allreduce_", 100, 10, cat="cpu_op")]
    (tmp_path / "rank0.json").write_text(json.dumps(_kineto(0, events)))
    ranks = [RankLayout(rank=r * tp + t, tp=t, dp=r, pp=0) for r in range(4) for t in range(tp)]
    layout = Layout(microbatches=1, num_layers=1, ranks=ranks)
    (report,) = [e.payload for e in import_traces([tmp_path / "rank0.json"], layout, job="j").events
                 if isinstance(e.payload, RankIteration)]
    assert [w.op for w in report.waits().rows()] == [inside, CommOp.DP_ALLREDUCE]
