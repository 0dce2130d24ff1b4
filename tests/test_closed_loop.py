"""The whole loop in one process (resihp.closed_loop): the simulator's faults are found by the
analytics detector from telemetry alone, and the engine's plans, applied by the simulator, win
back throughput that doing nothing loses."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.plan import Plan
from remediation.candidates import PlannerOptions
from resihp.closed_loop import location_devices, run_closed_loop
from resihp.planning_models import fitted_model, hardware_of
from trainer.sim.engine import SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from collector.events import Location
from tests.fixtures.signing import Authors

pytestmark = pytest.mark.slow  # tests/fixtures/tiers.py

MODEL = MODEL_PRESETS["tiny"]


def _config(strategy: str) -> SimConfig:
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=MODEL.layers, microbatches_per_replica=4)
    return SimConfig(model=MODEL, cluster=ClusterSpec(gpus=16), plan=plan, job=f"loop-{strategy}", seed=3,
                     reshape_pause_s=0.5, heartbeat_interval_s=1.0)


def _run(strategy: str, faults: list[FaultSpec], duration_s: float, tmp_path: Path,
         **loop_options):
    """(the simulator as the run left it, the run)."""
    config = _config(strategy)
    options = PlannerOptions(horizon_s=600.0, pause_s=0.5, rebalance_pause_s=0.5)
    sim = SimEngine(config, faults)
    return sim, run_closed_loop(
        sim, fitted_model(config), strategy=strategy, duration_s=duration_s, options=options,
        hardware=hardware_of(config.cluster), window_s=2.0, directory=tmp_path, **loop_options)


def test_a_slow_gpu_is_detected_from_telemetry_and_the_plan_wins_back_tokens(tmp_path: Path) -> None:
    faults = [FaultSpec(kind="slow_compute", device=5, factor=4.0, at_s=3.0)]
    _, ours = _run("ours", faults, 15.0, tmp_path)
    _, idle = _run("do_nothing", faults, 15.0, tmp_path)
    (det,) = ours.detections
    assert det.category == "fail_slow" and det.onset_s == pytest.approx(3.0, abs=0.5)
    assert det.delay_s is not None and 0 <= det.delay_s < 2.0
    assert ours.false_incidents == 0 and idle.false_incidents == 0
    assert ours.plans_applied >= 1 and idle.plans_applied == 0 and ours.rolled_back == 0
    assert ours.tokens > 1.1 * idle.tokens
    assert ours.training_at_end and ours.series
    assert ours.telemetry_lost == 0 and ours.bus_bytes > 0


def test_the_caller_hears_the_simulated_seconds_done_up_to_the_runs_end(tmp_path: Path) -> None:
    """A bus-loop run at 8,192 GPUs takes hours of wall time: its progress is reported per iteration."""
    done: list[float] = []
    _run("do_nothing", [], 3.0, tmp_path, on_progress=done.append)
    assert len(done) > 3 and done == sorted(done) and done[0] > 0
    assert done[-1] == 3.0  # the last iteration crosses the end: reported at the run's length, not past it


def test_analytics_reads_everything_at_its_turn_however_small_its_transactions(tmp_path: Path) -> None:
    """A turn holds ~5 iterations × 16 ranks of telemetry and heartbeats; in transactions of 8 records
    the consumer must still drain it all, or it falls further behind at every turn (at 8,192 ranks a
    turn is ~45,000 records against the default 20,000). Same events, same order: the same run."""
    faults = [FaultSpec(kind="slow_compute", device=5, factor=4.0, at_s=3.0)]
    _, whole = _run("ours", faults, 10.0, tmp_path)
    _, small = _run("ours", faults, 10.0, tmp_path, analytics_batch=8)
    (det,) = small.detections
    assert det.delay_s is not None and det.delay_s < 2.0
    assert (small.tokens, small.plans_applied, small.telemetry_lost) == (whole.tokens, whole.plans_applied, 0)
    assert [d.detected_s for d in small.detections] == [d.detected_s for d in whole.detections]


def test_telemetry_deleted_before_analytics_read_it_is_counted_not_hidden(tmp_path: Path) -> None:
    """A retention shorter than the gap between analytics reads loses telemetry; the run says how much."""
    _, starved = _run("ours", [], 4.0, tmp_path, telemetry_retention_s=1e-9, analytics_every=10)
    assert starved.telemetry_lost > 0


def test_a_dead_gpu_is_found_by_heartbeats_and_the_job_trains_again(tmp_path: Path) -> None:
    faults = [FaultSpec(kind="stop_device", device=9, at_s=3.0)]
    _, ours = _run("ours", faults, 15.0, tmp_path)
    _, idle = _run("do_nothing", faults, 15.0, tmp_path)
    (det,) = ours.detections
    # the job hangs on it: 1.5 missed 1-s heartbeats, not 3 (analytics/detection/fail_stop.py), plus the phase
    assert det.category == "fail_stop" and det.delay_s is not None and det.delay_s <= 3.5
    assert ours.plans_applied >= 1 and ours.training_at_end
    assert not idle.training_at_end and ours.tokens > 2 * idle.tokens


def test_a_node_holding_half_the_job_dies_and_is_found_as_soon_as_one_dead_gpu(tmp_path: Path) -> None:
    """Half the ranks fall silent at once, so the lower third of the watermarks is their own time;
    judged against the other node's progress (plan.current places ranks on nodes), they are named
    as one dead GPU is, not after the reference's 20-interval lag bound (20–23 s)."""
    _, ours = _run("ours", [FaultSpec(kind="stop_node", node=1, at_s=3.0)], 40.0, tmp_path)
    (det,) = ours.detections
    assert det.category == "fail_stop" and det.delay_s is not None and det.delay_s <= 3.5
    assert ours.false_incidents == 0 and ours.plans_applied >= 1 and ours.training_at_end


