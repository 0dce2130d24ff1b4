"""The audit of the control path: every event kind a reader may act on is signed by exactly the role
collector/auth.py's ``WRITERS`` names, and every reader of it checks. Table-driven over all control
kinds × every signer (none, each role): the right role's event is accepted by every reader, any
other is refused by every reader and visible as a rejection (a ``control.rejected`` on the bus, or
the console's Security page), and never reaches a DuckDB table or a screen."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import duckdb
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.control_tables import ControlProjection
from analytics.sharding.merge import MergeWorker
from analytics.projections.projector import Projector
from collector import topics
from collector.auth import AUTO_ACTOR, ROLES, WRITERS, Gate, load_keyring
from collector.bus import RawMessage
from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.keys import role_of
from collector.events import (
    PAYLOAD_TYPES, AckStatus, BusOutage, CommandAck, ControlRejected, CostFit, CostModelFitted, Envelope, EventFactory,
    Evidence, ExecutorCapabilities, FaultCategory, HangReported, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated,
    IterationPrediction, Location, NodeCommand, NodeCommandAck, NodeSpare, Payload, PlanCurrent, PlanDecision, PlanProposed,
    PlanRolledBack, PlanVerified, PlanWithheld, PolicyChanged, PolicyMode, ProbeRequest, ProbeResult,
    ReconfigureCommand, Severity, TelemetryNotice,
)
from collector.plan import Plan
from collector.stream import EventStream
from remediation.engine import EngineConfig, RemediationEngine
from remediation.model import PlannerModel
from trainer.agent.commands import NodeCommands
from trainer.integration import CommandListener
from ui.read_model import ReadModel

JOB = "audit"
PLAN = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
NEXT = PLAN.model_copy(update={"epoch": 1})
RUN = "audit-run"  # the run every sample command names, valid until 1000 s + COMMAND_TTL_S on the readers' clock
# Kinds on the control path that stay unsigned, and why nothing acts on them.
UNSIGNED = {
    "control.rejected": "a reader's report of a refusal; the Security page lists it, nothing acts on it",
    "ui.signin_failed": "a console's report of a refused sign-in; listed, never acted on",
}
SOURCE = {None: "mallory", "engine": "remediation", "analytics": "analytics", "console": "ui:alice",
          "executor": "trainer", "rank": "rank-1", "person.alice": "cli:alice"}
SIGNERS = (None, *ROLES, "person.alice")  # unsigned, each role, and a person's own key (it writes as the console)


def _sample(kind: str, role: str | None, n: int) -> Payload:
    """A payload of ``kind`` as ``role``'s writer would make it (ids unique per ``n``)."""
    loc = [Location(target="compute", rank=1)]
    actor = AUTO_ACTOR if role == "engine" else SOURCE[role]
    samples: dict[str, Payload] = {
        "command.reconfigure": ReconfigureCommand(command_id=f"c{n}", plan_id=f"p{n}", plan=NEXT, run=RUN,
                                                  expires_at_s=1000.0 + COMMAND_TTL_S),
        "plan.proposed": PlanProposed(plan_id=f"p{n}", incident_ids=[], strategy="ours", base_epoch=0, plan=NEXT,
                                      current_tokens_per_s=1.0, predicted_tokens_per_s=2.0, reshape_cost_s=1.0, diff=[]),
        "plan.verified": PlanVerified(plan_id=f"p{n}", measured_tokens_per_s=2.0, predicted_tokens_per_s=2.0),
        "plan.rolled_back": PlanRolledBack(plan_id=f"p{n}", reason="slower", measured_tokens_per_s=1.0,
                                           predicted_tokens_per_s=2.0),
        "plan.withheld": PlanWithheld(reason="waits", base_epoch=0),
        "plan.decision": PlanDecision(plan_id=f"p{n}", approve=True, actor=actor),
        "policy.changed": PolicyChanged(mode=PolicyMode.AUTO, auto_severities=list(Severity), actor=actor),
        "incident.opened": IncidentOpened(incident_id=f"i{n}", category=FaultCategory.FAIL_SLOW,
                                          severity=Severity.HIGH, iteration=3, locations=loc, evidence=Evidence(),
                                          summary="rank 1 slow"),
        "incident.confirmed": IncidentConfirmed(incident_id=f"i{n}", method="probe", detail="probed"),
        "incident.updated": IncidentUpdated(incident_id=f"i{n}", iteration=4, severity=Severity.HIGH, locations=loc,
                                            evidence=Evidence()),
        "incident.resolved": IncidentResolved(incident_id=f"i{n}", iteration=5, reason="gone"),
        "analytics.cost_model": CostModelFitted(epoch=0, iteration=3, fits=[CostFit(
            stage=0, kind="F", alpha_s_per_token=1e-6, beta_s_per_token_sq=1e-9, gamma_s=1e-3, samples=10)]),
        "probe.request": ProbeRequest(probe_id=f"q{n}", ranks=[0, 1]),
        "probe.result": ProbeResult(probe_id=f"q{n}", rank=1, duration_s=0.1, reference_s=0.1),
        "command.ack": CommandAck(command_id=f"c{n}", plan_id=f"p{n}", epoch=1, status=AckStatus.FAILED,
                                  running_epoch=0),
        "plan.current": PlanCurrent(plan=PLAN, run=RUN),
        "plan.capabilities": ExecutorCapabilities(executor="reference"),
        "analytics.prediction": IterationPrediction(epoch=0, iteration=n, observed_s=1.0, predicted_s=1.0, tokens=1),
        "analytics.bus_outage": BusOutage(outage_id=f"o{n}", started_s=1.0, ended_s=2.0, duration_s=1.0),
        "analytics.telemetry_notice": TelemetryNotice(epoch=0, iteration=n, finding="fused_p2p", message="declare it"),
        "command.node": NodeCommand(command_id=f"n{n}", node=1, action="stop", round=0, run=RUN,
                                    expires_at_s=1000.0 + COMMAND_TTL_S),
        "telemetry.hang": HangReported(iteration=n, ranks=[1], waiting=[0], op="all_reduce", stuck_for_s=60.0,
                                       deadline_s=30.0, summary="rank 1 entered no op for 60 s"),
        "command.node_ack": NodeCommandAck(command_id=f"n{n}", node=1, action="stop", round=0,
                                           status=AckStatus.APPLIED, running_round=0, ranks=[2, 3]),
        "node.spare": NodeSpare(spare=f"agent-{n}", run=RUN, ranks=2, waiting=True, expires_at_s=1000.0 + 60),
    }
    return samples[kind]


