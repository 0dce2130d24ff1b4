"""A real broker outage under a running simulated job: 0 fail-stops, and every process survives.

The secure broker the project starts (``up --secure``; the simulator signs in as the ``trainer``
principal, the analytics consumer as ``analytics``, so this is also the platform at work under its
ACLs) is stopped (its process ends, its data dir stays) while the
simulator publishes telemetry and heartbeats and the analytics consumer judges them, and started
again on the same port (at once: ``up`` reuses the port right after ``down``). The simulator's
publishes wait the outage out; the analytics consumer sees it from its bus client, suspends
fail-stop judgement and says so, resumes once caught up, and goes on judging the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from collector import topics
from collector.events import Envelope, IncidentOpened, IterationPrediction
from collector.kafka_bus import KafkaBus
from collector.stream import EventStream
from infra import broker
from infra import kafka_security as security
from resihp.commands.kafka import secure_topics
from resihp.demo.story import story_for
from ui.read_model import ReadModel

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[1]
OUTAGE_S = 4.0  # plus the broker's own stop and start: well over the 6 s (3 heartbeat intervals) that make a rank dead


def _last_iteration(log: Path) -> int:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith('{"iteration"')]
    return json.loads(lines[-1])["iteration"] if lines else -1


def _wait_for(what: str, ok, procs, limit_s: float = 180.0, log_dir: Path | None = None) -> None:
    """Until ``ok()``; a process of ``procs`` that exits first fails the test with the end of its
    log (``log_dir``/NAME.log)."""
    deadline = time.monotonic() + limit_s
    while not ok():
        for name, proc in procs.items():
            log = log_dir / f"{name}.log" if log_dir is not None else None
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            assert proc.poll() is None, f"{name} exited with {proc.returncode} while waiting for {what}:\n{tail}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.2)


def _as(principal: str, creds: dict[str, str], cafile: Path) -> dict[str, str]:
    """The environment that signs the platform's Kafka clients in as ``principal``."""
    lines = security.env_lines("", principal, creds[principal], cafile).splitlines()
    return {k: v for k, v in (ln.split("=", 1) for ln in lines) if k.startswith("RESIHP_KAFKA_") and v}


def test_a_broker_outage_raises_no_fail_stop_and_every_process_survives(secure_kafka, tmp_path: Path) -> None:
    bootstrap, data_dir, creds = secure_kafka["bootstrap"], secure_kafka["data_dir"], secure_kafka["creds"]
    port, controller = secure_kafka["port"], secure_kafka["controller_port"]
    namespace = f"o{uuid.uuid4().hex[:8]}."
    secure_topics(bootstrap, str(data_dir), namespace)  # topics and ACLs under this test's namespace
    story = story_for(8, short=True)
    scenario = dict(story.scenario(), faults=[], iterations=40)  # a healthy job: any fail-stop is false
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    env = dict(os.environ, PYTHONPATH=str(REPO), RESIHP_KAFKA_NAMESPACE=namespace, PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    flags = ["--bus", "kafka", "--bootstrap", bootstrap]
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("analytics", "workload")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["analytics"] = subprocess.Popen(
            [sys.executable, "-m", "resihp.cli", "analytics", *flags, "--db", str(tmp_path / "a.duckdb")],
            cwd=REPO, env=dict(env, **_as("analytics", creds, secure_kafka["cafile"])), stdout=logs["analytics"], stderr=subprocess.STDOUT)
        procs["workload"] = subprocess.Popen(
            [sys.executable, "-m", "resihp.demo.sim_workload", str(tmp_path / "scenario.yaml"), "--speed", "2",
             *flags], cwd=REPO, env=dict(env, **_as("trainer", creds, secure_kafka["cafile"])), stdout=logs["workload"],
            stderr=subprocess.STDOUT)
        _wait_for("the job's 4th iteration", lambda: _last_iteration(tmp_path / "workload.log") >= 4, procs,
                  log_dir=tmp_path)

        gone = time.time()
        assert broker.down(data_dir) is True
        time.sleep(OUTAGE_S)
        assert broker.up(port=port, controller_port=controller, data_dir=data_dir, secure=True,
                         die_with=os.getpid()) == bootstrap
        back = time.time()

        try:
            procs["workload"].wait(240)
        except subprocess.TimeoutExpired:  # show where it is stuck (PYTHONFAULTHANDLER dumps on SIGABRT)
            procs["workload"].send_signal(signal.SIGABRT)
            procs["workload"].wait(10)
            pytest.fail("the simulator hung after the outage:\n" + (tmp_path / "workload.log").read_text()[-4000:])
        assert procs["workload"].returncode == 0, (tmp_path / "workload.log").read_text()[-3000:]
        assert procs["analytics"].poll() is None, (tmp_path / "analytics.log").read_text()[-3000:]
        _wait_for("judgement resumed", lambda: "fail_stop_resumed" in (tmp_path / "analytics.log").read_text(),
                  {"analytics": procs["analytics"]}, limit_s=120, log_dir=tmp_path)
        said = (tmp_path / "analytics.log").read_text()
        assert "fail_stop_suspended" in said, said[-3000:]

        bus = KafkaBus(bootstrap, namespace=namespace, security=security.client_config("console", creds["console"], secure_kafka["cafile"]))
        events: list[Envelope] = []
        with EventStream(bus, f"ui-check-{uuid.uuid4().hex[:6]}", [topics.ANALYTICS]) as stream:

            def predicted_the_last_iterations() -> bool:
                events.extend(d.event for d in stream.poll(timeout_s=1.0))
                return max((e.payload.iteration for e in events if isinstance(e.payload, IterationPrediction)),
                           default=-1) >= scenario["iterations"] - 5

            _wait_for("the last iteration's prediction", predicted_the_last_iterations,
                      {"analytics": procs["analytics"]}, limit_s=120, log_dir=tmp_path)
        bus.close()
        fail_stops = [e.payload for e in events if isinstance(e.payload, IncidentOpened)
                      and e.payload.category.value == "fail_stop"]
        assert fail_stops == [], fail_stops
        # the outage is an event the console shows on the job's page, not only a log line
        model = ReadModel()
        for e in events:
            model.apply(e)
        (outage,) = model.jobs[scenario["job"]].outages.values()
        # from the analytics client's first failed connection (after the broker went) to its catching up
        # (after the broker was back): the console's outage spans the broker's return
        assert outage.ended_s is not None and gone <= outage.started_s < back <= outage.ended_s, (gone, back, outage)
        assert outage.ranks_suspended == 8
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for f in logs.values():
            f.close()
        if not broker.status(data_dir)["running"]:  # leave the session's broker as it was found
            broker.up(port=port, controller_port=controller, data_dir=data_dir, secure=True, die_with=os.getpid())
