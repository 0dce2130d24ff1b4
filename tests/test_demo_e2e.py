"""`resihp demo --headless --json` end to end: the simulator on the embedded bus and on a real
Kafka broker, and the default workload — the 8-rank CPU torch trainer — on the embedded bus.

Each run starts the real components as processes (the workload at 8 GPUs, TP2·PP2·DP2, the
analytics consumer with the detector at its default lags, the remediation engine with
auto-apply), injects a fail-slow and a fail-stop, and ends with one JSON line. The short story
(~92 iterations; the simulator at 6× real time) keeps this inside the CI budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collector.trace import TraceReader

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]


def _run_demo(workdir: Path, bus: str, env_extra: dict[str, str], workload: str = "sim") -> tuple[dict, str]:
    env = dict(os.environ, **env_extra)
    env.pop("RESIHP_KAFKA_NAMESPACE", None)  # the demo picks a fresh one
    speed = ["--speed", "6"] if workload == "sim" else []
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "demo", "--headless", "--json", "--short", "--workload", workload, *speed,
         "--bus", bus, "--workdir", str(workdir), "--timeout", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=500,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1]), proc.stderr


def _component_logs(workdir: Path, lines: int = 25) -> str:
    """The end of each component's log (a CI run keeps nothing but the test's output): what a failed
    run's engine proposed and commanded, and what the trainer acknowledged."""
    out = []
    for name in ("remediate", "workload", "analytics"):
        path = workdir / "logs" / f"{name}.log"
        if path.exists():
            kept = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith("iteration ")]
            tail = kept[-lines:]  # the trainer's per-iteration loss lines say nothing a failure needs
            out.append(f"\n--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "".join(out)


@pytest.mark.parametrize("bus, workload", [
    ("embedded", "sim"), pytest.param("kafka", "sim", marks=pytest.mark.kafka), ("embedded", "torch")])
def test_demo_detects_localises_fixes_and_loses_nothing(
    bus: str, workload: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {"RESIHP_KAFKA_BOOTSTRAP": request.getfixturevalue("kafka_bootstrap")} if bus == "kafka" else {}
    result, log = _run_demo(tmp_path / "demo", bus, env, workload)
    why = f"\n{json.dumps(result, indent=1)}\n{log[-4000:]}{_component_logs(tmp_path / 'demo')}"

    # The story: both faults injected, each detected on the right rank, each fixed by an applied plan.
    injected = {f["fault_id"]: f for f in result["injected"]}
    assert {f["category"] for f in injected.values()} == {"fail_slow", "fail_stop"}, why
    for fault in injected.values():
        found = [d for d in result["detected"] if d["matches"] == fault["fault_id"]]
        assert found and found[0]["localised"] == "rank" and found[0]["ranks"] == [fault["device"]], why
        assert found[0]["category"] == fault["category"], why
        if workload == "torch" and fault["category"] == "fail_slow":
            # a slow member of a lock-step TP pair, named by the probe the trainer answers
            assert found[0]["confirmed_by"] == "probe", why
    assert result["plans_applied"] >= 2 and result["complete"] is True, why

    # Throughput fell during the faults and came back after the reshapes (one of four replicas
    # is gone at the end, so "back" is most of the healthy rate, not all of it).
    tps = result["tokens_per_s"]
    assert tps["during"] < 0.8 * tps["before"], why
    assert tps["after"] > 1.5 * tps["during"] and tps["after"] > 0.6 * tps["before"], why

    # Nothing lost: every telemetry event on the bus is one row in the analytics DuckDB file.
    assert result["events_published"] > 500, why
    assert result["events_in_duckdb"] == result["distinct_events_in_duckdb"] == result["events_published"], why

    # The trace holds the whole log: the same telemetry, plus the story's control events.
    table = TraceReader(result["trace"]).table(columns=["kind"])
    kinds = table.column("kind").to_pylist()
    assert sum(k.startswith("telemetry.") for k in kinds) == result["events_published"], why
    assert {"truth.fault", "incident.opened", "plan.proposed", "plan.decision", "command.reconfigure",
            "command.ack"} <= set(kinds), why
