"""Only the parties allowed to change a job can (collector/auth.py, docs/security.md): each forgery a
bus writer can try is refused by the reader that would act on it, and reported as control.rejected."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from collector import topics
from collector.auth import Gate, Keyring, KeyFileError, create_keys, load_keyring
from collector.codec import decode, encode
from collector.embedded import EmbeddedBus
from collector.events import (
    CommandAck, ControlRejected, Envelope, EventFactory, Evidence, FaultCategory, IncidentOpened, IterationSummary, Location,
    PlanCurrent, PlanDecision, PlanProposed, PolicyChanged, PolicyMode, ProbeRequest, ReconfigureCommand, Severity,
)
from collector.plan import Plan
from collector.plan_lifecycle import PlanLifecycle, PlanStatus, fold
from collector.stream import EventStream
from remediation.engine import EngineConfig, RemediationEngine
from remediation.lifecycle import reaction_id
from remediation.model import PlannerModel
from tests.fixtures.payloads import payload_as, payloads_as
from tests.fixtures.signing import Authors, signed
from trainer.integration import CommandListener, new_command

JOB = "authjob"
PLAN = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)


def _incident(source_factory, incident_id: str = "i1", rank: int = 5) -> Envelope:
    return source_factory.make(IncidentOpened(
        incident_id=incident_id, category=FaultCategory.FAIL_STOP, severity=Severity.HIGH, iteration=5,
        locations=[Location(target="compute", rank=rank)], evidence=Evidence(), summary=f"rank {rank} silent"))


def _rejections(bus: EmbeddedBus) -> list[Envelope]:
    stream = EventStream(bus, f"r-{uuid.uuid4().hex}", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
    out = [d.event for d in stream.poll(timeout_s=0.2) if isinstance(d.event.payload, ControlRejected)]
    stream.close()
    return out


# ---- signatures --------------------------------------------------------------------------------------


def test_a_signed_event_survives_the_wire_and_any_change_breaks_it() -> None:
    event = signed(EventFactory(JOB, "remediation").make(new_command(PLAN.model_copy(update={"epoch": 1}))))
    keys = load_keyring()
    wire = decode(encode(event))
    assert wire.signature == event.signature and keys.verify(wire) is None
    for change in ({"seq": wire.seq + 1}, {"source": "mallory"}, {"time_s": wire.time_s + 1},
                   {"payload": wire.payload.model_copy(update={"plan_id": "other"})}):
        assert "does not verify" in (keys.verify(wire.model_copy(update=change)) or "")
    assert "does not verify" in (Keyring.generate().verify(wire) or "")  # another key set's engine


def test_each_kind_needs_the_role_that_writes_it() -> None:
    keys = load_keyring()
    command = EventFactory(JOB, "mallory").make(new_command(PLAN))
    assert "unsigned command.reconfigure from 'mallory'" in (keys.verify(command) or "")
    assert "only engine/executor may write it" in (keys.verify(keys.sign(command, "analytics")) or "")
    decision = EventFactory(JOB, "ui:alice").make(PlanDecision(plan_id="p", approve=True, actor="ui:alice"))
    assert keys.verify(keys.sign(decision, "console")) is None
    assert "only console/engine" in (keys.verify(keys.sign(decision, "analytics")) or "")
    # the console's key names a person: the actor is the writer, and the engine decides only as policy:auto
    as_bob = EventFactory(JOB, "ui:alice").make(PlanDecision(plan_id="p", approve=True, actor="ui:bob"))
    assert "names actor 'ui:bob'" in (keys.verify(keys.sign(as_bob, "console")) or "")
    assert "only as policy:auto" in (keys.verify(keys.sign(decision, "engine")) or "")
    telemetry_like = EventFactory(JOB, "rank-3").make(
        PolicyChanged(mode=PolicyMode.PROPOSE, actor="rank-3"))
    assert "a console source names a person" in (keys.verify(keys.sign(telemetry_like, "console")) or "")


def test_the_key_directory_is_made_once_private_and_refused_when_others_can_write_or_read_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state" / "keys"
    monkeypatch.setenv("RESIHP_KEYS", str(path))
    first = load_keyring()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and set(first.public) == {"engine", "analytics", "console",
                                                                               "executor", "rank"}
    assert all(stat.S_IMODE((path / f"{role}.key").stat().st_mode) == 0o600 for role in first.public)
    assert stat.S_IMODE((path / "public.json").stat().st_mode) == 0o644
    assert not create_keys(path) and load_keyring().public.keys() == first.public.keys()  # a second start keeps the set
    assert [k.public_bytes_raw() for k in load_keyring().public.values()] == [
        k.public_bytes_raw() for k in first.public.values()]
    os.chmod(path / "engine.key", 0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keyring().signing_key("engine")
    os.chmod(path / "engine.key", 0o600)
    os.chmod(path / "public.json", 0o664)  # whoever can write it can add a signer
    with pytest.raises(KeyFileError, match="chmod 644"):
        load_keyring()
    os.chmod(path / "public.json", 0o644)
    os.chmod(path, 0o770)
    with pytest.raises(KeyFileError, match="chmod 700"):
        load_keyring()
    os.chmod(path, 0o700)
    engine, seed = (path / "engine.key").read_bytes(), first.signing_key("engine").private_bytes_raw().hex()
    (path / "engine.key").unlink()  # a private key given by the environment instead
    monkeypatch.setenv("RESIHP_KEY_ENGINE", seed)
    assert load_keyring().can_sign("engine") and not load_keyring().can_sign("person.nobody")
    monkeypatch.setenv("RESIHP_KEY_ENGINE", "ab" * 32)  # an HMAC key of the old scheme, or another set's
    with pytest.raises(KeyFileError, match="not the private half of the engine key"):
        load_keyring()
    (path / "engine.key").write_bytes(engine)


# ---- the fold and the engine -------------------------------------------------------------------------


def test_the_fold_ignores_a_forged_proposal_that_takes_the_engines_plan_and_event_ids() -> None:
    """A forgery that copies the engine's deterministic ids cannot shadow the real proposal."""
    plan_id = "p0-1"
    event_id = reaction_id(JOB, f"proposal/{plan_id}")
    proposal = PlanProposed(plan_id=plan_id, incident_ids=["i1"], strategy="ours", base_epoch=0,
                            plan=PLAN.model_copy(update={"epoch": 1}), current_tokens_per_s=1.0,
                            predicted_tokens_per_s=2.0, reshape_cost_s=1.0, diff=[])
    forged = EventFactory(JOB, "remediation").make(proposal, event_id=event_id)
    telemetry_same_id = EventFactory(JOB, "rank-0").make(IterationSummary(epoch=0, iteration=1, tokens=1, wall_s=1.0),
                                                         event_id=event_id)
    real = signed(EventFactory(JOB, "remediation").make(proposal, event_id=event_id))
    state = fold([forged, telemetry_same_id, forged, real], PlanLifecycle(job=JOB))
    assert state.plans[plan_id].status == PlanStatus.PROPOSED and state.plans[plan_id].proposal == proposal
    assert set(state.rejected) == {event_id} and "unsigned plan.proposed" in state.rejected[event_id]
    assert [r.message.startswith("not authenticated") for r in state.reports] == [True]  # reported once


