"""Replays of commands: every command reader obeys an order only for its own run and before it expires,
and a reader restarted for the same run keeps its fence.

Real embedded bus and the real readers: the integration API's CommandListener, the torch launcher's
intake, the simulator's runner and a node agent's NodeCommands. The orders are validly signed (by
the engine or an operator): what stops them is the run they name and their expiry, each refusal
reported as ``control.rejected`` with the reason and never acknowledged.
"""

from __future__ import annotations

import time
from pathlib import Path

from collector import topics
from collector.bus import RawMessage
from collector.auth import load_keyring
from collector.codec import decode, encode
from collector.embedded import EmbeddedBus
from collector.epoch_fence import CLOCK_SKEW_S, COMMAND_TTL_S, order_refusal
from collector.events import (
    AckStatus, CommandAck, ControlRejected, Envelope, EventFactory, NodeCommand, NodeCommandAck, ReconfigureCommand,
)
from collector.plan import Plan
from tests.fixtures.payloads import payload_as, payloads_as
from tests.fixtures.bus_log import control_log
from tests.fixtures.signing import factory
from trainer.agent.commands import NodeCommands
from trainer.reference.intake import CommandIntake
from trainer.integration import CommandListener, new_command
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import SimulatorRunner

JOB = "replayed-job"
MONTH_S = 30 * 86400.0


def _plan(epoch: int = 0, microbatches: int = 2) -> Plan:
    return Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=microbatches, epoch=epoch)


def _refusals(bus: EmbeddedBus, reader: str) -> dict[str, str]:
    return {e.payload.event_id: e.payload.reason for e in control_log(bus)
            if isinstance(e.payload, ControlRejected) and e.payload.reader == reader}


def _acked(bus: EmbeddedBus) -> list[CommandAck]:
    return [e.payload for e in control_log(bus) if isinstance(e.payload, CommandAck)]


def _engine_command(plan: Plan, run: str | None, issued_s: float) -> Envelope:
    """A command the engine signed at ``issued_s`` for ``run``, expiring COMMAND_TTL_S later."""
    command = new_command(plan, "p", run=run, issued_s=issued_s)
    if run is None:  # as written before commands named a run
        command = command.model_copy(update={"run": None, "expires_at_s": None})
    return factory(JOB, "remediation").make(command, time_s=issued_s)


