"""The goodput fold (collector/goodput.py): each cause is charged where the docs say, the counters
never go back across a restart of the consumer, and on the simulator the fold agrees with the
ground truth of a twin engine that ran the same iterations without the fault."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from analytics.detection.detector import Detector
from analytics.detection.config import DetectorConfig
from collector.goodput import GoodputFold
from analytics.projections.goodput_projection import GoodputProjection
from bench._goodput_truth import TruthRecordingEngine, healthy_seconds
from collector.events import (
    AckStatus, CommandAck, Envelope, EventFactory, Evidence, FaultCategory, IncidentOpened, IncidentResolved,
    IterationPrediction, IterationSummary, Location, Payload, PlanCurrent, PlanDecision, PlanProposed, Severity,
)
from collector.plan import Plan
from collector.stream import Delivery
from trainer.sim.engine import SimConfig
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import run_open_loop
from tests.fixtures.signing import signed_all

JOB = "j"
PLAN = Plan.uniform(tp=1, pp=1, dp=2, num_layers=2, microbatches_per_replica=2)
T0 = 1000.0


class _Log:
    """A hand-written event log on one clock: iterations of 1 s, and whatever happens between."""

    def __init__(self) -> None:
        self.trainer = EventFactory(JOB, "trainer")
        self.analytics = EventFactory(JOB, "analytics")
        self.engine = EventFactory(JOB, "remediation")
        self.events: list[Envelope] = [self.trainer.make(PlanCurrent(plan=PLAN), time_s=T0)]
        self.t = T0
        self.iteration = 0

    def iterate(self, n: int = 1, wall_s: float = 1.0, predicted_s: float = 1.0) -> None:
        for _ in range(n):
            self.t += wall_s
            self.events.append(self.trainer.make(IterationSummary(
                epoch=0, iteration=self.iteration, tokens=100, wall_s=wall_s), time_s=self.t))
            self.events.append(self.analytics.make(IterationPrediction(
                epoch=0, iteration=self.iteration, observed_s=wall_s, predicted_s=predicted_s, tokens=100), time_s=self.t))
            self.iteration += 1

    def incident(self, iid: str, category: FaultCategory, evidence_from: int | None = None) -> None:
        its = list(range(evidence_from, self.iteration)) if evidence_from is not None else []
        self.events.append(self.analytics.make(IncidentOpened(
            incident_id=iid, category=category, severity=Severity.HIGH, iteration=max(self.iteration - 1, 0),
            locations=[Location(target="compute", rank=1, factor=2.0, confidence=0.9)],
            evidence=Evidence(iterations=its), summary="x"), time_s=self.t))

    def at(self, t: float, payload: Payload, factory: EventFactory | None = None) -> None:
        self.t = max(self.t, t)
        self.events.append((factory or self.engine).make(payload, time_s=t))


def _fold(events: list[Envelope]) -> GoodputFold:
    fold = GoodputFold()
    fold.apply_all(events)
    return fold


def test_a_healthy_job_is_all_productive() -> None:
    log = _Log()
    log.iterate(10)
    g = _fold(log.events).breakdown(JOB)
    assert g is not None and g.wall_s == 10.0 and g.productive_s == 10.0 and g.ratio == 1.0
    assert sum(g.loss_s.values()) == 0


def test_a_hang_is_fail_stop_from_the_last_iteration_and_the_reshape_pause_its_own() -> None:
    log = _Log()
    log.iterate(5)  # t = 1005
    log.incident("dead", FaultCategory.FAIL_STOP)
    log.events[-1] = log.analytics.make(log.events[-1].payload, time_s=1012.0)  # noticed 7 s into the hang
    log.at(1020.0, CommandAck(command_id="c", plan_id="p", epoch=1, status=AckStatus.APPLIED, running_epoch=1,
                              pause_s=3.0), log.trainer)
    log.at(1020.0, IncidentResolved(incident_id="dead", iteration=5, reason="reshaped"), log.analytics)
    log.iterate(5)  # 1020 -> 1025
    g = _fold(log.events).breakdown(JOB)
    assert g is not None
    assert g.loss_s["fail_stop"] == pytest.approx(12.0)  # 1005 -> 1017, the ack's pause excluded
    assert g.loss_s["reshape"] == pytest.approx(3.0)
    assert g.productive_s == pytest.approx(10.0) and g.wall_s == pytest.approx(25.0) and g.pending_s == 0


def test_a_wait_for_approval_is_charged_to_approval_not_to_the_fault() -> None:
    log = _Log()
    log.iterate(2)  # 1002
    log.incident("dead", FaultCategory.FAIL_STOP)
    proposal = PlanProposed(plan_id="p", incident_ids=["dead"], strategy="ours", base_epoch=0, plan=PLAN,
                            current_tokens_per_s=0, predicted_tokens_per_s=1, reshape_cost_s=0, diff=[])
    log.at(1004.0, proposal)
    log.at(1010.0, PlanCurrent(plan=PLAN), log.trainer)  # the clock moves on while the plan waits
    log.at(1010.0, PlanDecision(plan_id="p", approve=True, actor="ui:alice"), EventFactory(JOB, "ui:alice"))
    log.at(1011.0, CommandAck(command_id="c", plan_id="p", epoch=1, status=AckStatus.APPLIED, running_epoch=1,
                              pause_s=1.0), log.trainer)
    g = _fold(log.events).breakdown(JOB)
    assert g is not None
    assert g.loss_s["fail_stop"] == pytest.approx(2.0)  # 1002 -> 1004
    assert g.loss_s["approval"] == pytest.approx(6.0)  # 1004 -> 1010
    assert g.loss_s["reshape"] == pytest.approx(1.0)


def test_fail_slow_drag_is_back_dated_to_its_evidence_and_a_stall_is_capped() -> None:
    log = _Log()
    log.iterate(20)
    log.iterate(10, wall_s=2.0)  # slow from iteration 20; a stall below
    log.iterate(1, wall_s=30.0)
    log.iterate(9, wall_s=2.0)
    log.incident("slow", FaultCategory.FAIL_SLOW, evidence_from=20)
    g = _fold(log.events).breakdown(JOB)
    assert g is not None
    # 19 slow iterations lose 1 s each; the 30 s stall is charged as a slow iteration, not 29 s
    assert g.loss_s["fail_slow"] == pytest.approx(20.0, abs=0.5)
    assert g.productive_s == pytest.approx(g.wall_s - g.loss_s["fail_slow"])


def _projection_over(path: Path, events: list[Envelope]) -> GoodputProjection:
    conn = duckdb.connect(str(path))
    projection = GoodputProjection()
    projection.create(conn)
    conn.begin()
    projection.apply(conn, [Delivery("t", 0, i, e) for i, e in enumerate(events)])
    conn.commit()
    conn.close()
    return projection


def test_counters_go_on_from_where_they_were_after_a_restart(tmp_path: Path) -> None:
    log = _Log()
    log.iterate(5)
    log.incident("dead", FaultCategory.FAIL_STOP)
    log.at(1030.0, PlanCurrent(plan=PLAN), log.trainer)
    half = len(log.events)
    log.at(1040.0, IncidentResolved(incident_id="dead", iteration=5, reason="back"), log.analytics)
    log.iterate(5)
    db = tmp_path / "a.duckdb"
    before = _projection_over(db, log.events[:half]).fold.breakdown(JOB)
    after = _projection_over(db, log.events[half:]).fold.breakdown(JOB)  # a new process: state from DuckDB
    whole = _fold(log.events).breakdown(JOB)
    assert before is not None and after is not None
    assert all(after.loss_s[c] >= before.loss_s[c] for c in before.loss_s) and after.wall_s >= before.wall_s
    assert after == whole


def test_events_that_are_no_part_of_a_jobs_time_start_no_job_in_the_projection(tmp_path: Path) -> None:
    """A refused sign-in (or an analytics lease) can be the first event of a job the fold has not
    seen: it starts no job, and the projection stores nothing for it rather than failing."""
    from collector.events import SignInFailed

    refused = SignInFailed(client="127.0.0.1", reason="unknown_user", user_failures=1, client_failures=1)
    first = EventFactory("fresh-job", "ui:console").make(refused, time_s=T0)
    projection = _projection_over(tmp_path / "a.duckdb", [first])
    assert projection.jobs() == []


def _sim_goodput(faults: list[FaultSpec], duration_s: float, **config: object) -> tuple[float, float]:
    """(fold's ratio, truth's ratio) for an open-loop run with the real detector in process."""
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL_PRESETS["tiny"].layers, microbatches_per_replica=4)
    cfg = SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=8), plan=plan, job=JOB, seed=5,
                    heartbeat_interval_s=1.0, **config)
    sim = TruthRecordingEngine(cfg, faults)
    detector = Detector(JOB, DetectorConfig(probes=False))
    out = EventFactory(JOB, "analytics")
    fold = GoodputFold()

    def sink(events: list[Envelope]) -> None:
        for e in events:
            fold.apply(e)
            for p in detector.on_event(e):
                fold.apply(out.make(p, time_s=e.time_s))

    run_open_loop(sim, sink, duration_s=duration_s)
    g = fold.breakdown(JOB)
    assert g is not None and g.wall_s == pytest.approx(sim.now_s)
    return g.ratio, healthy_seconds(cfg, sim.ran, sim.now_s) / sim.now_s


def test_on_the_simulator_the_fold_matches_the_twin_engines_ground_truth() -> None:
    """Short open-loop runs with the real detector: a hang is exact, a slow GPU's drag close
    (``resihp bench metrics`` measures the fault suite in the closed loop against the 1 % goal)."""
    stop, truth = _sim_goodput([FaultSpec(kind="stop_device", device=3, at_s=1.0)], 7.0, restart_after_s=3.0)
    assert truth < 0.8 and stop == pytest.approx(truth, abs=0.01)
    slow, truth = _sim_goodput([FaultSpec(kind="slow_compute", device=3, factor=4.0, at_s=1.0)], 5.0)
    assert truth < 0.8 and slow == pytest.approx(truth, abs=0.025)  # open loop, 5 s; bench metrics: ≤ 0.01 closed


def test_the_console_shows_the_same_goodput_as_the_fold() -> None:
    from ui.read_model import ReadModel

    log = _Log()
    log.iterate(5)
    log.incident("dead", FaultCategory.FAIL_STOP)
    log.at(1030.0, CommandAck(command_id="c", plan_id="p", epoch=1, status=AckStatus.APPLIED, running_epoch=1,
                              pause_s=2.0), log.trainer)
    log.iterate(3)
    model = ReadModel()
    for e in signed_all(log.events):  # the console folds only control events that verify
        model.apply(e)
    shown = model.goodput.breakdown(JOB)
    assert shown is not None and shown == _fold(log.events).breakdown(JOB)
    assert shown.loss_s["fail_stop"] == pytest.approx(23.0) and shown.ratio == pytest.approx(8 / 33)