def test_the_engine_acts_on_no_forged_incident_policy_or_decision_and_reports_each(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), PLAN)
        mallory = EventFactory(JOB, "analytics")
        forged_policy = EventFactory(JOB, "ui:alice").make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=list(Severity), actor="ui:alice"))
        forged_incident = _incident(mallory, "forged")
        bus.publish([forged_policy, forged_incident, forged_incident])  # a republished forgery: one report
        engine.poll_once()
        assert not engine.state.incidents and not engine.state.plans and engine.state.policy_mode == PolicyMode.PROPOSE
        rejected = {r.event_id: r for r in payloads_as(_rejections(bus), ControlRejected)}
        assert set(rejected) == {forged_policy.id, forged_incident.id} and len(_rejections(bus)) == 2
        assert all(r.reader == "remediation" and r.reason.startswith("unsigned") for r in rejected.values())

        # a genuine incident is planned; a forged approval by "ui:alice" leaves the plan waiting
        bus.publish([_incident(Authors(JOB, "analytics"))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        forged_decision = EventFactory(JOB, "ui:alice").make(
            PlanDecision(plan_id=record.plan_id, approve=True, actor="ui:alice"))
        wrong_key = load_keyring().sign(EventFactory(JOB, "ui:alice").make(
            PlanDecision(plan_id=record.plan_id, approve=True, actor="ui:alice")), "analytics")
        bus.publish([forged_decision, wrong_key])
        engine.poll_once()
        assert record.status == PlanStatus.PROPOSED and record.decided_by is None
        reasons = {r.event_id: r.reason for r in payloads_as(_rejections(bus), ControlRejected)}
        assert forged_decision.id in reasons and "only console/engine" in reasons[wrong_key.id]

        bus.publish([Authors(JOB).make(record.decision(approve=True, actor="ui:alice"))])
        engine.poll_once()
        assert record.status == PlanStatus.COMMANDED and record.decided_by == "ui:alice"  # the real one acts
        # a restarted engine replays the log: the same verdicts, and no second copy of its rejections
        before = _rejections(bus)
        again = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=16), PlannerModel.uniform(8), PLAN)
        again.poll_once()
        assert _rejections(bus) == before and set(again.gate.rejected) == set(engine.gate.rejected)
        assert again.state.plans[record.plan_id].decided_by == "ui:alice"
        engine.close()
        again.close()


