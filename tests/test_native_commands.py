"""The native executor obeys bus commands: real rank processes (gloo), the embedded bus, signed events.

The launcher announces the plan and its capabilities, then reads the control topic. One run meets
every kind of command: an unsigned one (``control.rejected``, never acted on), one the native
executor cannot run (acknowledged ``failed`` with the reason before any rank stops), a DP
micro-batch migration (applied live, acknowledged with each phase of the reshape), and a stale
one (``ignored_stale``, from the one epoch fence). Training equals the single-process reference
throughout, so the applied reshape moved the state exactly.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import (
    AckStatus, CommandAck, ControlRejected, EventFactory, ExecutorCapabilities, PlanCurrent, ReconfigureCommand,
)
from collector.plan import Plan
from collector.stream import EventStream
from tests.fixtures.signing import Authors
from trainer.native.capabilities import NATIVE_CAPABILITIES
from trainer.native.model import LlamaConfig
from trainer.native.stage import TrainSettings, reference_losses
from trainer.native.worker import NativeRunSpec, launch_native, read_results
from trainer.spec import BusSpec

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

JOB = "native-cmd"
CFG = LlamaConfig(dim=32, n_layers=4, n_heads=4, ffn_hidden=64, vocab_size=64, dtype="float64")
SETTINGS = TrainSettings(block_size=16)
START = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2)
ITERATIONS = 8


def _moved(epoch: int, counts: tuple[int, int], schedule: str = "1f1b") -> Plan:
    data = START.model_dump()
    data.update(epoch=epoch, schedule=schedule)
    for pipe, n in zip(data["pipelines"], counts):
        pipe["microbatches"] = n
    return Plan.model_validate(data)


def _control(bus: EmbeddedBus) -> list:
    stream = EventStream(bus, f"reader-{time.monotonic_ns()}", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
    out = []
    while batch := stream.poll(timeout_s=0.1):
        out += [d.event for d in batch]
    stream.close()
    return out


def _commander(path: Path, sent: dict[str, str], failures: list[BaseException]) -> None:
    """Once the launcher has announced its plan (it reads commands from then on), send the commands."""
    try:
        with EmbeddedBus(path) as bus:
            while not (announced := [e.payload for e in _control(bus) if isinstance(e.payload, PlanCurrent)]):
                time.sleep(0.05)
            engine = Authors(JOB, "remediation")
            run = {"run": announced[0].run, "expires_at_s": time.time() + COMMAND_TTL_S}  # this run's, fresh
            commands = {"unsigned": ReconfigureCommand(command_id="c-unsigned", plan_id="forged", plan=_moved(1, (3, 1)),
                                                       **run),
                        "cannot": ReconfigureCommand(command_id="c-zb", plan_id="zb", plan=_moved(1, (2, 2), "zero_bubble"),
                                                     **run),
                        "migrate": ReconfigureCommand(command_id="c-mig", plan_id="mig", plan=_moved(1, (3, 1)), **run),
                        "stale": ReconfigureCommand(command_id="c-stale", plan_id="again", plan=_moved(1, (1, 3)), **run)}
            bus.publish([EventFactory(JOB, "rank-1").make(commands["unsigned"])])
            bus.publish([engine.make(commands[k]) for k in ("cannot", "migrate", "stale")])
            sent.update({k: c.command_id for k, c in commands.items()})
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        failures.append(exc)


def test_the_native_executor_takes_bus_commands_fenced_checked_and_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "bus.sqlite"
    EmbeddedBus(path).close()
    sent: dict[str, str] = {}
    failures: list[BaseException] = []
    commander = threading.Thread(target=_commander, args=(path, sent, failures), daemon=True)
    commander.start()
    spec = NativeRunSpec(job=JOB, model=asdict(CFG), settings=asdict(SETTINGS), plan=START, iterations=ITERATIONS,
                         out_dir=str(tmp_path / "out"), timeout_s=60, device="cpu", commands=True,
                         bus=BusSpec(backend="embedded", path=str(path)))
    codes = launch_native(spec)
    commander.join()
    assert not failures and all(c == 0 for c in codes.values()), (failures, codes)

    with EmbeddedBus(path) as bus:
        events = _control(bus)
    caps = [e for e in events if isinstance(e.payload, ExecutorCapabilities)]
    assert [c.payload for c in caps] == [NATIVE_CAPABILITIES] and caps[0].signature.startswith("executor:")
    acks = {e.payload.command_id: e.payload for e in events if isinstance(e.payload, CommandAck)}
    assert sent["unsigned"] not in acks
    assert any(isinstance(e.payload, ControlRejected) and "unsigned command.reconfigure" in e.payload.reason
               for e in events)
    cannot = acks[sent["cannot"]]
    assert cannot.status == AckStatus.FAILED and cannot.running_epoch == 0
    assert cannot.detail.startswith("the native executor cannot run this plan: schedule 'zero_bubble'")
    applied = acks[sent["migrate"]]
    assert applied.status == AckStatus.APPLIED and applied.running_epoch == 1 and applied.pause_s > 0
    # A migration changes only micro-batch counts: the ranks keep their groups, stages and optimizer.
    assert "groups kept" in applied.detail and "agree" in applied.detail and "first_step" in applied.detail
    assert "redistribute" not in applied.detail
    assert acks[sent["stale"]].status == AckStatus.IGNORED_STALE
    announced = [e.payload for e in events if isinstance(e.payload, PlanCurrent)]
    assert [(p.plan.epoch, p.reason) for p in announced] == [(0, "start"), (1, "reshape")]

    ranks, _ = read_results(tmp_path / "out")
    assert {r["final_epoch"] for r in ranks.values()} == {1}
    assert not any(r["refused"] for r in ranks.values())  # the refused plan never reached a rank
    ref, _ = reference_losses(CFG, SETTINGS, [START.global_microbatches] * ITERATIONS)
    for device, r in ranks.items():
        assert sorted(map(int, r["losses"])) == list(range(ITERATIONS))
        for it, loss in r["losses"].items():
            assert loss == pytest.approx(ref[int(it)], rel=1e-9), (device, it)
