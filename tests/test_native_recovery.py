"""The native executor survives a SIGKILLed rank: real rank processes (gloo, CPU, float64).

A ``stop_device`` fault SIGKILLs one rank inside its first forward chunk of an iteration, so its
peers are mid-iteration, in the schedule's and the data-parallel collectives, when its sockets
close. The launcher marks it lost (``resihp/lost/<rank>``); the survivors close their quorum,
drop its replica, take its micro-batches and redo the iteration nobody committed. The losses and
the final parameters must equal one process training the same global batches: the state came
through exactly, from the survivors' pieces or, for pieces that died with their only holder, from
the periodic DCP checkpoint (the steps since it are redone).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import AckStatus, CommandAck, PlanCurrent, ReconfigureCommand, ReshapePhase
from collector.stream import EventStream
from trainer.fault_spec import FaultSpec
from trainer.native.parallelize import DpMode
from trainer.native.worker import NativeRunSpec, ReshapeFault, ScheduledReshape, launch_native, read_results
from trainer.spec import BusSpec
from tests.fixtures.signing import Authors
from tests.test_native_commands import JOB, _control
from tests.test_native_reshape import CFG, SETTINGS, _assert_matches_reference, _plan

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

PHASES = {"agree", "export", "new_mesh", "stages_rebuilt", "redistribute", "first_step"}


def _spec(tmp: Path, plan, iterations: int, killed: int, at: int, dp_mode: DpMode, **extra) -> NativeRunSpec:
    return NativeRunSpec(model=asdict(CFG), settings=asdict(replace(SETTINGS, dp_mode=dp_mode)), plan=plan,
                         iterations=iterations, out_dir=str(tmp), timeout_s=60, device="cpu",
                         faults=[FaultSpec(kind="stop_device", device=killed, at_iteration=at)], **extra)


def _events(path: Path, topic: str, kind: type) -> list:
    with EmbeddedBus(path) as bus, EventStream(bus, "test", [topic]) as stream:
        out = []
        while batch := stream.poll(timeout_s=0.5):
            out += [d.event.payload for d in batch if isinstance(d.event.payload, kind)]
    return out


def test_replicated_dp_survives_a_sigkilled_rank_from_its_peers_and_equals_the_reference(tmp_path):
    # TP1·PP1·DP3 with whole replicas (replicate): device 2 dies in iteration 2; replicas 0 and 1
    # take its micro-batch (2/1/1 → 2/2) and every piece comes from a live peer. The launcher
    # obeys bus commands, so it adopts the survivors' plan and announces it.
    start = _plan(0, (2, [((0,), 0, 4)]), (1, [((1,), 0, 4)]), (1, [((2,), 0, 4)]))
    bus = tmp_path / "bus.sqlite"
    codes = launch_native(_spec(tmp_path, start, 4, killed=2, at=2, dp_mode="replicate", commands=True,
                                bus=BusSpec(backend="embedded", path=str(bus))))
    assert codes[2] == -9 and codes[0] == codes[1] == 0, codes
    ranks, params = read_results(tmp_path)
    _assert_matches_reference(ranks, params, 4)
    assert 2 not in ranks  # SIGKILLed: it wrote nothing
    for device in (0, 1):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [2] and recovery["source"] == "live" and recovery["iteration"] == 2
        assert set(recovery["phases_s"]) == PHASES
        assert ranks[device]["epochs"] == {"0": 0, "1": 0, "2": 1, "3": 1}

    phases = [(p.epoch, p.iteration, p.phase.value, p.ok) for p in _events(bus, topics.TELEMETRY, ReshapePhase)
              if p.rank == 0]
    assert phases == [(1, 2, phase, True) for phase in
                      ("agree", "export", "new_mesh", "stages_rebuilt", "redistribute", "first_step")]
    announced = _events(bus, topics.CONTROL, PlanCurrent)
    assert [(p.plan.epoch, p.reason, p.plan.devices) for p in announced] == [(0, "start", [0, 1, 2]),
                                                                           (1, "reshape", [0, 1])]
    assert [p.microbatches for p in announced[1].plan.pipelines] == [2, 2]


def test_a_piece_with_no_live_holder_comes_from_the_periodic_dcp_checkpoint(tmp_path):
    # TP1·PP1·DP2 with FSDP: device 1 holds the only copy of its shards and dies in iteration 3.
    # Device 0 alone loads the checkpoint of iteration 2 (DCP reshards DP2 → DP1) and redoes 2, 3.
    start = _plan(0, (2, [((0,), 0, 4)]), (2, [((1,), 0, 4)]))
    codes = launch_native(_spec(tmp_path, start, 5, killed=1, at=3, dp_mode="shard",
                                save_dir=str(tmp_path / "ckpt"), checkpoint_every=2))
    assert codes == {0: 0, 1: -9}, codes
    ranks, params = read_results(tmp_path)
    _assert_matches_reference(ranks, params, 5)
    (recovery,) = ranks[0]["reshapes"]
    assert recovery["lost"] == [1] and recovery["source"].startswith("DCP checkpoint")
    assert recovery["iteration"] == 2  # redone from the checkpoint's iteration


def test_without_a_checkpoint_the_survivors_stop_naming_the_lost_pieces(tmp_path):
    start = _plan(0, (2, [((0,), 0, 4)]), (2, [((1,), 0, 4)]))
    codes = launch_native(_spec(tmp_path, start, 3, killed=1, at=1, dp_mode="shard"))
    assert codes == {0: 1, 1: -9}, codes
    ranks, _ = read_results(tmp_path)
    error = ranks[0]["error"]
    assert "recovery from the loss of devices [1] failed" in error and "no live copy of" in error
    assert "--save-dir" in error


def test_a_replica_losing_its_only_rank_of_a_stage_is_dropped_its_partner_released_and_the_rest_train_on(tmp_path):
    # PP2·DP2 replicated, device 3 (replica 1's last stage, TP1) dies in iteration 1: the stage
    # cannot go on, so replica 1 is dropped; device 2 (its partner) sends its pieces and is
    # released; devices 0 and 1 run all 4 micro-batches. A survivor waiting on device 2 in a
    # collective learns of the loss only when that collective times out (gloo cannot be woken),
    # hence the short timeout.
    start = _plan(0, (2, [((0,), 0, 2), ((1,), 2, 4)]), (2, [((2,), 0, 2), ((3,), 2, 4)]))
    spec = _spec(tmp_path, start, 3, killed=3, at=1, dp_mode="replicate").model_copy(update={"timeout_s": 15})
    codes = launch_native(spec)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -9}, codes
    ranks, params = read_results(tmp_path)
    _assert_matches_reference(ranks, params, 3)
    assert ranks[2].get("released") and ranks[2]["epochs"] == {"0": 0}
    for device in (0, 1):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [3] and recovery["source"] == "live" and recovery["iteration"] == 1


def test_a_stage_losing_one_rank_of_its_tp_group_goes_on_at_tp1_on_its_peer(tmp_path):
    # TP2·DP2 replicated, device 3 (replica 1's TP rank 1) dies in iteration 1: replica 1 goes on
    # at TP1 on device 2 (TP exclusion, its 2 micro-batches kept) beside replica 0's TP2, the dead
    # rank's shard re-cut from replica 0's live copy; nothing is released.
    start = _plan(0, (2, [((0, 1), 0, 4)]), (2, [((2, 3), 0, 4)]))
    spec = _spec(tmp_path, start, 3, killed=3, at=1, dp_mode="replicate").model_copy(update={"timeout_s": 15})
    codes = launch_native(spec)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -9}, codes
    ranks, params = read_results(tmp_path)
    _assert_matches_reference(ranks, params, 3)
    for device in (0, 1, 2):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [3] and recovery["source"] == "live" and recovery["iteration"] == 1
        assert ranks[device]["epochs"] == {"0": 0, "1": 1, "2": 1} and not ranks[device].get("released")


@pytest.mark.parametrize(("victim", "phase", "survivors"), [(1, "export", (0, 2)), (2, "redistribute", (0, 1))])
def test_a_rank_killed_mid_reshape_is_recovered_from_the_running_layout_and_equals_the_reference(
        tmp_path, victim, phase, survivors):
    # TP1·PP1·DP3 replicated (2/1/1); before iteration 2 a reshape drops replica 2 (2/2 on devices
    # 0, 1, device 2 released). ``victim`` is SIGKILLed at the end of ``phase`` of that reshape,
    # before the phase's vote: the survivors, woken by the loss count, drop the reshape (nothing was
    # committed), recover from epoch 0 without the victim (its micro-batch to the replica running
    # fewest: 2/2 on the survivors) and train on from iteration 2, as if they had not tried.
    start = _plan(0, (2, [((0,), 0, 4)]), (1, [((1,), 0, 4)]), (1, [((2,), 0, 4)]))
    dropped = _plan(1, (2, [((0,), 0, 4)]), (2, [((1,), 0, 4)]))
    spec = NativeRunSpec(model=asdict(CFG), settings=asdict(replace(SETTINGS, dp_mode="replicate")), plan=start,
                         iterations=4, out_dir=str(tmp_path), timeout_s=60, device="cpu",
                         reshapes=[ScheduledReshape(at_iteration=2, plan=dropped)],
                         reshape_faults=[ReshapeFault(device=victim, epoch=1, phase=phase, action="kill")])
    codes = launch_native(spec)
    assert codes == {**{d: 0 for d in survivors}, victim: -9}, codes
    ranks, params = read_results(tmp_path)
    assert sorted(ranks) == list(survivors)  # the victim wrote nothing
    _assert_matches_reference(ranks, params, 4)
    for device in survivors:
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [victim] and recovery["source"] == "live" and recovery["iteration"] == 2
        assert ranks[device]["epochs"] == {"0": 0, "1": 0, "2": 1, "3": 1} and not ranks[device].get("released")
        (refused,) = ranks[device]["refused"]
        assert "reshape to epoch 1: a rank died during it" in refused


def test_a_rank_killed_in_a_commanded_reshape_fails_the_command_and_the_survivors_plan_is_adopted(tmp_path):
    # The same DP3 job obeying bus commands; the engine commands the DP drop (epoch 1) and device 1
    # is SIGKILLed at the end of that reshape's stages_rebuilt: the command is acknowledged failed
    # (the survivors refused its post, naming the death), the launcher adopts the survivors' own
    # plan (epoch 1: 2/2 on devices 0 and 2) and announces it, and training equals the reference.
    start = _plan(0, (2, [((0,), 0, 4)]), (1, [((1,), 0, 4)]), (1, [((2,), 0, 4)]))
    dropped = _plan(1, (2, [((0,), 0, 4)]), (2, [((1,), 0, 4)]))
    path = tmp_path / "bus.sqlite"
    EmbeddedBus(path).close()
    failures: list[BaseException] = []

    def command() -> None:
        try:
            with EmbeddedBus(path) as bus:
                while not (announced := [e.payload for e in _control(bus) if isinstance(e.payload, PlanCurrent)]):
                    time.sleep(0.05)
                bus.publish([Authors(JOB, "remediation").make(ReconfigureCommand(
                    command_id="c-drop", plan_id="drop", plan=dropped, run=announced[0].run,
                    expires_at_s=time.time() + COMMAND_TTL_S))])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    commander = threading.Thread(target=command, daemon=True)
    commander.start()
    spec = NativeRunSpec(job=JOB, model=asdict(CFG), settings=asdict(replace(SETTINGS, dp_mode="replicate")),
                         plan=start, iterations=8, out_dir=str(tmp_path / "out"), timeout_s=60, device="cpu",
                         commands=True, bus=BusSpec(backend="embedded", path=str(path)),
                         reshape_faults=[ReshapeFault(device=1, epoch=1, phase="stages_rebuilt", action="kill")])
    codes = launch_native(spec)
    commander.join()
    assert not failures and codes == {0: 0, 1: -9, 2: 0}, (failures, codes)
    with EmbeddedBus(path) as bus:
        events = [e.payload for e in _control(bus)]
    (ack,) = [e for e in events if isinstance(e, CommandAck)]
    assert ack.command_id == "c-drop" and ack.status == AckStatus.FAILED
    assert "a rank died during the reshape to epoch 1" in ack.detail or "devices [1] exited" in ack.detail, ack.detail
    announced = [e for e in events if isinstance(e, PlanCurrent)]
    assert [(p.plan.epoch, p.reason, p.plan.devices) for p in announced] == [(0, "start", [0, 1, 2]),
                                                                           (1, "reshape", [0, 2])]
    ranks, params = read_results(tmp_path / "out")
    _assert_matches_reference(ranks, params, 8)
    for device in (0, 2):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [1] and recovery["epoch"] == 1 and ranks[device]["final_epoch"] == 1
