"""The node agent's side of a torchtitan job: its plan announced, its commands obeyed by a restart.

torchtitan runs one regular layout per process world, so the platform's reshape of a torchtitan job
is a restart at another layout, driven from the agent (which holds the executor's key; the ranks
only publish telemetry). :class:`TitanRelayout` is called on every pass of the agent's monitor loop
(trainer/agent/node.py) and walks the protocol of trainer/agent/relayout.py:

    announce   once the job's rank 0 has said what it runs (``resihp/relayout/job``: degrees,
               devices, micro-batches, layers), ``plan.current`` and ``plan.capabilities`` go out, so
               the engine plans for this job within what torchtitan can run (layout.py)
    command    a ``command.reconfigure`` (signed, fenced, for this run: trainer/integration.py's
               ``CommandListener``) whose plan is a uniform layout: its torchtitan degrees and the
               device of each new rank (``layout_of``); anything else is acknowledged ``failed``
               with the rule it breaks, and the job runs on untouched
    stop       the stop order in the ranks' store; the ranks stop after one step, together, and save
    restart    when every rank has exited after ``stopped``: the same command line with the new
               degrees and the global batch kept, as many ranks as the plan has devices, each on its
               device (``RESIHP_DEVICES``; on GPUs also ``CUDA_VISIBLE_DEVICES``)
    resumed    the new world's first step: ``command.ack`` applied with the pause, the new
               ``plan.current``, and the pause's phases as ``telemetry.reshape_phase`` events

Probes: each compute ``probe.request`` the listener admits (signed by analytics, for devices the job
runs, bounded) is posted in the ranks' store; the ranks run it together at their next step
boundary (trainer/torchtitan/probes.py) and the asked ones publish ``probe.result``. A link probe is
not answered (a torchtitan rank has no link workload of its own); the detector's wait for it ends.

Fail-stop (trainer/torchtitan/recovery.py): a rank that dies ends its round and torch restarts the
group at the same layout from the last periodic checkpoint; when the same device's rank ends two
rounds in a row the device is judged lost, and the agent restarts the job from that checkpoint at
the largest uniform layout on the devices left, as the next plan epoch (``plan.current``, reason
``restart``, and the pause's phases), without spending a restart. A command in flight when a rank
dies is acknowledged ``failed``.

Single node only: a multi-node job is announced and watched but not restarted at a new layout
(every node's agent would have to restart its share in the same round); its commands are
acknowledged ``failed`` with that reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from collector.events import ReconfigureCommand, ReshapePhase, ReshapePhaseName
from collector.plan import Plan
from trainer.agent.relayout import (DEVICES_ENV, EPOCH_ENV, PROBE_KEY, PROBE_REQUEST_KEY, RESUMED_KEY, STOP_KEY,
                                    STOPPED_KEY, StepMark)
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.integration import CommandListener
from trainer.telemetry import TelemetryPublisher
from trainer.torchtitan.layout import (JOB_KEY, TORCHTITAN_CAPABILITIES, JobShape, TitanLayout, fallback_layout,
                                       layout_of, with_flags)
from trainer.torchtitan.recovery import LostDevices

log = logging.getLogger("resihp.torchtitan")
STOP_DEADLINE_S = 120.0  # a stop order not obeyed by then (no step boundary reached) is a failed command
RESUME_DEADLINE_S = 300.0  # a new world that has not stepped by then


def is_torchtitan_job(module: bool, script: str, script_args: Sequence[str]) -> bool:
    """``resihp run -m torchtitan.train --module trainer.torchtitan …``: a job this controller serves."""
    if not (module and script == "torchtitan.train"):
        return False
    args = list(script_args)
    for i, arg in enumerate(args):
        if arg == "--module" and i + 1 < len(args):
            return args[i + 1].startswith("trainer.torchtitan")
        if arg.startswith("--module="):
            return arg.split("=", 1)[1].startswith("trainer.torchtitan")
    return False


@dataclass
class _InFlight:
    command: ReconfigureCommand
    layout: TitanLayout
    devices: list[int]
    asked_at: float
    stopped: StepMark | None = None
    stopped_at: float = 0.0
    restarted_at: float = 0.0


@dataclass
class _Recovery:
    """A restart past lost devices, from its detection to the new world's first step."""

    epoch: int
    lost: list[int]
    detected_at: float
    restarted_at: float


