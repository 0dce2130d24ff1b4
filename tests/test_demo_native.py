"""`resihp demo --trainer native --headless --json`: the closed loop on the PyTorch-native executor.

Real processes on the embedded bus: two native CPU ranks (TP1·PP1·DP2, gloo, paced), the
analytics consumer with the detector, the remediation engine with auto-apply. A ×3 fail-slow is
injected on device 1; it must be detected on that rank, planned within the capabilities the
executor declared on the bus (a DP change: a TP1 stage has no TP group to re-form, and a
per-replica PP repartition is not offered, which the proposal says), applied live by the native executor and acknowledged with the reshape's phases.
"""

from __future__ import annotations

import pytest
import json
import subprocess
import sys
from pathlib import Path

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import AckStatus, CommandAck, ExecutorCapabilities, PlanProposed
from collector.stream import EventStream
from tests.test_demo_e2e import _component_logs

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]


def test_the_native_executor_closes_the_loop_on_a_fail_slow(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "demo", "--headless", "--json", "--short", "--trainer", "native",
         "--workdir", str(workdir), "--timeout", "600"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    why = f"\n{json.dumps(result, indent=1)}\n{proc.stderr[-4000:]}{_component_logs(workdir)}"

    (fault,) = result["injected"]
    assert fault["category"] == "fail_slow" and fault["device"] == 1, why
    (found,) = [d for d in result["detected"] if d["matches"] == fault["fault_id"]]
    assert found["localised"] == "rank" and found["ranks"] == [1], why
    assert result["plans_applied"] >= 1 and result["complete"] is True, why
    assert result["events_in_duckdb"] == result["distinct_events_in_duckdb"] == result["events_published"], why
    tps = result["tokens_per_s"]  # paced ranks: the slow replica really costs throughput, the migration wins it back
    assert tps["during"] < 0.8 * tps["before"] and tps["after"] > 1.3 * tps["during"], why

    with EmbeddedBus(workdir / "bus.sqlite") as bus:
        stream = EventStream(bus, "test", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
        events = []
        while batch := stream.poll(timeout_s=0.2):
            events += [d.event.payload for d in batch]
        stream.close()
    (caps,) = [e for e in events if isinstance(e, ExecutorCapabilities)]
    assert caps.executor == "native", why
    proposals = [e for e in events if isinstance(e, PlanProposed)]
    assert proposals and all(any(n.startswith("PP repartition not offered: executor native") for n in p.not_offered)
                             for p in proposals), why
    for p in proposals:  # DP changes only: the same one-device stages, micro-batches moved or a replica dropped
        assert {s.devices for pipe in p.plan.pipelines for s in pipe.stages} <= {(d,) for d in range(4)}, why
    applied = [e for e in events if isinstance(e, CommandAck) and e.status == AckStatus.APPLIED]
    assert applied and "first_step" in applied[0].detail and applied[0].pause_s > 0, why