def _events() -> tuple[list[Envelope], set[str], set[str]]:
    """Every control kind written by every signer: (events, ids that must be accepted, ids refused)."""
    keys = load_keyring()
    out: list[Envelope] = []
    good: set[str] = set()
    bad: set[str] = set()
    for n, (kind, role) in enumerate((k, r) for k in sorted(WRITERS) for r in SIGNERS):
        event = EventFactory(JOB, SOURCE[role]).make(_sample(kind, role, n), time_s=1000.0 + n)
        if role is not None:
            event = keys.sign(event, role)
        out.append(event)
        (good if role is not None and role_of(role) in WRITERS[kind] else bad).add(event.id)
    return out, good, bad


def _rejected_on_bus(bus: EmbeddedBus, reader: str) -> set[str]:
    stream = EventStream(bus, f"audit-{uuid.uuid4().hex}", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
    try:
        return {d.event.payload.event_id for d in stream.poll(timeout_s=0.2)
                if isinstance(d.event.payload, ControlRejected) and d.event.payload.reader == reader}
    finally:
        stream.close()


def test_every_kind_on_the_control_path_is_signed_or_named_as_never_acted_on() -> None:
    on_control_path = {p.KIND for p in PAYLOAD_TYPES
                       if set(topics.topics_for(p.KIND)) & {topics.CONTROL, topics.COMMANDS}
                       or p.KIND.startswith("incident.")}
    assert on_control_path - set(WRITERS) == set(UNSIGNED)
    assert set(WRITERS) <= {p.KIND for p in PAYLOAD_TYPES}
    events_md = (Path(__file__).parent.parent / "docs" / "events.md").read_text()
    for kind, roles in WRITERS.items():  # the reference says who signs each kind
        assert f"Signed by: {' or '.join(f'`{r}`' for r in roles)}" in events_md.split(f"### `{kind}`")[1], kind


def test_every_signed_kind_is_verified_by_each_reader_that_can_act_on_it(tmp_path: Path) -> None:
    events, good, bad = _events()
    assert len(good) >= len(WRITERS) and len(bad) >= 3 * len(WRITERS)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish(events)

        # analytics: the projector's gate keeps forgeries out of every table and reports each
        detector = DetectorProjection()
        projector = Projector(bus, tmp_path / "analytics.duckdb", "analytics",
                              [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                              [EventLogProjection(), ControlProjection(), detector],
                              gate=Gate("analytics"), on_rejected=detector.enqueue)
        while projector.step(timeout_s=0.1):
            pass
        detector.flush_outbox(projector.conn, bus)
        projector.close()
        conn = duckdb.connect(str(tmp_path / "analytics.duckdb"), read_only=True)
        stored = {i for (i,) in conn.execute("SELECT id FROM events").fetchall()}
        plans = {p for (p,) in conn.execute("SELECT plan_id FROM plans").fetchall()}
        incidents = {i for (i,) in conn.execute("SELECT incident_id FROM incidents").fetchall()}
        conn.close()
        assert good <= stored and not bad & stored
        forged_plans = {e.payload.plan_id for e in events if e.id in bad and isinstance(e.payload, PlanProposed)}
        forged_incidents = {e.payload.incident_id for e in events if e.id in bad and isinstance(e.payload, IncidentOpened)}
        assert plans and not plans & forged_plans and incidents and not incidents & forged_incidents
        assert _rejected_on_bus(bus, "analytics") == bad

        # the remediation engine and the sharded analytics' merge read no telemetry (telemetry.hang is
        # evidence for the single consumer's detector, above; the sharded analytics does not act on it)
        off_telemetry = {e.id for e in events if topics.TELEMETRY not in topics.topics_for(e.kind)}
        engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=4), PlannerModel.uniform(4), PLAN)
        engine.poll_once()
        engine.close()
        assert _rejected_on_bus(bus, "remediation") == bad & off_telemetry

        # the sharded analytics' merge
        merge = MergeWorker(bus, "audit-merge")
        while merge.step(timeout_s=0.1):
            pass
        merge.close()
        assert _rejected_on_bus(bus, "analytics-merge") == bad & off_telemetry

        # the trainer: the kinds it obeys (commands from the commands topic, probe requests)
        listener = CommandListener(JOB, PLAN, bus=bus, from_beginning=True, run=RUN, clock=lambda: 1000.0)
        listener.poll()
        listener.close()
        obeyed = {e.id for e in events if e.kind in ("command.reconfigure", "probe.request")}
        assert _rejected_on_bus(bus, "trainer") == bad & obeyed

        # a node agent of resihp run: the node commands addressed to it, from the commands topic
        orders = NodeCommands(bus, JOB, "agent-audit", from_beginning=True, run=RUN, clock=lambda: 1000.0)
        obeyed_orders = orders.read(lambda c: c.node == 1)
        assert {o.command_id for o in obeyed_orders} == {e.payload.command_id for e in events
                                                         if e.id in good and isinstance(e.payload, NodeCommand)}
        assert _rejected_on_bus(bus, "agent-audit") == {e.id for e in events if e.id in bad and e.kind == "command.node"}

    # the console: a forgery changes no screen and is listed on the Security page
    model = ReadModel()
    for e in events:
        model.apply(e)
    assert {r.event_id for r in model.security.rejected if r.by == "console"} == bad
    assert not set(model.plans) & forged_plans and not set(model.incidents) & forged_incidents
    assert {e.payload.plan_id for e in events if e.id in good and isinstance(e.payload, PlanProposed)} <= set(model.plans)


