"""No byte string on any topic raises out of any reader we ship.

Hypothesis builds a log from one valid event of every control kind (signed by its writer) and
telemetry of the contract's edges, then mutates it the ways a writer on the bus can: any text in
the signature (non-ASCII, the right shape with the wrong bytes, another role's valid signature),
any JSON value in any envelope field or any payload field at any depth, another kind's name, a cut
record, random bytes; some mutated events that still decode are re-signed by their writer, so
schema-valid oddities reach the readers' logic and not only their doors. Every record goes to a
random topic. The log then goes through every reader: the analytics projector (every projection and
the detector), the remediation engine, a shard and the merge of the sharded analytics, the
console's read model, the integration API's command listener, the torch launcher's intake, a node
agent's command reader, the simulator's closed loop, the plan fold of ``resihp plans list`` and the
demo's watcher with the trace it records. Nothing may raise; every record that is not an event, or is an event
of a kind never published to the topic it was read from, has a dead letter from the projector's
group with a reason, and every control event that does not verify is reported by analytics as
``control.rejected``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analytics.projections.control_tables import ControlProjection
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.sharding.merge import MergeWorker
from analytics.projections.projector import Projector
from analytics.sharding.shards import ShardWorker
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.auth import ROLES, WRITERS, Gate, load_keyring
from collector.bus import RawMessage
from collector.codec import InvalidEvent, decode, encode, readable
from collector.embedded import EmbeddedBus
from collector.events import PAYLOAD_BY_KIND, ControlRejected, DeadLetter, Envelope, EventFactory
from collector.plan import Plan
from collector.stream import EventStream
from remediation.engine import EngineConfig, RemediationEngine
from remediation.log_view import fold_log
from resihp.demo.watch import LogWatch
from remediation.model import PlannerModel
from tests.fixtures.payloads import payloads_as
from tests.test_control_audit import JOB, SOURCE, _sample
from tests.test_poison_properties import payloads
from trainer.agent.commands import NodeCommands
from trainer.integration import CommandListener
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import SimulatorRunner
from trainer.reference.intake import CommandIntake
from ui.read_model import ReadModel

PLAN = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)
READ = [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL, topics.COMMANDS, topics.TRUTH]
GROUP = "analytics"

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
signatures = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["console:é", "console:" + "é" * 64, "engine:" + "0" * 64, "engine:" + "f" * 128, ":", "engine:",
                     "executor:" + "A" * 64, "\x00:" + "0" * 64]),
    st.builds(lambda role, hexs: f"{role}:{hexs}", st.sampled_from(ROLES), st.text("0123456789abcdef", min_size=60,
                                                                                     max_size=130)))


@st.composite
def seeds(draw: st.DrawFn) -> Envelope:
    """A valid event: a control kind as its writer signs it, or telemetry at the contract's edges."""
    if draw(st.booleans()):
        kind = draw(st.sampled_from(sorted(WRITERS)))
        role = WRITERS[kind][0]
        event = EventFactory(JOB, SOURCE[role]).make(_sample(kind, role, draw(st.integers(0, 9))),
                                                     time_s=1000.0 + draw(st.integers(0, 100)))
        return load_keyring().sign(event, role)
    return EventFactory(JOB, draw(st.sampled_from(["rank-0", "rank-1", "analytics"]))).make(
        draw(payloads), time_s=1000.0 + draw(st.integers(0, 100)))


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON document (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any) -> None:
    for step in path[:-1]:
        doc = doc[step]
    doc[path[-1]] = value


@st.composite
def records(draw: st.DrawFn) -> bytes:
    """One record a writer on the bus could append."""
    event = draw(seeds())
    how = draw(st.sampled_from(["as is", "signature", "envelope", "payload", "kind", "cut", "bytes"]))
    if how == "bytes":
        return draw(st.binary(max_size=64))
    raw = encode(event)
    if how == "cut":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if how == "as is":
        return raw  # binary or JSON, as the writer encodes it
    doc = json.loads(readable(raw))  # a binary record's JSON form, to alter
    if how == "signature":
        doc["signature"] = draw(st.one_of(signatures, json_values))
    elif how == "envelope":
        doc[draw(st.sampled_from(["id", "kind", "schema_version", "job", "source", "seq", "time_s", "payload"]))] = \
            draw(json_values)
    elif how == "payload":
        paths = _paths(doc["payload"])
        if paths:
            _set(doc["payload"], draw(st.sampled_from(paths)), draw(json_values))
    elif how == "kind":
        doc["kind"] = draw(st.sampled_from(sorted(PAYLOAD_BY_KIND)))
    out = json.dumps(doc).encode()
    if how != "as is" and isinstance(doc.get("kind"), str) and doc["kind"] in WRITERS and draw(st.booleans()):
        try:  # a writer that holds the role's key and writes something odd: its logic, not its door, is tested
            out = encode(load_keyring().sign(decode(out), WRITERS[doc["kind"]][0]))
        except InvalidEvent:
            pass
    return out


