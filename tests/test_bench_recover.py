"""``resihp bench recover --jobs N``: runs in worker processes give the figures one process gives,
through the direct loop and through the bus loop (whose runs carry their detections back)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import recover


def _bench(capsys: pytest.CaptureFixture[str], jobs: int, loop: str, scenarios: str, strategies: str,
           duration_s: float) -> tuple[dict, str]:
    args = argparse.Namespace(gpus="256", scenarios=scenarios, strategies=strategies, duration_s=duration_s,
                              plot="", loop=loop, jobs=jobs, json=True)
    assert recover.run(args) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


@pytest.mark.processes
def test_parallel_runs_give_the_figures_of_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    one, _ = _bench(capsys, 1, "direct", "stop_gpu,slow_x4", "ours,dp_only", 300.0)
    two, _ = _bench(capsys, 2, "direct", "stop_gpu,slow_x4", "ours,dp_only", 300.0)
    assert one == two
    assert set(one["scenarios"]) == {"stop_gpu@256", "slow_x4@256"}
    assert all(0 < row["ours"] < 1 and row["oracle"] == 1.0 for row in one["scenarios"].values())


@pytest.mark.processes
def test_a_bus_loop_run_in_a_worker_brings_its_detections_back(capsys: pytest.CaptureFixture[str]) -> None:
    figures, out = _bench(capsys, 2, "bus", "stop_gpu", "ours", 60.0)
    assert 0 < figures["scenarios"]["stop_gpu@256"]["ours"] < 1
    (line,) = [row for row in out.splitlines() if row.startswith("stop_gpu@256 ours")]
    delay, false_incidents, applied, rolled_back, _bus_mb, lost, wall_s = line.split()[3:]
    assert int(delay) <= 20 and (int(false_incidents), int(lost)) == (0, 0)  # fail-stop at the second missed beat
    assert (int(applied), int(rolled_back)) == (1, 0)  # the plan that leaves the dead GPU out, kept
    assert int(wall_s) >= 1  # the loop's own wall time came back from the worker


def test_jobs_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--jobs must be at least 1, got 0"):
        _bench(capsys, 0, "direct", "stop_gpu", "ours", 60.0)


def test_a_run_lasts_its_scenarios_length_unless_told_otherwise() -> None:
    """every_30min needs 2 hours to show its three failures; --duration-s, when given, holds for it
    too (a shorter cut of its first failure is a 45-minute bus-loop run at 1,024 GPUs, not 2 hours)."""
    assert recover._call((256, "every_30min", "ours"), "direct", None)[1][3] == 7200.0
    assert recover._call((256, "slow_x2", "ours"), "direct", None)[1][3] == 1800.0
    fn, (name, strategy, gpus, duration) = recover._call((1024, "every_30min", "ours"), "bus", 3000.0)
    assert (fn, name, strategy, gpus, duration) == (recover._run_bused, "every_30min", "ours", 1024, 3000.0)
    assert recover._call((1024, "every_30min", "oracle"), "bus", 3000.0)[0] is recover._run_one  # oracle: direct


def test_a_throughput_series_gives_a_clock_jump_a_point_of_its_own() -> None:
    """A restart's downtime is one call that moves the clock by minutes; closed around it, it reads
    0 tokens/s over its whole span instead of averaging into the window around it."""
    from resihp.closed_loop import ThroughputSeries

    series = ThroughputSeries(window_s=60.0)
    series.add(600)
    series.tick(30.0)
    assert series.points == []  # half a window
    series.add(600)
    series.tick(60.0)
    series.add(300)
    series.close(75.0)  # the downtime starts
    series.close(1155.0)  # and ends 1,080 s later
    series.close(1155.0)  # an empty window adds nothing
    assert series.points == [(60.0, 20.0), (75.0, 20.0), (1155.0, 0.0)]


def test_an_elastic_restarts_downtime_reads_zero_over_its_span() -> None:
    run = recover._run_one("stop_gpu", "elastic_restart", 256, 600.0)
    spans = [(t1 - t0, v) for (t0, _), (t1, v) in zip(run.series, run.series[1:])]
    assert any(v == 0.0 and span >= 180.0 for span, v in spans), spans  # the 180-s restart at least
    assert all(v > 0 for _, v in run.series[:1])  # it trained before the GPU died