def test_a_trainer_obeys_a_command_only_from_the_commands_topic(tmp_path: Path) -> None:
    """The control topic's copy of a command is the lifecycle's record: written there alone (by a
    principal the commands topic's ACL would refuse), even a validly signed command is not run."""
    keys = load_keyring()
    command = keys.sign(EventFactory(JOB, "remediation").make(ReconfigureCommand(
        command_id="c-control-only", plan_id="p", plan=NEXT, run=RUN, expires_at_s=time.time() + COMMAND_TTL_S)),
        "engine")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        listener = CommandListener(JOB, PLAN, bus=bus, run=RUN)
        bus.publish_raw([RawMessage(topics.CONTROL, b"audit/remediation", encode(command))])
        assert listener.poll(timeout_s=0.2) is None
        routed = keys.sign(EventFactory(JOB, "remediation").make(ReconfigureCommand(
            command_id="c-routed", plan_id="p", plan=NEXT, run=RUN, expires_at_s=time.time() + COMMAND_TTL_S)),
            "engine")
        assert bus.publish([routed]) == 1
        assert sum(bus.end_offsets([topics.COMMANDS]).values()) == 1  # and its record on control
        got = listener.poll(timeout_s=0.5)
        assert got is not None and got.command_id == "c-routed"
        listener.close()