def _decoded(raw: bytes, topic: str) -> Envelope | None:
    """The event a reader of ``topic`` may use, or None (it is dead-lettered)."""
    try:
        event = decode(raw)
    except InvalidEvent:
        return None
    return event if topics.misplaced(event.kind, topic) is None else None


def _poll_all(stream: EventStream) -> list[Envelope]:
    out = []
    while batch := stream.poll(timeout_s=0.01):
        out += [d.event for d in batch]
    return out


def _run_every_reader(bus: EmbeddedBus, tmp: Path) -> None:
    detector = DetectorProjection()
    projector = Projector(bus, tmp / "a.duckdb", GROUP, READ,
                          [EventLogProjection(), TelemetryProjection(), ControlProjection(), detector],
                          gate=Gate("analytics"), on_rejected=detector.enqueue)
    try:
        while projector.step(timeout_s=0.01):
            pass
        detector.flush_outbox(projector.conn, bus)
    finally:
        projector.close()

    engine = RemediationEngine(bus, EngineConfig(job=JOB, num_devices=4), PlannerModel.uniform(4), PLAN)
    try:
        engine.poll_once(timeout_s=0.01)
    finally:
        engine.close()

    shard = ShardWorker(bus, JOB, "shards", name="s0")
    try:
        while shard.step(timeout_s=0.01):
            pass
        shard.shard.flush()
    finally:
        shard.close()
    merge = MergeWorker(bus, "merge")
    try:
        while merge.step(timeout_s=0.01):
            pass
    finally:
        merge.close()

    model = ReadModel()
    with EventStream(bus, "console", READ + [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
        for event in _poll_all(s):
            model.apply(event)

    listener = CommandListener(JOB, PLAN, bus=bus, from_beginning=True)
    try:
        while listener.poll(timeout_s=0.01) is not None:
            pass
    finally:
        listener.close()

    intake = CommandIntake(None, PLAN, n_layer=4, n_head=4, global_microbatches=PLAN.global_microbatches)
    with EventStream(bus, "launcher", list(topics.TRAINER_TOPICS), on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
        for event in _poll_all(s):
            if intake.offer_event(event):
                intake.judge(intake.queue.pop(), set(PLAN.devices))
            intake.admit_probe(event)
        intake.rejections()

    orders = NodeCommands(bus, JOB, "agent-fuzz", from_beginning=True)
    orders.read(lambda c: True)

    sim = SimEngine(SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=4), job=JOB,
                              plan=Plan.uniform(tp=1, pp=2, dp=2, num_layers=MODEL_PRESETS["tiny"].layers,
                                                microbatches_per_replica=2)))
    runner = SimulatorRunner(bus, sim)  # the simulator in closed loop: the orders and probes it obeys
    runner._control_end = {}  # from the start of the log, not its end: the fuzzed records are already there
    while runner.handle_control(timeout_s=0.01):
        pass

    fold_log(bus, JOB, max_polls=50)  # `resihp plans list`: the plan lifecycle's fold over the log
    watch = LogWatch(bus, JOB, tmp / "watched.trace")  # the demo's story of the run, and the trace it records
    try:
        while watch.poll(timeout_s=0.01):
            pass
    finally:
        watch.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(records(), st.sampled_from(READ)), min_size=1, max_size=12))