# ---- the trainer's side --------------------------------------------------------------------------------


def test_the_listener_runs_no_forged_command_and_no_probe_over_its_bounds(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    with EmbeddedBus(path) as bus, CommandListener(JOB, PLAN, bus=bus) as listener:
        nxt = PLAN.model_copy(update={"epoch": 1})
        forged = EventFactory(JOB, "mallory").make(new_command(nxt, "mallory", run=listener.run))
        tampered = signed(EventFactory(JOB, "remediation").make(new_command(nxt, "p1", run=listener.run)))
        tampered = tampered.model_copy(update={"payload": tampered.payload.model_copy(update={"plan_id": "evil"})})
        analytics = Authors(JOB, "analytics")
        huge = analytics.make(ProbeRequest(probe_id="huge", ranks=[1], repeats=10**7))
        stranger = analytics.make(ProbeRequest(probe_id="stranger", ranks=[99]))
        unsigned_probe = EventFactory(JOB, "rank-1").make(ProbeRequest(probe_id="u", ranks=[1]))
        bus.publish([forged, tampered, huge, stranger, unsigned_probe])
        assert listener.poll() is None and listener.take_probes() == [] and not listener.acks
        reasons = {r.event_id: r.reason for r in payloads_as(_rejections(bus), ControlRejected)}
        assert set(reasons) == {forged.id, tampered.id, huge.id, stranger.id, unsigned_probe.id}
        assert "10,000,000 repeats" in reasons[huge.id] and "[99]" in reasons[stranger.id]
        assert "does not verify" in reasons[tampered.id]

        good = signed(EventFactory(JOB, "remediation").make(new_command(nxt, "p1", run=listener.run)))
        bus.publish([good, analytics.make(ProbeRequest(probe_id="ok", ranks=[1, 2], repeats=3))])
        assert listener.poll() == good.payload and [p.probe_id for p in listener.take_probes()] == ["ok"]


# ---- end to end: a real simulator process on the embedded bus --------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SCENARIO = """description: a healthy tiny job, for the forged-command test
model: tiny
cluster: {gpus: 8, gpus_per_node: 8}
plan: {tp: 2, pp: 2, dp: 2, microbatches_per_replica: 4, schedule: 1f1b}
iterations: 1000000
"""


def _wait_for(bus: EmbeddedBus, what: str, found, deadline_polls: int = 300) -> list[Envelope]:
    """Control events until ``found(events)`` holds (the process runs on its own; we wait for it)."""
    stream = EventStream(bus, f"w-{uuid.uuid4().hex}", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
    events: list[Envelope] = []
    try:
        for _ in range(deadline_polls):
            events += [d.event for d in stream.poll(timeout_s=0.2)]
            if found(events):
                return events
    finally:
        stream.close()
    pytest.fail(f"waited for {what}; the control topic holds {[e.kind for e in events][-20:]}")


@pytest.mark.slow
def test_a_simulator_process_executes_no_forged_command_and_reports_each(tmp_path: Path) -> None:
    import subprocess
    import sys

    scenario, path = tmp_path / "guarded.yaml", tmp_path / "bus.sqlite"
    scenario.write_text(SCENARIO)
    EmbeddedBus(path).close()
    proc = subprocess.Popen([sys.executable, "-m", "resihp.cli", "simulate", str(scenario), "--closed-loop",
                             "--speed", "0.2", "--bus", "embedded", "--bus-path", str(path)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        with EmbeddedBus(path) as bus:
            events = _wait_for(bus, "the simulator's plan.current", lambda evs: any(e.kind == "plan.current" for e in evs))
            (start,) = [e.payload for e in events if isinstance(e.payload, PlanCurrent)]
            nxt = start.plan.model_copy(update={"epoch": start.plan.epoch + 1})
            run = start.run
            forged = EventFactory("guarded", "mallory").make(new_command(nxt, "mallory", run=run))
            wrong_role = load_keyring().sign(EventFactory("guarded", "analytics").make(new_command(nxt, "a", run=run)),
                                             "analytics")
            tampered = signed(EventFactory("guarded", "remediation").make(new_command(nxt, "p1", run=run)))
            tampered = tampered.model_copy(update={"payload": tampered.payload.model_copy(update={"plan_id": "x"})})
            bus.publish([forged, wrong_role, tampered])
            refused = {forged.id, wrong_role.id, tampered.id}

            def rejected(evs: list[Envelope]) -> set[str]:
                return {e.payload.event_id for e in evs if isinstance(e.payload, ControlRejected)
                        and e.payload.reader == "simulator"}

            _wait_for(bus, "three rejections", lambda evs: refused <= rejected(evs))
            good = signed(EventFactory("guarded", "remediation").make(new_command(nxt, "p1", run=run)))
            probe = Authors("guarded", "analytics").make(ProbeRequest(probe_id="hang", ranks=[0], repeats=10**7))
            bus.publish([good, probe])
            events = _wait_for(bus, "the signed command's ack and the probe's rejection",
                               lambda evs: any(e.kind == "command.ack" for e in evs) and probe.id in rejected(evs))
        acks = [e.payload for e in events if isinstance(e.payload, CommandAck)]
        assert [(a.command_id, a.status.value) for a in acks] == [
            (payload_as(good, ReconfigureCommand).command_id, "applied")]
        assert [e.payload.plan.epoch for e in events if isinstance(e.payload, PlanCurrent)] == [0, 1]
        reasons = {e.payload.event_id: e.payload.reason for e in events if isinstance(e.payload, ControlRejected)}
        assert "unsigned" in reasons[forged.id] and "only engine/executor" in reasons[wrong_role.id]
        assert "does not verify" in reasons[tampered.id] and "10,000,000 repeats" in reasons[probe.id]
        assert len([e for e in events if isinstance(e.payload, ControlRejected)]) == 4  # once per event
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert b"Traceback" not in err, err.decode()[-2000:]


def test_the_launchers_intake_queues_only_signed_commands_and_bounded_probes() -> None:
    from trainer.reference.intake import CommandIntake

    intake = CommandIntake(store=None, plan=PLAN, n_layer=8, n_head=4, global_microbatches=PLAN.global_microbatches)
    nxt = PLAN.model_copy(update={"epoch": 1})
    forged = EventFactory(JOB, "remediation").make(new_command(nxt, "mallory", run=intake.run))
    analytics = Authors(JOB, "analytics")
    hang = analytics.make(ProbeRequest(probe_id="hang", ranks=[0], repeats=10**7))
    assert not intake.offer_event(forged) and not intake.offer_event(forged) and not intake.queue
    assert intake.admit_probe(hang) is None
    assert [(r.event_id, r.reader) for r in payloads_as(intake.rejections(), ControlRejected)] == [
        (forged.id, "trainer"), (hang.id, "trainer")]
    assert intake.rejections() == []  # once per event id
    good = signed(EventFactory(JOB, "remediation").make(new_command(nxt, "p1", run=intake.run)))
    own = load_keyring().sign(EventFactory(JOB, "trainer").make(new_command(nxt, "launcher-drop-3", run=intake.run)),
                              "executor")
    assert intake.offer_event(good) and intake.offer_event(own) and len(intake.queue) == 2
    probe = analytics.make(ProbeRequest(probe_id="ok", ranks=[0, 1]))
    assert intake.admit_probe(probe) == probe.payload and intake.rejections() == []


def test_a_forged_plan_current_neither_moves_the_running_epoch_nor_supersedes_a_waiting_plan() -> None:
    from collector.events import PlanCurrent

    authors = Authors(JOB, "trainer")
    proposal = authors.make(PlanProposed(plan_id="p0-1", incident_ids=["i1"], strategy="ours", base_epoch=0,
                                         plan=PLAN.model_copy(update={"epoch": 1}), current_tokens_per_s=1.0,
                                         predicted_tokens_per_s=2.0, reshape_cost_s=1.0, diff=[]))
    forged = EventFactory(JOB, "trainer").make(PlanCurrent(plan=PLAN.model_copy(update={"epoch": 5})))
    state = fold([authors.make(PlanCurrent(plan=PLAN)), proposal, forged], PlanLifecycle(job=JOB))
    assert state.running_epoch == 0 and state.plans["p0-1"].status == PlanStatus.PROPOSED
    assert "unsigned plan.current" in state.rejected[forged.id]


def test_a_flood_of_forgeries_leaves_each_reader_bounded_and_reports_each_forgery_of_a_burst_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever can write the bus can forge without end: the gate and the plan fold keep only the
    newest refusals, yet within that window a forgery seen twice is reported once."""
    monkeypatch.setattr("collector.auth.REFUSALS_KEPT", 50)
    forger = EventFactory(JOB, "analytics")
    forgeries = [_incident(forger, f"i{n}") for n in range(400)]
    gate, state = Gate("test-reader"), PlanLifecycle(job=JOB)
    for event in forgeries + forgeries[-10:]:  # the last ten come back while still remembered
        assert not gate.admit(event)
        fold([event], state)
    assert len(gate.rejected) == len(state.rejected) == 50
    assert set(gate.rejected) == {e.id for e in forgeries[-50:]}
    reported = [r.event_id for r in payloads_as(gate.take(), ControlRejected)]
    assert len(reported) == len(set(reported)) == 400  # every forgery once, the returning ten not again
    assert len(state.reports) <= 1_000 and state.reports[-1].message.startswith("not authenticated")