class TitanRelayout:
    """One torchtitan job's executor inside its (single) node agent."""

    def __init__(self, job: str, open_bus: Callable[[], Any], telemetry: TelemetryPublisher | None,
                 multi_node: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.open_bus, self.telemetry, self.multi_node, self.clock = job, open_bus, telemetry, multi_node, clock
        self.shape: JobShape | None = None
        self.listener: CommandListener | None = None
        self.flight: _InFlight | None = None
        self.recovery: _Recovery | None = None
        self.devices = LostDevices()
        self.env: dict[str, str] = {}
        self.probes_posted = 0  # probe numbers run from 1 per job; a new world's ranks start at 0 done

    # ---- what the agent asks -----------------------------------------------------------------------

    def initial_args(self, args: Sequence[str]) -> list[str]:
        """The job's own command line, with checkpointing on (a restart resumes from a checkpoint)."""
        if "--checkpoint.enable" in args or any(a.startswith("--checkpoint.enable=") for a in args):
            return list(args)
        return [*args, "--checkpoint.enable"]

    def worker_env(self) -> dict[str, str]:
        """Environment of the ranks the agent starts next (the devices and epoch of a new layout)."""
        return dict(self.env)

    def identity(self, rank: int) -> tuple[int, int]:
        """World rank ``rank``'s device and the plan epoch its world runs (heartbeats name devices)."""
        if self.flight is not None and self.flight.restarted_at:
            return self.flight.devices[rank], self.flight.command.plan.epoch
        if self.shape is not None and rank < len(self.shape.devices):
            return self.shape.devices[rank], self.shape.epoch
        return rank, 0

    def watch(self, records: SignedStore, all_exited_ok: bool, failed: Sequence[int] | None,
              relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """One monitor pass. ``records``: this round's ranks' store; ``failed``: None, or the world
        ranks whose failure ended the round; ``relaunch(world, edit_args)`` restarts the worker
        group. Returns True when it restarted the group (the agent carries on)."""
        if self.shape is None:
            self._read_shape(records)
            return False
        assert self.listener is not None
        if failed is not None:
            self.probes_posted = 0  # the next world meets in a new round's store
            if self.flight is not None:
                self._fail("a rank failed before the new layout ran; the job restarts from its last checkpoint")
            return self._on_failure(failed, relaunch)
        if self.recovery is not None:
            self._recovered(records)
            return False
        if self.flight is None:
            command = self.listener.poll()
            self._post_probes(records)
            if command is not None:
                self._begin(command, records)
            return False
        return self._advance(records, all_exited_ok, relaunch)

    def _post_probes(self, records: SignedStore) -> None:
        """The probes the listener admitted since the last pass, for the ranks to run together."""
        assert self.listener is not None
        for request in self.listener.take_probes():
            if request.target != "compute":
                log.info("torchtitan job %s: probe %s asks for a %s probe; torchtitan ranks answer compute probes "
                         "only", self.job, request.probe_id, request.target)
                continue
            self.probes_posted += 1
            records.set(PROBE_REQUEST_KEY.format(number=self.probes_posted), request.model_dump(mode="json"))
            records.set(PROBE_KEY, {"number": self.probes_posted})

    # ---- steps -----------------------------------------------------------------------------------------

    def _read_shape(self, records: SignedStore) -> None:
        shape = records.read(JOB_KEY, JobShape.parse, allowed=RANK_WRITERS)
        if shape is None:
            return
        self.shape = shape
        plan = shape.plan()
        self.listener = CommandListener(self.job, plan, bus=self.open_bus, source="agent:torchtitan",
                                        check=self._refusal)
        self.listener.announce_plan(plan, gpus_per_node=max(1, len(shape.devices)), model_name=shape.model,
                                    layer_state_bytes=shape.layer_state_bytes,
                                    tokens_per_microbatch=shape.tokens_per_microbatch)
        self.listener.announce_capabilities(TORCHTITAN_CAPABILITIES)
        log.info("torchtitan job %s runs %s", self.job, plan.shape())

    def _refusal(self, plan: Plan) -> str | None:
        if self.multi_node:
            return "a torchtitan job is restarted at a new layout on one node only; this job spans several"
        assert self.shape is not None
        try:
            layout_of(plan, self.shape.layout, self.listener.running if self.listener else None)
        except ValueError as exc:  # NotUniform, or a plan no grid can hold
            return str(exc)
        return None

    def _begin(self, command: ReconfigureCommand, records: SignedStore) -> None:
        assert self.shape is not None and self.listener is not None
        layout, devices = layout_of(command.plan, self.shape.layout, self.listener.running)
        self.flight = _InFlight(command, layout, devices, self.clock())
        records.set(STOP_KEY, {"epoch": command.plan.epoch, "command": command.command_id})
        log.info("torchtitan job %s: stop for epoch %d (%s)", self.job, command.plan.epoch, command.plan.shape())

    def _advance(self, records: SignedStore, all_exited_ok: bool,
                 relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        flight = self.flight
        assert flight is not None and self.listener is not None and self.shape is not None
        now = self.clock()
        if flight.restarted_at == 0.0:
            if flight.stopped is None:
                flight.stopped = records.read(STOPPED_KEY, StepMark.parse, allowed=RANK_WRITERS)
                if flight.stopped is not None:
                    flight.stopped_at = now
            if flight.stopped is None and now - flight.asked_at > STOP_DEADLINE_S:
                self._fail(f"the job reached no step boundary in {STOP_DEADLINE_S:.0f} s; it runs on at the old layout")
                return False
            if flight.stopped is None or not all_exited_ok:
                return False
            self._restart(flight, relaunch)
            return True
        mark = records.read(RESUMED_KEY, StepMark.parse, allowed=RANK_WRITERS)
        if mark is not None and mark.epoch == flight.command.plan.epoch:
            self._applied(flight, mark, now)
        elif now - flight.restarted_at > RESUME_DEADLINE_S:
            self._fail(f"the new world did not step within {RESUME_DEADLINE_S:.0f} s")
        return False

    def _restart(self, flight: _InFlight, relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> None:
        assert self.shape is not None
        devices = ",".join(str(d) for d in flight.devices)
        self.env = {DEVICES_ENV: devices, EPOCH_ENV: str(flight.command.plan.epoch), "CUDA_VISIBLE_DEVICES": devices}
        extra = flight.layout.flags(flight.command.plan.pipelines[0].microbatches, self.shape.samples_per_microbatch)
        flight.restarted_at = self.clock()
        self.probes_posted = 0
        relaunch(flight.layout.world, lambda args: with_flags(args, extra))

    def _applied(self, flight: _InFlight, mark: StepMark, now: float) -> None:
        assert self.listener is not None and self.shape is not None
        pause_s = now - flight.asked_at
        stopped = flight.stopped or StepMark(mark.epoch, mark.step)
        self.listener.ack_applied(flight.command, pause_s,
                                  detail=f"restarted at {flight.layout.world} ranks (pp {flight.layout.pp}, "
                                         f"dp {flight.layout.batch}, tp {flight.layout.tp}) from the checkpoint of "
                                         f"step {stopped.step}")
        self._phases(flight, mark, now)
        self.shape = JobShape(layout=flight.layout, devices=tuple(flight.devices), epoch=flight.command.plan.epoch,
                              num_layers=self.shape.num_layers,
                              microbatches=flight.command.plan.pipelines[0].microbatches,
                              samples_per_microbatch=self.shape.samples_per_microbatch, tokens_per_microbatch=self.shape.tokens_per_microbatch,
                              layer_state_bytes=self.shape.layer_state_bytes, model=self.shape.model)
        self.flight = None

    def _phases(self, flight: _InFlight, mark: StepMark, now: float) -> None:
        """The pause as the agent saw it: stop agreed and saved, new world started, first step."""
        if self.telemetry is None:
            return
        epoch, step = flight.command.plan.epoch, mark.step
        spans = [(ReshapePhaseName.EXPORT, flight.stopped_at - flight.asked_at,
                  "every rank stopped after the same step and saved its DCP checkpoint"),
                 (ReshapePhaseName.NEW_MESH, flight.restarted_at - flight.stopped_at, "the old world's ranks exited"),
                 (ReshapePhaseName.FIRST_STEP, now - flight.restarted_at,
                  f"new world of {flight.layout.world} ranks started, loaded the checkpoint (resharded) and stepped")]
        for phase, seconds, detail in spans:
            self.telemetry.publish(ReshapePhase(executor="torchtitan", epoch=epoch, iteration=step, rank=0,
                                                phase=phase, duration_s=max(0.0, seconds), detail=detail))

    # ---- fail-stop -------------------------------------------------------------------------------------

    def _on_failure(self, failed: Sequence[int], relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """A round ended by the ranks ``failed``: leave the restart to torch (same layout, last
        checkpoint) unless a device is now judged lost; then restart past it. True when restarted."""
        assert self.shape is not None and self.listener is not None
        now = self.clock()
        self.recovery = None  # a world that failed before its first step never resumed
        lost = self.devices.failed(self.identity(r)[0] for r in failed)
        if not lost:
            return False
        shape = self.shape
        healthy = self.devices.healthy(shape.devices)
        global_mb = shape.microbatches * shape.layout.batch
        layout = fallback_layout(shape.layout, len(healthy), global_mb, shape.num_layers)
        if layout is None:
            log.error("torchtitan job %s lost devices %s and no uniform layout fits the %d left; torch's restarts "
                      "go on at the old layout", self.job, sorted(self.devices.lost), len(healthy))
            return False
        devices = healthy[:layout.world]
        epoch = max(shape.epoch, self.listener.running.epoch) + 1
        microbatches = global_mb // layout.batch
        joined = ",".join(str(d) for d in devices)
        self.env = {DEVICES_ENV: joined, EPOCH_ENV: str(epoch), "CUDA_VISIBLE_DEVICES": joined}
        extra = layout.flags(microbatches, shape.samples_per_microbatch)
        log.warning("torchtitan job %s lost device(s) %s: restarting from its last checkpoint at %d ranks "
                    "(pp %d, dp %d, tp %d) on devices %s", self.job, sorted(lost), layout.world, layout.pp,
                    layout.batch, layout.tp, joined)
        relaunch(layout.world, lambda args: with_flags(args, extra))
        self.shape = JobShape(layout=layout, devices=tuple(devices), epoch=epoch, num_layers=shape.num_layers,
                              microbatches=microbatches, samples_per_microbatch=shape.samples_per_microbatch,
                              tokens_per_microbatch=shape.tokens_per_microbatch,
                              layer_state_bytes=shape.layer_state_bytes, model=shape.model)
        self.recovery = _Recovery(epoch, sorted(lost), now, self.clock())
        return True

    def _recovered(self, records: SignedStore) -> None:
        """The world restarted past lost devices has stepped: it runs the new plan; say so."""
        recovery = self.recovery
        assert recovery is not None and self.listener is not None and self.shape is not None
        mark = records.read(RESUMED_KEY, StepMark.parse, allowed=RANK_WRITERS)
        if mark is None or mark.epoch != recovery.epoch:
            return
        now = self.clock()
        self.recovery = None
        self.listener.adopt(self.shape.plan(), reason="restart")
        log.info("torchtitan job %s runs %s without device(s) %s since step %d", self.job, self.shape.plan().shape(),
                 recovery.lost, mark.step)
        if self.telemetry is None:
            return
        lost = ", ".join(str(d) for d in recovery.lost)
        for phase, seconds, detail in (
                (ReshapePhaseName.NEW_MESH, recovery.restarted_at - recovery.detected_at,
                 f"device(s) {lost} judged lost; the failed world's ranks stopped"),
                (ReshapePhaseName.FIRST_STEP, now - recovery.restarted_at,
                 f"new world of {self.shape.layout.world} ranks started, loaded the last checkpoint (resharded) "
                 f"and stepped")):
            self.telemetry.publish(ReshapePhase(executor="torchtitan", epoch=recovery.epoch, iteration=mark.step,
                                                rank=0, phase=phase, duration_s=max(0.0, seconds), detail=detail))

    def _fail(self, why: str) -> None:
        assert self.flight is not None and self.listener is not None
        self.listener.ack_failed(self.flight.command, why)
        log.warning("torchtitan job %s: command %s failed: %s", self.job, self.flight.command.command_id, why)
        self.flight = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
