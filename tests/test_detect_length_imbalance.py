"""Real Megatron-style jobs without sequence lengths (issue 54): a replica that draws long
documents for a few iterations opens nothing, a slow GPU among such bursts is still named, undeclared
fused p2p timers are told from the data and said once, and nothing opens or is confirmed under the
detector's smallest incident."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from analytics.detection.config import DetectorConfig
from analytics.detection.detector import Detector
from analytics.detection.frame import build_frame
from analytics.detection.incident_keys import IncidentKey
from analytics.detection.incidents import IncidentBook
from analytics.detection.open_incident import DEAD_FACTOR, Suspect, severity_of
from analytics.detection.p2p_waits import NOTICE, P2P_SEND_OPS, WAIT_SPREAD, undeclared_spread
from collector.events import IncidentConfirmed, IncidentOpened, Payload, RankIteration, Severity, TelemetryNotice
from trainer.fault_spec import FaultSpec
from trainer.sim.engine import SimEngine
from trainer.sim.scenario import load_scenario


def _run(iterations: int, dialect: str = "megatron", faults: list[dict] | None = None, declares_waits: bool = True,
         scenario: str = "long_doc_bursts_pp2_cp2") -> tuple[list[Payload], SimEngine]:
    """The burst family's PP 2 · CP 2 · DP 32 job through the detector (no probes)."""
    sc = load_scenario(scenario).model_copy(update={
        "iterations": iterations, "dialect": dialect, "declares_waits": declares_waits,
        "faults": [FaultSpec(**f) for f in faults or []]})
    engine = SimEngine(sc.sim_config(), sc.all_faults())
    det = Detector(engine.config.job, DetectorConfig())
    out: list[Payload] = []
    while engine.iteration < iterations:
        for e in engine.step():
            out += det.on_event(e)
    return out + det.flush(), engine


def _opened(out: list[Payload]) -> list[IncidentOpened]:
    return [p for p in out if isinstance(p, IncidentOpened)]


def test_replicas_drawing_long_documents_open_nothing_without_lengths() -> None:
    out, engine = _run(60)
    bursts = engine.config.workload.burst_rate * 60 * 32
    assert bursts > 20  # the run holds dozens of bursts (each ×1.3-×1.6 on both stages of a replica)
    assert _opened(out) == []


def test_a_slow_gpu_among_bursts_is_named_at_once_and_sized() -> None:
    out, _ = _run(40, faults=[{"kind": "slow_compute", "device": 42, "factor": 1.5, "at_iteration": 20}])
    opened = _opened(out)
    assert len(opened) == 1
    (loc,) = opened[0].locations
    assert 42 in (loc.tp_group or ()) and 20 <= opened[0].iteration <= 22
    assert loc.factor == pytest.approx(1.5, rel=0.1)  # chunk slowdown: compute and TP communication together


def test_a_replica_slow_on_every_stage_for_longer_than_a_burst_is_named() -> None:
    """Replica 5 (devices 20-23) slow on both stages at once reads like its mix, for a few
    iterations: past ``mix_hold_iterations`` it is judged in full."""
    faults = [{"kind": "slow_compute", "device": d, "factor": 1.5, "at_iteration": 10} for d in (20, 21, 22, 23)]
    out, _ = _run(40, faults=faults)
    opened = _opened(out)
    assert opened and all(set(loc.tp_group or ()) <= {20, 21, 22, 23} for p in opened for loc in p.locations)
    hold = DetectorConfig().mix_hold_iterations
    assert 10 + hold <= min(p.iteration for p in opened) <= 10 + hold + 3


def test_undeclared_fused_timers_are_read_as_holding_waits_and_said_once() -> None:
    out, _ = _run(30, declares_waits=False)
    notices = [p for p in out if isinstance(p, TelemetryNotice)]
    assert [(n.finding, n.message, n.iteration) for n in notices] == [("fused_p2p", NOTICE, 0)]
    assert _opened(out) == []
    declared, _ = _run(10)
    assert not [p for p in declared if isinstance(p, TelemetryNotice)]


def test_wire_only_timers_stay_within_the_spread_that_tells_waits() -> None:
    """The same frame's undeclared send timers holding waits spread ×100s; made wire-only (time
    in proportion to the message, ± packing and noise) they stay far under ``WAIT_SPREAD``."""
    sc = load_scenario("long_doc_bursts_pp2_cp2").model_copy(update={"dialect": "megatron", "declares_waits": False})
    engine = SimEngine(sc.sim_config())
    reports = [e.payload for e in engine.step() if isinstance(e.payload, RankIteration)]
    frame = build_frame(reports)
    assert undeclared_spread(frame) > 10 * WAIT_SPREAD
    sends = np.isin(frame.k_op, P2P_SEND_OPS)
    rng = np.random.default_rng(0)
    wire = np.where(sends, 2e-4 * rng.uniform(0.5, 1.0, len(sends)) * np.exp(0.1 * rng.standard_normal(len(sends))),
                    frame.k_dur)
    assert undeclared_spread(replace(frame, k_dur=wire)) < WAIT_SPREAD / 2


def _suspect(factor: float) -> Suspect:
    return Suspect(key=IncidentKey.of_ranks((4,)), target="compute", rank=4, link=None, node=0, replica=1, stage=0,
                   tp_group=(4,), factor=factor, place_confidence=0.5, iterations=[], observed_s=[], predicted_s=[],
                   rank_factors={}, statistic="", note="", ranks=(4,))


def test_nothing_opens_or_is_confirmed_under_the_smallest_incident() -> None:
    config = DetectorConfig()
    book = IncidentBook("j", config)
    assert book.open_fail_slow(_suspect(1.03), iteration=5) == []
    assert book.open_fail_slow(_suspect(float("nan")), iteration=5) == []
    assert book.open_fail_slow(_suspect(config.min_incident_factor), iteration=5) == []
    (opened,) = book.open_fail_slow(_suspect(config.min_incident_factor + 0.01), iteration=6)
    assert isinstance(opened, IncidentOpened)
    key = IncidentKey.of_ranks((4,))
    for i in range(7, 12):  # still above the drift allowance, but sized ×1.03 now
        book.observe(key, z=0.03, k=0.02, iteration=i, factor=1.03)
        assert not [p for p in book.end_of_iteration(i) if isinstance(p, IncidentConfirmed)]
    book.observe(key, z=0.05, k=0.02, iteration=12, factor=1.05)
    assert [type(p) for p in book.end_of_iteration(12)] == [IncidentConfirmed]


def test_severity_follows_the_size_whatever_found_it() -> None:
    assert [severity_of(f) for f in (1.05, 1.2, 2.0, 3.5, DEAD_FACTOR)] == [
        Severity.LOW, Severity.MEDIUM, Severity.HIGH, Severity.CRITICAL, Severity.CRITICAL]


def test_the_console_shows_the_notice_once_and_only_when_analytics_signed_it() -> None:
    from collector.auth import Signer
    from collector.events import EventFactory
    from ui.read_model import ReadModel

    notice = TelemetryNotice(epoch=0, iteration=3, finding="fused_p2p", message=NOTICE, detail="×900")
    signer = Signer(EventFactory("job-a", "analytics"), "analytics")
    model = ReadModel()
    model.apply(signer.make(notice))
    model.apply(signer.make(notice.model_copy(update={"iteration": 9})))
    assert [(n.message, n.iteration) for n in model.jobs["job-a"].notices.values()] == [(NOTICE, 3)]
    model.apply(EventFactory("job-b", "rank-3").make(notice))  # a telemetry writer cannot put words on the console
    assert "job-b" not in model.jobs