def test_no_record_on_any_topic_raises_out_of_any_reader(log: list[tuple[bytes, str]]):
    with tempfile.TemporaryDirectory() as tmp:
        bus = EmbeddedBus(Path(tmp) / "bus.sqlite")
        bus.publish_raw([RawMessage(topic, b"k", raw) for raw, topic in log])
        try:
            _run_every_reader(bus, Path(tmp))
            with EventStream(bus, "audit", [topics.DEADLETTER, topics.CONTROL],
                             on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
                seen = _poll_all(s)
        finally:
            bus.close()
    letters = [e.payload for e in seen if isinstance(e.payload, DeadLetter) and e.payload.group == GROUP]
    unusable = [raw for raw, topic in log if _decoded(raw, topic) is None]
    assert len(letters) == len(unusable) and all(d.reason for d in letters)
    refused = {e.payload.event_id for e in seen
               if isinstance(e.payload, ControlRejected) and e.payload.reader == "analytics"}
    keys = load_keyring()
    events = [ev for raw, topic in log if (ev := _decoded(raw, topic)) is not None]
    admitted = {ev.id for ev in events if keys.verify(ev) is None}  # an id applied once is not refused as a copy
    assert {ev.id for ev in events if keys.verify(ev) is not None} - admitted <= refused


def test_a_decision_signed_with_a_non_ascii_mac_is_a_dead_letter_for_every_reader_and_the_next_event_is_read(
        tmp_path: Path):
    """The record that crash-looped every reader: a plan.decision whose signature holds a non-ASCII
    character (a comparison of two texts raised TypeError), written by a telemetry writer onto the
    telemetry topic. Now it fails the envelope's pattern at decode, and each reader goes past it."""
    from collector.events import PlanDecision

    event = EventFactory(JOB, "ui:alice").make(PlanDecision(plan_id="p1-0", approve=True, actor="ui:alice"))
    doc = json.loads(encode(event))
    doc["signature"] = "console:é"
    poison = json.dumps(doc).encode()
    after = EventFactory(JOB, "rank-0").make(_sample_heartbeat())
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        for topic in (topics.TELEMETRY, topics.CONTROL, topics.COMMANDS):
            bus.publish_raw([RawMessage(topic, b"k", poison)])
        bus.publish([after])
        _run_every_reader(bus, tmp_path)
        with EventStream(bus, "audit", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
            letters = [e.payload for e in _poll_all(s) if isinstance(e.payload, DeadLetter)]
    mine = [d for d in letters if d.group == GROUP]
    assert len(mine) == 3 and all("signature" in d.reason for d in mine)
    assert {d.group for d in letters} >= {GROUP, "console", "launcher"}  # every reader dead-letters it, and goes on


def _sample_heartbeat():
    from collector.events import Heartbeat

    return Heartbeat(rank=0, epoch=0, iteration=0, interval_s=1.0)


def test_verify_is_total_over_any_signature_value():
    """A signature built in-process around the wire's checks (or any object) gets a reason, never an exception."""
    from collector.events import PlanDecision

    keys = load_keyring()
    event = EventFactory(JOB, "ui:alice").make(PlanDecision(plan_id="p", approve=True, actor="ui:alice"))
    for bad in ["console:é", "console:" + "é" * 64, 7, b"console:00", ["x"], "", "engine:" + "0" * 64]:
        reason = keys.verify(event.model_copy(update={"signature": bad}))
        assert isinstance(reason, str) and reason


def test_a_signed_command_on_the_telemetry_topic_is_dead_lettered_as_misplaced_not_verified(tmp_path: Path):
    """Kafka's ACLs let rank writers write telemetry only: a command found there was written by one of
    them, however well signed (a copy of a real one). Every reader dead-letters it by its topic."""
    from collector.events import ReconfigureCommand

    command = load_keyring().sign(EventFactory(JOB, "remediation").make(ReconfigureCommand(
        command_id="c-misplaced", plan_id="p", plan=PLAN.model_copy(update={"epoch": 1}))), "engine")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish_raw([RawMessage(topics.TELEMETRY, b"k", encode(command))])
        with EventStream(bus, GROUP, [topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
            assert _poll_all(s) == []
        with EventStream(bus, "audit", [topics.DEADLETTER], on_assign=lambda ps: {tp: 0 for tp in ps}) as s:
            (letter,) = payloads_as(_poll_all(s), DeadLetter)
    assert "command.reconfigure is never published to resihp.telemetry" in letter.reason
