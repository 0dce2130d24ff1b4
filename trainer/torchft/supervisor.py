"""A torchft job on one host: the lighthouse, its replica groups, and the executor that evicts one.

``python -m trainer.torchft --groups 3 --job J --assets DIR --workdir DIR [-- torchtitan flags]``
starts, in order:

    lighthouse  torchft's own (``torchft_lighthouse``, from the torchft wheel) on a free port, its
                join timeout and heartbeat timeout short enough for a CPU job's seconds-long steps
    stores      one TCPStore per group, held here: the group's torch rendezvous, torchft's manager
                address, and the signed records of trainer/torchft/membership.py
    groups      ``G`` torchtitan worlds (``--module trainer.torchft``), group ``g`` on devices
                ``g·n … g·n+n−1``, each under trainer/agent/child.py so none outlives this process
    executor    :class:`TorchftEviction`: announce the plan (every group a replica) and the
                capability to evict; obey signed, fenced commands; report each step of an eviction
                and of the heal that ends it

Everything it started ends with it: the groups and the lighthouse hold the parent-death signal,
and a normal end stops them in order (groups first, then the lighthouse).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from collector.events import ReconfigureCommand, ReshapePhase, ReshapePhaseName
from collector.plan import PipelinePlan, Plan
from trainer.agent.child import AGENT_PID_ENV, die_with_parent
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.integration import CommandListener
from trainer.telemetry import TelemetryPublisher
from trainer.torchft.membership import (JOINED_KEY, LEFT_KEY, ORDER_KEY, PROGRESS_KEY, TORCHFT_CAPABILITIES,
                                        GroupProgress, Probation, StandingOrder, eviction_refusal, evicted_groups)
from trainer.agent.relayout import StepMark
from trainer.torchtitan.layout import JOB_KEY, JobShape, TitanLayout, plan_of

log = logging.getLogger("resihp.torchft")
LEAVE_DEADLINE_S = 120.0  # an out order not obeyed by then (no step boundary reached)


@dataclass(frozen=True)
class LighthouseSpec:
    """The lighthouse's settings. ``join_timeout_ms``: how long it waits once for a group that
    heartbeats but does not ask (the first quorum after an eviction pays it); ``min_replicas``: the
    fewest groups a quorum may have."""

    min_replicas: int = 1
    join_timeout_ms: int = 5000
    heartbeat_timeout_ms: int = 5000
    quorum_tick_ms: int = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lighthouse_argv(spec: LighthouseSpec, port: int) -> list[str]:
    # the lighthouse installed beside this interpreter (the virtual environment's bin/), else on PATH
    binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or shutil.which("torchft_lighthouse")
    if binary is None:
        raise FileNotFoundError("torchft_lighthouse is not installed: pip install -e '.[torchtitan]' (torchft 0.2.0)")
    return [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(spec.min_replicas),
            "--join_timeout_ms", str(spec.join_timeout_ms), "--heartbeat_timeout_ms", str(spec.heartbeat_timeout_ms),
            "--quorum_tick_ms", str(spec.quorum_tick_ms)]


@dataclass
class _Eviction:
    command: ReconfigureCommand
    groups: list[int]
    asked_at: float
    left: dict[int, StepMark] = field(default_factory=dict)
    left_at: float = 0.0
    applied_at: float = 0.0
    back_asked_at: float = 0.0
    probation_s: float = 0.0


class TorchftEviction:
    """The executor of one torchft job: evict a replica group on command, take it back after its
    probation. Called on every pass of the supervisor's loop; reads and writes only signed records."""

    def __init__(self, job: str, records: list[SignedStore], groups: list[tuple[int, ...]], lighthouse: LighthouseSpec,
                 open_bus: Callable[[], Any], telemetry: TelemetryPublisher | None, probation: Probation,
                 clock: Callable[[], float] = time.monotonic, progress_log: Path | None = None) -> None:
        self.job, self.records, self.groups, self.lighthouse = job, records, groups, lighthouse
        self.progress_log = progress_log
        self._last_progress: dict[int, GroupProgress] = {}
        self.open_bus, self.telemetry, self.probation, self.clock = open_bus, telemetry, probation, clock
        self.shape: JobShape | None = None
        self.listener: CommandListener | None = None
        self.full_plan: Plan | None = None
        self.out: set[int] = set()
        self.evictions: dict[int, int] = {}  # group → times evicted
        self.flight: _Eviction | None = None
        self.probations: list[_Eviction] = []
        self._serial = 0

    # ---- announce --------------------------------------------------------------------------------

    def _read_shape(self) -> None:
        shape = self.records[0].read(JOB_KEY, JobShape.parse, allowed=RANK_WRITERS)
        if shape is None:
            return
        self.shape = shape
        devices = [d for g in self.groups for d in g]
        layout = TitanLayout(pp=1, dp_replicate=len(self.groups), dp_shard=1, tp=1)  # a group of one rank each
        self.full_plan = plan_of(layout, devices, shape.num_layers, shape.microbatches, 0)
        self.listener = CommandListener(self.job, self.full_plan, bus=self.open_bus, source="agent:torchft",
                                        check=self._refusal)
        self.listener.announce_plan(self.full_plan, gpus_per_node=len(devices), model_name=shape.model,
                                    layer_state_bytes=shape.layer_state_bytes,
                                    tokens_per_microbatch=shape.tokens_per_microbatch)
        self.listener.announce_capabilities(TORCHFT_CAPABILITIES)
        log.info("torchft job %s: %d replica groups announced", self.job, len(self.groups))

    def running_plan(self, epoch: int) -> Plan:
        """The plan that runs with the groups now in: theirs replicas, each at its own micro-batches."""
        assert self.full_plan is not None
        kept = [p for i, p in enumerate(sorted(self.full_plan.pipelines, key=lambda p: p.replica)) if i not in self.out]
        pipelines = tuple(PipelinePlan(replica=r, microbatches=p.microbatches, stages=p.stages)
                          for r, p in enumerate(kept))
        return self.full_plan.model_copy(update={"epoch": epoch, "pipelines": pipelines})

    # ---- commands ----------------------------------------------------------------------------------

    def _refusal(self, plan: Plan) -> str | None:
        assert self.listener is not None
        try:
            groups = evicted_groups(plan, self.listener.running, self.groups)
        except ValueError as exc:
            return str(exc)
        live = len(self.groups) - len(self.out)
        return eviction_refusal(live, len(groups), self.lighthouse.min_replicas)

    def watch(self) -> None:
        """One pass: announce once the groups say what they run, then obey, then take back."""
        self._log_progress()
        if self.listener is None:
            self._read_shape()
            return
        if self.flight is None:
            command = self.listener.poll()
            if command is not None:
                self._begin(command)
        else:
            self._advance(self.flight)
        self._probations()

    def _begin(self, command: ReconfigureCommand) -> None:
        assert self.listener is not None
        groups = evicted_groups(command.plan, self.listener.running, self.groups)
        self.flight = _Eviction(command, groups, self.clock())
        self._order(command.plan.epoch, self.out | set(groups), command.command_id)
        log.info("torchft job %s: evict group(s) %s for epoch %d", self.job, groups, command.plan.epoch)

    def _advance(self, flight: _Eviction) -> None:
        assert self.listener is not None
        now = self.clock()
        epoch = flight.command.plan.epoch
        for g in flight.groups:
            if g not in flight.left:
                mark = self.records[g].read(LEFT_KEY, StepMark.parse, allowed=RANK_WRITERS)
                if mark is not None and mark.epoch == epoch:
                    flight.left[g] = mark
        if len(flight.left) < len(flight.groups):
            if now - flight.asked_at > LEAVE_DEADLINE_S:
                self.listener.ack_failed(flight.command, f"group(s) {flight.groups} reached no step boundary in "
                                                         f"{LEAVE_DEADLINE_S:.0f} s; the quorum is unchanged")
                self.flight = None
            return
        if not flight.left_at:
            flight.left_at = now
            self.out |= set(flight.groups)
        stayed = [g for g in range(len(self.groups)) if g not in self.out]
        progress = [self.records[g].read(PROGRESS_KEY, GroupProgress.parse, allowed=RANK_WRITERS) for g in stayed]
        last_left = max(m.step for m in flight.left.values())
        on = [p for p in progress if p is not None and p.participants == len(stayed) and p.committed
              and p.step > last_left]
        if len(on) < len(stayed):
            return
        flight.applied_at = now
        flight.probation_s = sum(self.probation.seconds(self.evictions.get(g, 0)) for g in flight.groups) \
            / len(flight.groups)
        for g in flight.groups:
            self.evictions[g] = self.evictions.get(g, 0) + 1
        plan = self.running_plan(epoch)
        self.listener.ack_applied(flight.command, now - flight.asked_at,
                                  detail=f"group(s) {flight.groups} left the torchft quorum after step {last_left}; "
                                         f"{len(stayed)} group(s) go on at their own batch; back after "
                                         f"{flight.probation_s:.0f} s of probation, healed from a peer")
        self.listener.adopt(plan)  # what runs: the groups in, each at its own batch (not the planner's re-split)
        self._phases(epoch, last_left, [
            (ReshapePhaseName.AGREE, flight.left_at - flight.asked_at,
             f"group(s) {flight.groups} stopped asking for quorum at a step boundary"),
            (ReshapePhaseName.FIRST_STEP, now - flight.left_at,
             f"the lighthouse formed a quorum of {len(stayed)} group(s) and each committed a step in it")])
        self.probations.append(flight)
        self.flight = None

    def _probations(self) -> None:
        """An evicted group whose probation is over is told to come back; once it has committed a
        step in the quorum (healed from a peer), the full plan is announced again."""
        now = self.clock()
        for ev in list(self.probations):
            epoch = ev.command.plan.epoch
            if not ev.back_asked_at:
                if now - ev.applied_at < ev.probation_s:
                    continue
                ev.back_asked_at = now
                self._order(self._running_epoch(), self.out - set(ev.groups), ev.command.command_id)
                log.info("torchft job %s: probation over, group(s) %s rejoin", self.job, ev.groups)
                continue
            marks = {g: self.records[g].read(JOINED_KEY, StepMark.parse, allowed=RANK_WRITERS) for g in ev.groups}
            if not all(m is not None and m.epoch == epoch for m in marks.values()):
                continue
            self.out -= set(ev.groups)
            self.probations.remove(ev)
            step = max(m.step for m in marks.values() if m is not None)
            if self.listener is not None:
                self.listener.adopt(self.running_plan(self._running_epoch()))  # not on a command: the probation's end
            self._phases(epoch, step, [(ReshapePhaseName.REDISTRIBUTE, now - ev.back_asked_at,
                                        f"group(s) {ev.groups} joined the quorum again, healed from a peer over "
                                        "torchft's checkpoint transport, and committed a step")])

    def _order(self, epoch: int, out: set[int], command: str) -> None:
        """Every group's standing order for plan ``epoch`` with the groups ``out`` left out: those
        leave (or stay out), the others take their replica index among the groups in."""
        self._serial += 1
        kept = [g for g in range(len(self.groups)) if g not in out]
        for g, records in enumerate(self.records):
            replica = kept.index(g) if g in kept else 0
            records.set(ORDER_KEY, StandingOrder(self._serial, epoch, g in out, replica, len(kept), command).to_json())

    def _log_progress(self) -> None:
        """Each group's steps as torchft decided them, one JSON line per new step (``progress_log``):
        what ``resihp bench torchft`` measures tokens/s and the quorum's size from."""
        if self.progress_log is None:
            return
        lines = []
        for g, records in enumerate(self.records):
            p = records.read(PROGRESS_KEY, GroupProgress.parse, allowed=RANK_WRITERS)
            if p is not None and p != self._last_progress.get(g):
                self._last_progress[g] = p
                lines.append(json.dumps({"group": g, **p.to_json()}))
        if lines:
            with self.progress_log.open("a") as f:
                f.write("\n".join(lines) + "\n")

    def _running_epoch(self) -> int:
        assert self.listener is not None
        return self.listener.running.epoch

    def _phases(self, epoch: int, step: int, spans: list[tuple[ReshapePhaseName, float, str]]) -> None:
        if self.telemetry is None:
            return
        for phase, seconds, detail in spans:
            self.telemetry.publish(ReshapePhase(executor="torchtitan", epoch=epoch, iteration=max(0, step), rank=0,
                                                phase=phase, duration_s=max(0.0, seconds), detail=detail))

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


