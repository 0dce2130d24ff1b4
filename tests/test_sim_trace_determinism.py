"""Same scenario, same seed: the same trace, byte for byte; `resihp simulate` writes it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from collector.events import FaultInjected, Heartbeat, IterationSummary, RankIteration, ReshapePhase
from collector.trace import read_trace
from resihp.cli import main
from trainer.sim.scenario import load_scenario

SCENARIO = """
name: tiny_fail_slow
description: >-
  test: 16 GPUs, a x2 GPU from iteration 5 to 10, a node failure at 14
seed: {seed}
model: tiny
cluster: {{gpus: 16, gpus_per_node: 8}}
plan: {{tp: 2, pp: 2, dp: 4, microbatches_per_replica: 4}}
iterations: 20
heartbeat_interval_s: 0.05
restart_after_s: 0.2
faults:
  - {{kind: slow_compute, device: 3, factor: 2.0, at_iteration: 5, duration_iterations: 5}}
  - {{kind: stop_node, node: 1, at_iteration: 14}}
"""


def _simulate(tmp_path: Path, name: str, seed: int) -> Path:
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(SCENARIO.format(seed=seed))
    out = tmp_path / f"{name}.parquet"
    assert main(["simulate", str(scenario), "--out", str(out)]) == 0
    return out


def test_same_seed_gives_a_byte_identical_trace(tmp_path: Path) -> None:
    a = pq.read_table(_simulate(tmp_path, "a", seed=3))
    b = pq.read_table(_simulate(tmp_path, "b", seed=3))
    c = pq.read_table(_simulate(tmp_path, "c", seed=4))
    assert a.num_rows > 100
    assert a.equals(b)
    assert a.column("value") != c.column("value")


def test_trace_holds_telemetry_and_ground_truth(tmp_path: Path) -> None:
    events = read_trace(_simulate(tmp_path, "a", seed=3))
    kinds = {e.kind for e in events}
    assert {"telemetry.iteration", "telemetry.summary", "telemetry.heartbeat", "truth.fault"} <= kinds
    truth = [e.payload for e in events if isinstance(e.payload, FaultInjected)]
    assert {t.fault_id for t in truth} == {"fault-0", "fault-1"}
    assert any(t.end_iteration == 10 for t in truth if t.fault_id == "fault-0")
    node = [t for t in truth if t.fault_id == "fault-1"][0]
    assert node.location.target == "node" and node.location.node == 1
    # After the node died, nothing from its devices (8..15); the job restarts on node 0.
    t_dead = min(e.time_s for e in events
                 if isinstance(e.payload, FaultInjected) and e.payload.fault_id == "fault-1")
    late = [e for e in events if e.time_s > t_dead and e.kind.startswith("telemetry.")
            and e.kind != "telemetry.summary"]
    assert late and all(isinstance(e.payload, (RankIteration, Heartbeat, ReshapePhase)) and e.payload.rank < 8
                       for e in late)
    summaries = [e.payload for e in events if isinstance(e.payload, IterationSummary)]
    assert [s.iteration for s in summaries] == list(range(20))
    assert summaries[-1].epoch == 1


def test_every_library_scenario_loads(tmp_path: Path) -> None:
    lib = Path(__file__).resolve().parents[1] / "scenarios"
    files = sorted(lib.glob("*.yaml"))
    assert len(files) >= 12
    for f in files:
        sc = load_scenario(f)
        assert sc.description
        sc.sim_config()
        sc.all_faults()
    assert len(load_scenario("one_failure_every_30min").all_faults()) == 4
