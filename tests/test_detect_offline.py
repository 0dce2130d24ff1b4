"""``resihp detect`` over a simulator trace, and the baselines in the same harness."""

from __future__ import annotations

import json
from pathlib import Path

from analytics.detection.baselines import ChangePointDetector, RawThresholdDetector, RelativeRankDetector
from collector.events import EventFactory, IncidentOpened, IterationSummary
from collector.trace import TraceWriter
from resihp.cli import main
from trainer.sim.engine import SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def test_detect_over_a_trace_writes_the_incidents_as_json_lines(tmp_path: Path) -> None:
    sc = load_scenario(SCENARIOS / "fail_slow_compute_x2.yaml")
    sc = sc.model_copy(update={"iterations": 40, "faults": [
        FaultSpec(kind="slow_compute", device=9, factor=2.0, at_iteration=15)]})
    engine = SimEngine(sc.sim_config(), sc.all_faults())
    trace = tmp_path / "t.parquet"
    with TraceWriter(trace) as w:
        w.write(engine.run(40))
    out = tmp_path / "incidents.jsonl"
    assert main(["detect", str(trace), "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    opened = [x for x in lines if x["kind"] == "incident.opened"]
    assert len(opened) == 1
    p = opened[0]["payload"]
    assert p["category"] == "fail_slow" and 15 <= p["iteration"] <= 17
    loc = p["locations"][0]
    assert 9 in loc["tp_group"] and loc["stage"] == 0 and loc["replica"] == 1  # probes cannot run offline
    assert 1.7 < loc["factor"] < 2.3
    assert all(x["source"] == "analytics" for x in lines)


def _summaries(walls: list[float]):
    f = EventFactory("j", "launcher")
    return [f.make(IterationSummary(epoch=0, iteration=i, tokens=1, wall_s=w)) for i, w in enumerate(walls)]


def test_raw_threshold_and_change_point_fire_on_a_step_in_iteration_time() -> None:
    walls = [1.0] * 40 + [1.5] * 40
    for det in (RawThresholdDetector("j"), ChangePointDetector("j")):
        out = [p for e in _summaries(walls) for p in det.on_event(e)]
        assert [type(p).__name__ for p in out] == ["IncidentOpened"], det.name
        assert isinstance(out[0], IncidentOpened) and 40 <= out[0].iteration <= 46


def test_the_relative_rank_baseline_flags_ranks_doing_more_work_than_the_best() -> None:
    from test_detect_detector import synth

    det = RelativeRankDetector("j")
    out = [p for e in synth(iterations=15, stage_weights=[1.0, 1.0, 1.6]) for p in det.on_event(e)] + det.flush()
    flagged = {p.locations[0].stage for p in out if isinstance(p, IncidentOpened)}
    assert flagged == {2}  # stage imbalance is not a fault, but this baseline cannot tell