# ---- the job ---------------------------------------------------------------------------------------


@dataclass
class FTJob:
    """What ``python -m trainer.torchft`` runs (see the module docstring)."""

    job: str
    groups: int
    assets: Path
    workdir: Path
    steps: int = 40
    ranks_per_group: int = 1
    faults: Path | None = None
    flags: Sequence[str] = ()
    lighthouse: LighthouseSpec = field(default_factory=LighthouseSpec)
    probation: Probation = field(default_factory=Probation)

    def __post_init__(self) -> None:
        if self.groups < 1 or self.ranks_per_group != 1:
            raise ValueError(f"{self.groups} groups of {self.ranks_per_group} ranks: this supervisor runs one or more "
                             "groups of one rank each")

    def group_argv(self, g: int) -> list[str]:
        return [sys.executable, "-m", "trainer.agent.child", "-m", "torchtitan.train",
                "--module", "trainer.torchft", "--config", "llama3_ft_debugmodel",
                "--hf_assets_path", str(self.assets), "--dataloader.dataset_path", str(self.assets),
                "--fault_tolerance.replica_id", str(g), "--fault_tolerance.group_size", str(self.groups),
                "--training.steps", str(self.steps), "--dump_folder", str(self.workdir / f"group-{g}"),
                "--parallelism.data_parallel_shard_degree", "1",
                *(["--resihp.faults", str(self.faults)] if self.faults else []), *self.flags]

    def run(self, telemetry: TelemetryPublisher | None = None, open_bus: Callable[[], Any] | None = None,
            poll_s: float = 0.2) -> int:
        """Start everything, run the executor until every group has exited, stop everything.
        Returns 0 when every group finished its steps."""
        import torch.distributed as dist

        from collector.bus import open_bus as default_open_bus
        from trainer.agent.signed_store import SIGNING_ROLE

        self.workdir.mkdir(parents=True, exist_ok=True)
        scope = f"torchft-{uuid.uuid4().hex[:12]}"
        port = free_port()
        me = os.getpid()
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        procs: list[subprocess.Popen[bytes]] = []
        lighthouse = subprocess.Popen(lighthouse_argv(self.lighthouse, port), stdout=open(logs / "lighthouse.log", "wb"),
                                      stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(me))
        stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
                  for _ in range(self.groups)]
        records = [SignedStore(s, scope, reader="agent:torchft", role=SIGNING_ROLE) for s in stores]
        groups = [tuple(range(g * self.ranks_per_group, (g + 1) * self.ranks_per_group)) for g in range(self.groups)]
        executor = TorchftEviction(self.job, records, groups, self.lighthouse, open_bus or default_open_bus, telemetry,
                                   self.probation, progress_log=self.workdir / "progress.jsonl")
        try:
            for g, store in enumerate(stores):
                env = dict({"OMP_NUM_THREADS": "1"}, **os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True",
                           TORCHELASTIC_RUN_ID=scope, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                           RESIHP_STORE_SCOPE=scope, RESIHP_JOB=self.job,
                           **{AGENT_PID_ENV: str(me)})
                procs.append(subprocess.Popen(self.group_argv(g), env=env, stdout=open(logs / f"group-{g}.log", "wb"),
                                              stderr=subprocess.STDOUT))
            while any(p.poll() is None for p in procs):
                if lighthouse.poll() is not None:
                    raise RuntimeError(f"the lighthouse exited with {lighthouse.returncode}; see {logs / 'lighthouse.log'}")
                executor.watch()
                time.sleep(poll_s)
            return 0 if all(p.returncode == 0 for p in procs) else 1
        finally:
            for p in procs:
                _stop(p)
            _stop(lighthouse)
            executor.close()


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.torchft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default="torchft", help="job name on the bus")
    parser.add_argument("--groups", type=int, default=3, help="replica groups (one CPU rank each)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--assets", type=Path, required=True, help="tokenizer and corpus (python -m trainer.torchtitan.assets DIR)")
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoints and logs")
    parser.add_argument("--faults", type=Path, default=None, help="a fault file (slow_compute on a device)")
    parser.add_argument("--probation", type=float, default=20.0, help="seconds an evicted group stays out (doubling)")
    parser.add_argument("--join-timeout-ms", type=int, default=5000, help="the lighthouse's wait for a silent group")
    parser.add_argument("--min-replicas", type=int, default=1, help="the lighthouse's smallest quorum")
    parser.add_argument("flags", nargs="*", help="torchtitan flags after --")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from collector.bus import open_bus

    telemetry = TelemetryPublisher(open_bus, args.job, 0, heartbeat_s=None, source="agent:torchft")
    job = FTJob(job=args.job, groups=args.groups, assets=args.assets, workdir=args.workdir, steps=args.steps,
                faults=args.faults, flags=args.flags, probation=Probation(first_s=args.probation),
                lighthouse=LighthouseSpec(min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms))
    try:
        return job.run(telemetry=telemetry)
    finally:
        telemetry.close()