def test_location_devices_names_ranks_groups_links_and_nodes() -> None:
    assert location_devices(Location(target="compute", rank=3), 8) == {3}
    assert location_devices(Location(target="compute", tp_group=(4, 5)), 8) == {4, 5}
    assert location_devices(Location(target="link", link=(1, 9)), 8) == {1, 9}
    assert location_devices(Location(target="node", node=1), 8) == set(range(8, 16))
    assert location_devices(Location(target="compute", rank=3, node=0), 8) == {3}  # node: where it lives


def _referee_over(bus):
    """A referee that has read everything on ``bus`` (then closed, with the bus)."""
    from resihp.closed_loop import _Referee

    referee = _Referee(bus, "j", 8, t0_s=1000.0)
    try:
        referee.poll()
    finally:
        referee.close()
        bus.close()
    return referee


def test_the_referee_counts_a_confirmation_that_locates_an_unplaced_incident(tmp_path: Path) -> None:
    """A communication incident opens naming no device and a probe's confirmation names the link:
    the fault is detected at the confirmation and the incident is not a false one."""
    from collector.embedded import EmbeddedBus
    from collector.events import (
        Evidence, FaultCategory, FaultInjected, IncidentConfirmed, IncidentOpened, Severity,
    )

    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    truth, analytics = Authors("j", "sim"), Authors("j", "analytics")
    link = Location(target="link", link=(51, 59), factor=4.0)
    bus.publish([truth.make(FaultInjected(fault_id="f0", category=FaultCategory.FAIL_SLOW, location=link,
                                          start_iteration=10), time_s=1010.0)])
    bus.publish([analytics.make(IncidentOpened(incident_id="i1", category=FaultCategory.FAIL_SLOW,
                                               severity=Severity.MEDIUM, iteration=11, evidence=Evidence(),
                                               locations=[Location(target="link", factor=1.1)], summary="comm"),
                                time_s=1011.0),
                 analytics.make(IncidentConfirmed(incident_id="i1", method="probe", detail="rank 59 ×4",
                                                  locations=[link]), time_s=1012.0)])
    referee = _referee_over(bus)
    ((det, devices),) = referee.faults.values()
    assert devices == {51, 59} and det.onset_s == 10.0 and det.detected_s == 12.0
    assert referee.unmatched - referee.matched == set()


def test_the_referee_counts_an_incident_on_a_faulty_devices_healthy_peers_as_false(tmp_path: Path) -> None:
    """The truth's location carries the slow GPU's TP group (its coordinates); the fault hits the
    GPU alone. An incident on the group matches; one naming only two healthy peers is false."""
    from collector.embedded import EmbeddedBus
    from collector.events import Evidence, FaultCategory, FaultInjected, IncidentOpened, Severity

    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    truth, analytics = Authors("j", "sim"), Authors("j", "analytics")
    slow = Location(target="compute", rank=51, tp_group=tuple(range(48, 56)), factor=2.0)
    bus.publish([truth.make(FaultInjected(fault_id="f0", category=FaultCategory.FAIL_SLOW, location=slow,
                                          start_iteration=10), time_s=1010.0)])

    def opened(incident_id: str, group: tuple[int, ...], time_s: float):
        return analytics.make(IncidentOpened(
            incident_id=incident_id, category=FaultCategory.FAIL_SLOW, severity=Severity.LOW, iteration=11,
            evidence=Evidence(), locations=[Location(target="compute", tp_group=group, factor=1.2)], summary="slow"),
            time_s=time_s)

    bus.publish([opened("group", tuple(range(48, 56)), 1011.0), opened("peers", (54, 55), 1100.0)])
    referee = _referee_over(bus)
    ((det, devices),) = referee.faults.values()
    assert devices == {51} and det.detected_s == 11.0
    assert referee.unmatched - referee.matched == {"peers"}


def test_a_device_dying_during_a_restarts_downtime_is_found_when_it_died(tmp_path: Path) -> None:
    """Elastic restart moves the job off node 1 and is down 10 s; GPU 12, on the node it left, dies
    in the middle of that. The downtime's heartbeats go out (on_applied's events), so the death is
    seen at the time it happened, and nothing is counted false."""
    faults = [FaultSpec(kind="stop_device", device=9, at_s=3.0), FaultSpec(kind="stop_device", device=12, at_s=9.0)]
    _, run = _run("elastic_restart", faults, 30.0, tmp_path, on_applied=lambda sim: sim.idle(10.0))
    assert run.plans_applied == 1 and run.training_at_end
    first, second = sorted(run.detections, key=lambda d: d.onset_s)
    assert second.onset_s == pytest.approx(9.0, abs=0.5) and second.delay_s is not None and second.delay_s <= 3.5
    assert run.false_incidents == 0


def test_a_slow_gpu_left_out_is_taken_back_once_a_probe_finds_it_recovered(tmp_path: Path) -> None:
    """A ×4 GPU is left out of its TP group; it recovers 12 s later. Nothing it runs measures it
    any more, so the detector probes it now and then, resolves the incident when it answers
    healthy, and the engine re-grows the group around it."""
    faults = [FaultSpec(kind="slow_compute", device=5, factor=4.0, at_s=3.0, duration_s=12.0)]
    sim, ours = _run("ours", faults, 40.0, tmp_path)
    assert ours.plans_applied == 2 and ours.rolled_back == 0 and ours.false_incidents == 0 and ours.training_at_end
    assert 5 in sim.plan.devices and sorted(sim.plan.devices) == list(range(16))
