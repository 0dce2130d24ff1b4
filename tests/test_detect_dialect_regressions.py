"""Regressions of the detector on real trainers' dialects, each built with the simulator: a healthy
stage's jitter under levelled scores (no sequence lengths) opens nothing, and a rank nobody traces
that stops is found from the job's stall and named by a liveness probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analytics.detection.judges.noise import fast_side_sigma
from analytics.detection.detector import Detector
from analytics.detection.config import DetectorConfig
from collector.events import FaultCategory, IncidentConfirmed, IncidentOpened, ProbeRequest
from trainer.fault_spec import FaultSpec
from trainer.sim.engine import SimEngine
from trainer.sim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def detect(scenario: str, dialect: str, iterations: int, faults: list[FaultSpec], probes: bool = False) -> list:
    """The scenario recorded in ``dialect`` through the detector, probes answered by the simulator."""
    sc = load_scenario(SCENARIOS / f"{scenario}.yaml")
    engine = SimEngine(sc.model_copy(update={"iterations": iterations, "dialect": dialect, "faults": []}).sim_config(),
                       faults)
    det = Detector(engine.config.job, DetectorConfig(probes=probes))
    out: list = []
    while engine.iteration < iterations and not engine.finished:
        for e in engine.step():
            new = det.on_event(e)
            while new:
                out += new
                asked = [p for p in new if isinstance(p, ProbeRequest)]
                new = [q for p in asked for a in engine.probe(p) for q in det.on_event(a)]
    return out


@pytest.mark.parametrize("dialect", ["megatron", "profiler"])
def test_a_healthy_stage_whose_jitter_runs_high_twice_in_a_row_opens_nothing_without_lengths(dialect: str) -> None:
    # seed 6 of this scenario: replica 3's first stage draws +5.5 % and +6 % of per-stage jitter at
    # iterations 11 and 12; levelled on its replica's stages, the median deviation put σ at 0.009
    # and a ×1.06 incident opened on a healthy stage
    opened = [p for p in detect("fail_stop_node", dialect, 24, []) if isinstance(p, IncidentOpened)]
    assert [i.summary for i in opened] == []


def test_the_noise_of_levelled_scores_is_read_at_the_tail_of_their_fast_side() -> None:
    rng = np.random.default_rng(0)
    raw = rng.normal(0.0, 0.02, size=(400, 4))  # one row per replica-iteration, one column per stage
    levelled = (raw - np.median(raw, axis=1, keepdims=True)).ravel()  # centred on the replica's median
    plain = fast_side_sigma(levelled)
    tail = fast_side_sigma(levelled, levelled=True)
    assert plain < 0.95 * tail  # the median deviation describes the shrunk middle stages
    normal = rng.normal(0.0, 0.02, size=4000)
    assert fast_side_sigma(normal, levelled=True) == pytest.approx(fast_side_sigma(normal), rel=0.1)


def _stops(out: list) -> list[IncidentOpened]:
    return [p for p in out if isinstance(p, IncidentOpened) and p.category == FaultCategory.FAIL_STOP]


def test_an_untraced_tp_rank_that_stops_is_found_from_the_stall_and_named_by_a_liveness_probe() -> None:
    # megatron traces TP rank 0 of every stage; device 13 is TP rank 1 of replica 1's stage 2 and
    # sends nothing: its traced peer and every other rank keep heartbeating while the job hangs
    fault = FaultSpec(kind="stop_device", device=13, at_iteration=12)
    out = detect("fail_stop_gpu", "megatron", 20, [fault], probes=True)
    stops = _stops(out)
    assert len(stops) == 1, [s.summary for s in stops]
    assert stops[0].iteration == 12 and 13 in (stops[0].locations[0].tp_group or ())
    named = [p for p in out if isinstance(p, IncidentConfirmed) and p.incident_id == stops[0].incident_id
             and p.method == "probe"]
    assert [loc.rank for loc in named[-1].locations] == [13]


def test_without_probes_the_stop_of_an_untraced_rank_names_the_untraced_ranks() -> None:
    fault = FaultSpec(kind="stop_device", device=13, at_iteration=12)
    stops = _stops(detect("fail_stop_gpu", "megatron", 20, [fault]))
    assert len(stops) == 1, [s.summary for s in stops]
    group = set(stops[0].locations[0].tp_group or ())
    assert 13 in group and not group & {0, 2, 12}  # traced ranks heartbeat: they are not suspects


def test_a_traced_rank_that_stops_raises_no_hidden_stop() -> None:
    fault = FaultSpec(kind="stop_device", device=12, at_iteration=12)  # traced: its heartbeats stop
    stops = _stops(detect("fail_stop_gpu", "megatron", 20, [fault]))
    assert [s.locations[0].rank for s in stops] == [12]