def test_a_fresh_listener_of_the_job_refuses_another_runs_command_an_expired_one_and_one_naming_no_run(
        tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        listener = CommandListener(JOB, _plan(), bus=bus)
        now = time.time()
        old_run = _engine_command(_plan(1), "the-previous-run", now)
        month_old = _engine_command(_plan(1), listener.run, now - MONTH_S)
        unnamed = _engine_command(_plan(1), None, now)
        current = _engine_command(_plan(1), listener.run, now)
        bus.publish([old_run, month_old, unnamed, current])
        got = listener.poll(timeout_s=1.0)
        # the only one obeyed
        assert got is not None and got.command_id == payload_as(current, ReconfigureCommand).command_id
        listener.close()
        refused = _refusals(bus, "trainer")
        assert set(refused) == {old_run.id, month_old.id, unnamed.id}
        assert "is for run the-previous-run" in refused[old_run.id]
        assert "expired" in refused[month_old.id] and f"{CLOCK_SKEW_S:g} s of clock skew" in refused[month_old.id]
        assert "names no run" in refused[unnamed.id]
        assert _acked(bus) == []  # history gets no acknowledgement


def test_a_command_within_the_clock_skew_of_its_expiry_is_obeyed_and_one_asking_too_long_is_not(
        tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        issued = 1_000_000.0
        listener = CommandListener(JOB, _plan(), bus=bus, clock=lambda: issued + COMMAND_TTL_S + CLOCK_SKEW_S / 2)
        greedy = new_command(_plan(1), "greedy", run=listener.run, issued_s=issued, ttl_s=30 * 86400.0)
        late = new_command(_plan(1), "late", run=listener.run, issued_s=issued)
        signer = factory(JOB, "remediation")
        bus.publish([signer.make(greedy, time_s=issued), signer.make(late, time_s=issued)])
        got = listener.poll(timeout_s=1.0)
        assert got is not None and got.command_id == late.command_id
        listener.close()
        (reason,) = _refusals(bus, "trainer").values()
        assert "asks to stay valid" in reason


def test_a_restarted_listener_of_the_same_run_keeps_its_fence(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        first = CommandListener(JOB, _plan(), bus=bus)
        run, now = first.run, time.time()
        applied = _engine_command(_plan(1), run, now)
        bus.publish([applied])
        got = first.poll(timeout_s=1.0)
        assert got is not None
        first.ack_applied(got, pause_s=0.5)
        first.close()

        # the loop restarts from a checkpoint taken at epoch 0 and resumes the same run
        restarted = CommandListener(JOB, _plan(), bus=bus, run=run)
        assert restarted.fence.running_epoch == 1
        assert payload_as(applied, ReconfigureCommand).command_id in restarted.fence.seen
        again = factory(JOB, "remediation").make(applied.payload, time_s=now)  # republished: a new event id
        epoch_one = _engine_command(_plan(1, microbatches=3), run, now)  # an epoch the run already applied
        next_epoch = _engine_command(_plan(2), run, now)
        bus.publish([again, epoch_one, next_epoch])
        got = restarted.poll(timeout_s=1.0)
        assert got is not None and got.command_id == payload_as(next_epoch, ReconfigureCommand).command_id
        restarted.close()
        acks = {a.command_id: a for a in _acked(bus) if a.status != AckStatus.APPLIED}
        assert acks[payload_as(applied, ReconfigureCommand).command_id].status == AckStatus.IGNORED_DUPLICATE
        assert acks[payload_as(epoch_one, ReconfigureCommand).command_id].status == AckStatus.IGNORED_STALE
        assert all(a.run == run for a in _acked(bus))


def test_the_launchers_intake_refuses_a_command_of_another_run_and_an_expired_one() -> None:
    intake = CommandIntake(None, _plan(), n_layer=4, n_head=4, global_microbatches=4)
    now = time.time()
    other = _engine_command(_plan(1), "the-previous-run", now)
    expired = _engine_command(_plan(1), intake.run, now - MONTH_S)
    mine = _engine_command(_plan(1), intake.run, now)
    assert [intake.offer_event(e) for e in (other, expired, mine)] == [False, False, True]
    assert [c.command_id for c in intake.queue] == [payload_as(mine, ReconfigureCommand).command_id]
    assert {r.event_id for r in payloads_as(intake.rejections(), ControlRejected)} == {other.id, expired.id}


def test_the_simulator_refuses_another_runs_command_and_judges_expiry_on_its_simulated_clock(tmp_path: Path) -> None:
    model = MODEL_PRESETS["tiny"]
    start = Plan.uniform(tp=2, pp=2, dp=2, num_layers=model.layers, microbatches_per_replica=4)
    engine = SimEngine(SimConfig(model=model, cluster=ClusterSpec(gpus=16), plan=start, job=JOB))
    moved = Plan.uniform(tp=2, pp=2, dp=2, num_layers=model.layers, microbatches_per_replica=4, epoch=1,
                         first_device=8)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        runner = SimulatorRunner(bus, engine)
        try:
            runner.run(iterations=2)
            sim_now = engine.config.start_time_s + engine.now_s  # the simulated clock: 2023, years behind the wall
            other = _engine_command(moved, "sim-of-another-run", sim_now)
            expired = _engine_command(moved, engine.run_id, sim_now - COMMAND_TTL_S - 2 * CLOCK_SKEW_S)
            bus.publish([other, expired])
            runner.run(iterations=1)
            assert engine.plan.epoch == 0
            assert set(_refusals(bus, "simulator")) == {other.id, expired.id}
            bus.publish([_engine_command(moved, engine.run_id, sim_now)])
            runner.run(iterations=1)
            assert engine.plan.epoch == 1
        finally:
            runner.close()


def _order(node: int, run: str | None, issued_s: float, command_id: str) -> Envelope:
    command = NodeCommand(command_id=command_id, node=node, action="stop", round=0, actor="cli:alice", run=run,
                          expires_at_s=None if run is None else issued_s + COMMAND_TTL_S)
    return factory(JOB, "cli:alice").make(command, time_s=issued_s)  # signed with alice's own key


def test_a_node_agent_refuses_another_runs_order_an_expired_one_and_one_naming_no_run(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    with EmbeddedBus(path) as bus:
        agent = NodeCommands(EmbeddedBus(path), JOB, "agent-1", run="job-s")
        now = time.time()
        other = _order(1, "job-r", now, "other-run")
        expired = _order(1, "job-s", now - MONTH_S, "month-old")
        unnamed = _order(1, None, now, "unnamed")
        mine = _order(1, "job-s", now, "mine")
        bus.publish([other, expired, unnamed, mine])
        assert [c.command_id for c in agent.read(lambda c: c.node == 1)] == ["mine"]
        agent.close()
        refused = _refusals(bus, "agent-1")
        assert set(refused) == {other.id, expired.id, unnamed.id}
        assert "for run job-r" in refused[other.id] and "expired" in refused[expired.id]


def test_a_restarted_node_agent_of_the_same_run_does_not_obey_an_order_it_answered(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    with EmbeddedBus(path) as bus:
        first = NodeCommands(EmbeddedBus(path), JOB, "agent-1", run="job-s")
        order = _order(1, "job-s", time.time(), "stop-1")
        bus.publish([order])
        (command,) = first.read(lambda c: c.node == 1)
        assert first.judge(command, 0) == (None, "")
        first.ack(command, 0, AckStatus.APPLIED, "stopped")
        first.close()

        restarted = NodeCommands(EmbeddedBus(path), JOB, "agent-1b", run="job-s")
        bus.publish_raw([RawMessage(topics.COMMANDS, f"{JOB}/cli:alice".encode(), encode(order))])  # replayed
        (replayed,) = restarted.read(lambda c: c.node == 1)
        status, detail = restarted.judge(replayed, 0)
        assert status == AckStatus.IGNORED_DUPLICATE and "already handled" in detail
        other_run = NodeCommands(EmbeddedBus(path), JOB, "agent-2", run="job-t")
        assert "stop-1" not in other_run.seen  # the answers of another run are not this run's
        restarted.close()
        other_run.close()
        assert [a.run for a in (e.payload for e in control_log(bus)) if isinstance(a, NodeCommandAck)] == ["job-s"]


def test_a_command_written_before_runs_still_decodes_and_verifies_but_is_no_order() -> None:
    """A schema-2 command (no run, no expiry) reads as it was written, so old logs still fold; as an
    order, every reader refuses it."""
    keys = load_keyring()
    legacy = EventFactory(JOB, "remediation").make(ReconfigureCommand(command_id="legacy", plan_id="p", plan=_plan(1)))
    wire = decode(encode(keys.sign(legacy.model_copy(update={"schema_version": 2}), "engine")))
    assert wire.schema_version == 2 and isinstance(wire.payload, ReconfigureCommand) and wire.payload.run is None
    assert keys.verify(wire) is None
    assert "names no run" in (order_refusal(wire.payload, "any-run", wire.time_s, wire.time_s) or "")
