"""The node agent: torch's LocalElasticAgent, plus heartbeats, hang checks and recovery timings.

torch's agent owns the life cycle — rendezvous, start this node's ranks, watch them, and after a
failure stop them, re-rendezvous (every agent of the job joins the next round) and start them
again, up to ``--max-restarts`` times. This class adds what the platform needs at three hooks:

* ``_start_workers``: every rank runs inside trainer/agent/child.py (dies with the agent, dumps
  stacks on SIGUSR1) with a flight-record slot (trainer/agent/flight.py), in a process context
  that watches each rank on its own and, with ``preload``, forks the ranks from a server that
  imported those modules once (trainer/agent/pcontext.py);
* ``_monitor_workers`` (called every ``--monitor-interval``): heartbeats on the bus for each live,
  running rank; the flight records shared through the rendezvous store so every agent judges the
  whole world, and a hang report (trainer/agent/hang.py) from the agent that owns the culprit;
  with ``on_hang="restart"`` it then kills the culprit, which torch's restart path takes over;
* the restart path: each phase's time since the failure was detected (trainer/agent/recovery_log.py),
  logged as one JSON line per phase and kept for ``resihp bench agent``;
* with ``on_failure="shrink"``, in-job recovery instead of a restart: a rank that exits with an
  error leaves torch's watch (so torch does not stop its peers), is marked lost in the
  ranks' bootstrap store, and its peers re-form the world without it (trainer/agent/shrink.py);
  the phases the new world's rank 0 reports are logged and published as ``telemetry.recovery``;
  every agent watches every other (trainer/agent/presence.py), and a survivor marks a dead agent's
  ranks lost and offers its place to a replacement (trainer/agent/vacancy.py);
* node commands from the bus (trainer/agent/commands.py), read in the monitor loop
  (trainer/agent/node_stop.py): ``stop`` stops
  this node's ranks (SIGTERM, SIGKILL after ``stop_grace_s``) and ends the agent as a death looks
  to its peers, so under ``--on-failure shrink`` they go on without the node and offer its place;
* a job's own controller (``AgentSettings.controller``, the reference trainer's in
  trainer/reference/launcher.py), called every monitor pass with the ranks that exited: a rank that dies
  leaves torch's watch and is the controller's to handle, not restarted by torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import timedelta
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from collector.auth import Refusals
from collector.events import HangReported, Heartbeat
from trainer.agent.commands import NodeCommands
from trainer.agent.etcd_client import EtcdClient
from trainer.agent.etcd_store import open_store_address, ranks_store_address
from trainer.agent.node_stop import StopOrders
from trainer.agent.recovery_log import RecoveryTimeline, publish_shrink_recoveries
from trainer.agent.child import AGENT_PID_ENV, STACK_DIR_ENV, stack_file_path
from trainer.agent.pcontext import RankWatch, agent_contexts
from trainer.agent.flight import FLIGHT_DIR_ENV, LOST, FlightEntry, flight_file_path, read_flight
from trainer.agent.predicted import PredictedIteration
from trainer.agent.presence import AgentPresence, PeerAgent
from trainer.agent.shrink import STORE_SCOPE_ENV, admitted_key, is_lost, mark_lost
from trainer.agent.shrink_executor import ShrinkExecutor
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.agent.store import AgentError, forget_bootstrap_store
from trainer.agent.vacancy import (Vacancy, VacancyRendezvous, check_in_for_dead_agent, publish_vacancy,
                                  rendezvous_round, round_store_prefix)
from trainer.agent.hang import HangPolicy, HangReport, collect_stacks, judge_hang, process_state
from trainer.telemetry import TelemetryPublisher

log = logging.getLogger("resihp.agent")
FLIGHT_KEY = "resihp/flight/{rank}"  # in the round's own (prefixed) store
RANKS_STORE_ENV = "RESIHP_RANKS_STORE"  # the agent tells its ranks where they meet (etcd)


@dataclass
class AgentSettings:
    job: str
    node_label: str
    work_dir: Path
    hang: HangPolicy = field(default_factory=HangPolicy)
    on_hang: str = "report"  # or "restart": kill the culprit and let the restart path recover
    on_failure: str = "restart"  # or "shrink": survivors keep running (trainer/agent/shrink.py)
    heartbeat_s: float = 1.0
    share_s: float = 0.25  # how often flight records go to the store
    telemetry: TelemetryPublisher | None = None
    predicted: PredictedIteration | None = None  # the cost model's iteration time, from the bus
    node_address: str | None = None  # where this node is reached (the other agents connect to it)
    job_store: dist.Store | None = None  # the rendezvous store itself (not a round's): vacancies go there
    hosts_rendezvous: bool = False  # this agent serves the job's rendezvous store: stopping it ends the job
    etcd: EtcdClient | None = None  # the job's stores are on etcd (--rdzv-backend etcd): no agent serves one
    commands: NodeCommands | None = None  # node commands from the bus (None: none are read)
    stop_grace_s: float = 5.0  # a stopped node's ranks get SIGTERM, then SIGKILL after this
    drain_s: float = 60.0  # under shrink, a stop first waits this long for the ranks to leave at a step boundary
    preload: tuple[str, ...] = ()  # fork the ranks from a server that imported these (trainer/agent/pcontext.py)
    controller: JobController | None = None  # the job's own death policy; torch restarts nothing
    relayout: Relayout | None = None  # the job restarts at a new layout on command (trainer/agent/relayout.py)
    shrink_executor: ShrinkExecutor | None = None  # a shrinking world's layout and node plans (shrink_executor.py)
    rank_env: dict[str, str] = field(default_factory=dict)  # what the ranks need to reach the agent's bus


class JobController(Protocol):
    """What a job adds to its agent's monitor loop (the reference trainer's: trainer/reference/launcher.py).

    With a controller, a rank that exits with an error leaves torch's watch and is the
    controller's to handle; torch neither stops its peers nor restarts the group."""

    def watch(self, exits: dict[int, int]) -> None:
        """One monitor pass; ``exits`` maps every rank that has exited so far to its exit code."""


class Relayout(Protocol):
    """A job the agent restarts at a new layout on command (trainer/agent/relayout.py; torchtitan's
    in trainer/torchtitan/controller.py)."""

    left_out: bool  # the new layout runs no rank on this node: its agent leaves the job

    def worker_env(self) -> dict[str, str]:
        """Environment of the ranks started next."""

    def identity(self, rank: int) -> tuple[int, int]:
        """(device id, plan epoch) of world rank ``rank`` now: what its heartbeats say."""

    def start_round(self, group_rank: int, group_world: int, ranks: Sequence[int], world: int,
                    records: SignedStore, job_records: SignedStore | None = None,
                    round_number: int = 0) -> Callable[[Sequence[str]], list[str]] | None:
        """A new rendezvous round, before this node's ranks (world ranks ``ranks``) start in a world
        of ``world``: the edit of their command line, when the round needs one. ``job_records``:
        the job's store (it outlives rounds); ``round_number``: the rendezvous round's."""

    def watch(self, records: SignedStore, all_exited_ok: bool, failed: Sequence[int] | None,
              relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """One monitor pass; True when it restarted the worker group through ``relaunch``.
        ``failed``: None while no rank failed, else the world ranks whose failure ended the group
        (:meth:`RankWatch.culprits`; empty when the group is unhealthy with no rank to name)."""

    def restart_for_order(self, records: SignedStore,
                          relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """torch restarts the group (another node joined a new round): True when the relayout
        started this node's share of a new layout through ``relaunch`` instead."""

    def make_room(self, records: SignedStore) -> bool:
        """torch would restart a healthy group because a node waits to join: True while the
        relayout has the ranks stop at a step boundary first (it restarts them after, in
        :meth:`watch`); False leaves the restart to torch."""


class NodeAgent(LocalElasticAgent):
    def __init__(self, spec: Any, logs_specs: Any, settings: AgentSettings, **kwargs: Any) -> None:
        super().__init__(spec, logs_specs, **kwargs)
        self.settings = settings
        self.flight_dir = settings.work_dir / "flight"
        self.stack_dir = settings.work_dir / "stacks"
        self.flight_dir.mkdir(parents=True, exist_ok=True)
        self.stack_dir.mkdir(parents=True, exist_ok=True)
        self.hang_reports: list[HangReport] = []
        self.timelines: list[RecoveryTimeline] = []
        self._reported: set[tuple[int, int]] = set()  # (restart, iteration) already reported
        self._next_beat = 0.0
        self._next_share = 0.0
        self._next_commands = 0.0
        self._pending: RecoveryTimeline | None = None
        self.lost: dict[int, int] = {}  # global rank → exit code, this round (shrink)
        self.benched: set[int] = set()  # ranks a hang report named, marked lost while alive (shrink)
        self.recoveries: list[dict] = []  # the in-job recoveries this node's rank 0 reported (shrink)
        self.peer_lost: set[int] = set()  # ranks of dead agents that this agent marked lost (shrink)
        self.joining: set[int] = set()  # this replacement's ranks not yet admitted: not judged (--join-running)
        self.admitted_at: dict[int, float] = {}  # wall time each rank was admitted (joined or rejoined) this round
        self.presence: AgentPresence | None = None  # the other agents' liveness (shrink)
        self._ranks_store: SignedStore | None = None
        self._refused = Refusals()  # store records this agent refused: each reported once
        self._last_round_store: Any = None
        self._last_state = WorkerState.INIT  # what the last monitor pass found
        self._stop_orders = (StopOrders(settings.commands, settings.hosts_rendezvous, settings.stop_grace_s,
                                        serves_ranks_store=settings.etcd is None,
                                        drain_s=settings.drain_s if settings.on_failure == "shrink" else 0.0)
                             if settings.commands is not None else None)

    # ---- starting ranks ----------------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        for stale in [*self.flight_dir.glob("*.flight"), *self.flight_dir.glob("recovery-*.json"),
                      *self.stack_dir.glob("*.stacks")]:
            stale.unlink()
        self.lost, self.benched, self.peer_lost, self._ranks_store = {}, set(), set(), None
        self.admitted_at = {}
        if isinstance(worker_group.spec.rdzv_handler, VacancyRendezvous):
            self.joining = {w.global_rank for w in worker_group.workers}
        if self.presence is not None:  # a new round: the old one's peers are restarting, not dying
            self.presence.close(finished=True)
            self.presence = None
        if self.settings.on_failure == "shrink" and worker_group.store is not None:
            ranks = tuple(w.global_rank for w in worker_group.workers)
            self.presence = AgentPresence(self._round_records(worker_group), worker_group.group_rank or 0,
                                          worker_group.group_world_size or 1, ranks, self.settings.node_address)
        env = {FLIGHT_DIR_ENV: str(self.flight_dir), STACK_DIR_ENV: str(self.stack_dir),
               AGENT_PID_ENV: str(os.getpid()), "RESIHP_ON_FAILURE": self.settings.on_failure,
               STORE_SCOPE_ENV: self._round_scope(worker_group), "RESIHP_JOB": self.settings.job,
               **self.settings.rank_env}
        if self.settings.etcd is not None:  # the ranks meet on etcd, not in node 0's agent
            env[RANKS_STORE_ENV] = self._ranks_store_address(worker_group)
        if self.settings.relayout is not None:
            workers = worker_group.workers
            handler = worker_group.spec.rdzv_handler
            edit = self.settings.relayout.start_round(
                worker_group.group_rank or 0, worker_group.group_world_size or 1, [w.global_rank for w in workers],
                workers[0].world_size if workers else 0, self._store_of_ranks(worker_group),
                job_records=(self._signed(self.settings.job_store, handler.get_run_id())
                             if self.settings.job_store is not None else None),
                round_number=rendezvous_round(handler))
            if edit is not None:
                worker_group.spec.args = tuple(edit(list(worker_group.spec.args)))
            env.update(self.settings.relayout.worker_env())
        release_failed = self.settings.on_failure == "shrink" or self.settings.controller is not None
        with agent_contexts(preload=self.settings.preload, release_failed=release_failed, extra_env=env):
            pids = super()._start_workers(worker_group)
        if self._pending is not None:
            self._pending.mark("ranks started")
        return pids

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # the last round's store lives one round more: other nodes may still read their stop there
        self._last_round_store = forget_bootstrap_store(worker_group.spec.rdzv_handler)
        super()._rendezvous(worker_group)
        if self.settings.commands is not None:  # what a node command names: this node, in this round
            print(f"resihp run: node {worker_group.group_rank} of {worker_group.group_world_size} with ranks "
                  f"{[w.global_rank for w in worker_group.workers]} in rendezvous round "
                  f"{rendezvous_round(worker_group.spec.rdzv_handler)}", file=sys.stderr, flush=True)
        if self._pending is not None:
            self._pending.mark("new world")

    def _exit_barrier(self) -> None:
        """torch's wait for every agent to finish, but for a node the job left: the others train on."""
        if self.settings.relayout is not None and self.settings.relayout.left_out:
            return
        super()._exit_barrier()

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        relayout = self.settings.relayout
        if relayout is not None and worker_group.master_addr is not None:
            records = self._store_of_ranks(worker_group)
            if relayout.restart_for_order(records, lambda world, edit: self.relaunch(worker_group, world, edit)):
                return
            # torch restarts a healthy group only because a node waits to join the rendezvous
            if self._last_state == WorkerState.HEALTHY and relayout.make_room(records):
                return
        self._pending = RecoveryTimeline(time.monotonic(), self._restart_count() + 1)
        self._pending.mark("detected")
        super()._restart_workers(worker_group)

    def relaunch(self, worker_group: WorkerGroup, local_world_size: int,
                 edit_args: Callable[[Sequence[str]], list[str]]) -> None:
        """Start this node's ranks again, ``local_world_size`` of them with the arguments ``edit_args``
        makes of the current ones: a restart at a new layout, not a failure (no restart is spent)."""
        spec = worker_group.spec
        spec.local_world_size = local_world_size
        spec.args = tuple(edit_args(list(spec.args)))
        self._ranks_store = None
        LocalElasticAgent._restart_workers(self, worker_group)

    def _restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    # ---- watching ranks ----------------------------------------------------------------------

    def watched_ranks(self) -> RankWatch:
        """This round's ranks (trainer/agent/pcontext.py); an error before the first start."""
        if not isinstance(self._pcontext, RankWatch):
            raise RuntimeError("the agent has started no ranks yet")
        return self._pcontext

    def exits(self) -> dict[int, int]:
        """Every rank of this round that has exited so far (global rank) and its exit code."""
        workers = self._worker_group.workers
        return {workers[lr].global_rank: code for lr, code in self.watched_ranks().exit_codes().items()}

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._watch_workers(worker_group)
        self._last_state = result.state  # torch's restart after a healthy pass is a membership change
        return result

    def _watch_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.settings.on_failure == "shrink":
            self._admit_returned(worker_group)
            self._release_dead_agents(worker_group)
            self.recoveries += publish_shrink_recoveries(self.flight_dir, self.settings.telemetry)
        result = super()._monitor_workers(worker_group)
        if self.settings.relayout is not None and self._pcontext is not None and worker_group.master_addr is not None:
            failed = None
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                failed = [worker_group.workers[lr].global_rank for lr in self.watched_ranks().culprits()]
            restarted = self.settings.relayout.watch(
                self._store_of_ranks(worker_group), result.state == WorkerState.SUCCEEDED, failed,
                lambda world, edit: self.relaunch(worker_group, world, edit))
            if self.settings.relayout.left_out:  # done here; the job goes on on the other nodes
                return RunResult(state=WorkerState.SUCCEEDED,
                                 return_values={w.global_rank: None for w in worker_group.workers})
            if restarted:
                return RunResult(state=WorkerState.HEALTHY)
        if self._pcontext is not None:
            released = self.watched_ranks().take_released()
            if self.settings.on_failure == "shrink":
                self._mark_lost(worker_group, released)
            if self.settings.controller is not None:
                self.settings.controller.watch(self.exits())
        if result.state != WorkerState.HEALTHY or self._pcontext is None:
            return result
        local = {w.local_rank: w.global_rank for w in worker_group.workers}
        out = set(self.lost) | self.benched | self.joining
        pids = {lr: pid for lr, pid in self._pcontext.pids().items() if local[lr] not in out}
        entries = {local[lr]: self._since_admission(dataclasses.replace(e, stopped=process_state(pids[lr]) == "T"))
                   for lr in pids
                   if (e := read_flight(flight_file_path(str(self.flight_dir), lr))) and e.restart == self._restart_count()}
        now = time.monotonic()
        if self._pending is not None and entries and min(e.iteration for e in entries.values()) >= 0 and all(
                e.op != "start" for e in entries.values()):
            self._pending.mark("first step")
            self.timelines.append(self._pending)
            self._pending = None
        if now >= self._next_beat:
            self._next_beat = now + self.settings.heartbeat_s
            self._heartbeat(pids, local, entries)
        if self.settings.shrink_executor is not None and now >= self._next_commands:
            self.settings.shrink_executor.watch(self._store_of_ranks(worker_group),
                                                {w.global_rank for w in worker_group.workers})
        if self._stop_orders is not None and now >= self._next_commands:
            self._next_commands = now + self.settings.share_s
            self._stop_orders.obey(worker_group, self.watched_ranks(),
                                   self._store_of_ranks(worker_group) if self.settings.on_failure == "shrink" else None)
        if now >= self._next_share:
            self._next_share = now + self.settings.share_s
            world = self._share_flight(worker_group, entries)
            predicted_s = self.settings.predicted.poll() if self.settings.predicted is not None else None
            report = judge_hang(world, self.settings.hang, predicted_s=predicted_s)
            if report is not None and set(report.culprits) & set(entries) and \
                    (self._restart_count(), report.iteration) not in self._reported:
                self._on_hang(report, pids, local, worker_group)
        return result

    # ---- in-job recovery (on_failure="shrink") ----------------------------------------------------

    def _admit_returned(self, worker_group: WorkerGroup) -> None:
        """Forget the benched, peer-lost and joining ranks the world has admitted again."""
        for rank in sorted(self.benched | self.peer_lost | self.joining):
            if self._store_of_ranks(worker_group).valid(admitted_key(rank), RANK_WRITERS):
                self.benched.discard(rank)
                self.peer_lost.discard(rank)
                joined = rank in self.joining
                self.joining.discard(rank)
                self.admitted_at[rank] = time.time()
                print(f"resihp run: rank {rank} {'joined' if joined else 'rejoined'} the world", file=sys.stderr,
                      flush=True)

    def _since_admission(self, entry: FlightEntry) -> FlightEntry:
        """A rank the world admitted (a replacement's, or a benched one back) is judged from its
        admission, not from when it began to wait for it: waiting for a step boundary of the world
        is not a hang, and the deadline of the step it is in starts when the world takes it."""
        at = self.admitted_at.get(entry.rank)
        if at is None or entry.step_started_s >= at:
            return entry
        return dataclasses.replace(entry, step_started_s=at)

    def _mark_lost(self, worker_group: WorkerGroup, released: dict[int, ProcessFailure]) -> None:
        """Mark each rank that failed and left the watch lost where its peers look for it.

        The watch (trainer/agent/pcontext.py) released it, so torch neither stops its peers nor
        restarts the group. If every local rank is lost, nothing is watched any more and the node
        is done (``run_agent`` says so)."""
        for lr, failure in sorted(released.items()):
            rank, code = worker_group.workers[lr].global_rank, failure.exitcode
            self.lost[rank] = code
            mark_lost(self._store_of_ranks(worker_group), rank, code)
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(f"resihp run: rank {rank} (local {lr}, pid {failure.pid}) {how}; its peers go on "
                  "without it (--on-failure shrink)", file=sys.stderr, flush=True)

    def _release_dead_agents(self, worker_group: WorkerGroup) -> None:
        """An agent that died took its ranks with it (trainer/agent/child.py) and cannot mark them
        lost: one surviving agent does it for it (the first to claim the dead agent), checks in at
        torch's exit barrier on its behalf and offers its place to a replacement
        (trainer/agent/vacancy.py)."""
        if self.presence is None:
            return
        for peer in self.presence.poll():
            self._release_peer(worker_group, peer)

    def _release_peer(self, worker_group: WorkerGroup, peer: PeerAgent) -> None:
        if peer.group_rank == 0 and self.settings.etcd is None:  # it served the ranks' store (c10d)
            raise AgentError(f"the agent of node 0 is gone with its ranks {list(peer.ranks)}; it hosted the store "
                             "the ranks meet in, and the job cannot go on without it; this node's ranks were stopped")
        ranks_store = self._store_of_ranks(worker_group)
        if ranks_store.store.add(f"resihp/agent-gone/{peer.token}", 1) != 1:
            return  # another survivor took care of it
        marked = [r for r in peer.ranks if not is_lost(ranks_store, r)]
        for rank in marked:
            mark_lost(ranks_store, rank, None)  # no exit code: it died with its agent
        self.peer_lost.update(peer.ranks)  # their flight records are closed, so nobody judges them hung
        if self._store is not None:
            check_in_for_dead_agent(self._store, worker_group.group_world_size or 1)
        if self.settings.job_store is not None and worker_group.master_addr and worker_group.master_port:
            job_records = self._signed(self.settings.job_store, worker_group.spec.rdzv_handler.get_run_id())
            publish_vacancy(job_records, Vacancy(
                peer.group_rank, worker_group.group_world_size or 1, peer.ranks,
                round_store_prefix(worker_group.spec.rdzv_handler), worker_group.master_addr, worker_group.master_port))
        how = (f"ranks {marked} marked lost, the others go on without them" if marked else
               "they had left the world already (a drained node stop)")
        print(f"resihp run: the agent of node {peer.group_rank} is gone with its ranks {list(peer.ranks)}; {how} "
              "until an agent takes its place (--join-running; --on-failure shrink)", file=sys.stderr, flush=True)

    def _ranks_store_address(self, worker_group: WorkerGroup) -> str:
        """Where this round's ranks meet on etcd (``RESIHP_RANKS_STORE``, trainer/agent/etcd_store.py)."""
        assert self.settings.etcd is not None
        return ranks_store_address(self.settings.etcd, worker_group.spec.rdzv_handler.get_run_id(),
                                   self._round_scope(worker_group))

    def _store_of_ranks(self, worker_group: WorkerGroup) -> SignedStore:
        """The ranks' store (this round's keys on etcd, else the bootstrap store at
        MASTER_ADDR/MASTER_PORT), where they meet; its records signed for the round, as the ranks
        sign theirs (trainer/agent/shrink.py)."""
        if self._ranks_store is None and self.settings.etcd is not None:
            self._ranks_store = self._signed(open_store_address(self._ranks_store_address(worker_group), 30.0),
                                             self._round_scope(worker_group))
        if self._ranks_store is None:
            if worker_group.master_addr is None or worker_group.master_port is None:
                raise RuntimeError("the ranks' bootstrap store is not known before the first rendezvous")
            self._ranks_store = self._signed(dist.TCPStore(
                worker_group.master_addr, worker_group.master_port, is_master=False, timeout=timedelta(seconds=30)),
                self._round_scope(worker_group))
        return self._ranks_store

    def _round_scope(self, worker_group: WorkerGroup) -> str:
        """What this round's records are signed for: the round's store prefix (run id and round)."""
        return round_store_prefix(worker_group.spec.rdzv_handler)

    def _round_records(self, worker_group: WorkerGroup) -> SignedStore:
        """The round's store (registrations, flight records), signed for the round."""
        assert worker_group.store is not None
        return self._signed(worker_group.store, self._round_scope(worker_group))

    def _signed(self, store: dist.Store, scope: str) -> SignedStore:
        """``store``'s signed records for ``scope``; refusals are logged and published
        (``control.rejected``) on the agent's telemetry."""
        telemetry = self.settings.telemetry
        records = SignedStore(store, scope, reader=f"agent-{socket.gethostname()}-{os.getpid()}",
                              report=telemetry.publish if telemetry is not None else None)
        records.refused = self._refused
        return records

    def _heartbeat(self, pids: dict[int, int], local: dict[int, int], entries: dict[int, FlightEntry]) -> None:
        telemetry = self.settings.telemetry
        if telemetry is None:
            return
        for lr, pid in pids.items():
            if process_state(pid) in ("T", "Z", "?"):
                continue  # stopped or gone: no heartbeat, which is how a consumer notices
            rank = local[lr]
            entry = entries.get(rank)
            device, epoch = (self.settings.relayout.identity(rank) if self.settings.relayout is not None
                             else (rank, self._restart_count()))
            telemetry.publish(Heartbeat(rank=device, epoch=epoch,
                                        iteration=max(0, entry.iteration) if entry else 0,
                                        interval_s=self.settings.heartbeat_s))

    def _share_flight(self, worker_group: WorkerGroup, entries: dict[int, FlightEntry]) -> dict[int, FlightEntry]:
        """Publish this node's flight records to the rendezvous store and read every rank's."""
        if worker_group.store is None or not worker_group.workers:
            return entries
        store = self._round_records(worker_group)
        for rank, e in entries.items():
            store.set(FLIGHT_KEY.format(rank=rank), e.__dict__)
        for rank in set(self.lost) | self.benched | self.peer_lost:  # a lost rank's record is closed, so nobody judges it hung
            gone = FlightEntry(rank=rank, pid=0, restart=self._restart_count(), iteration=-1, step_started_s=0.0,
                               op=LOST, op_entered_s=0.0, seq=0)
            store.set(FLIGHT_KEY.format(rank=rank), gone.__dict__)
        world = worker_group.workers[0].world_size
        keys = [FLIGHT_KEY.format(rank=r) for r in range(world)]
        if not store.store.check(keys):
            return entries  # some rank has not written yet: judge nothing across nodes
        read = store.read_many(keys, _flight_entry)
        if any(e is None for e in read):
            return entries  # a record was refused (reported): a forged record must not name a culprit
        everyone = {r: e for r, e in enumerate(read) if e is not None}
        everyone.update(entries)
        return everyone

    def _on_hang(self, report: HangReport, pids: dict[int, int], local: dict[int, int],
                 worker_group: WorkerGroup) -> None:
        self._reported.add((self._restart_count(), report.iteration))
        by_rank = {local[lr]: pid for lr, pid in pids.items()}
        files = {local[lr]: stack_file_path(str(self.stack_dir), lr) for lr in pids}
        stacks = collect_stacks(by_rank, files)
        report = HangReport(**{**report.__dict__, "stacks": stacks})
        self.hang_reports.append(report)
        path = self.settings.work_dir / f"hang-r{self._restart_count()}-i{report.iteration}.json"
        path.write_text(json.dumps(report.__dict__, indent=1, default=str))
        print(f"resihp run: {report.summary()}; stacks in {path}", file=sys.stderr, flush=True)
        if self.settings.telemetry is not None:  # the agent's finding; the analytics consumer opens the incident
            device = (lambda r: self.settings.relayout.identity(r)[0]) if self.settings.relayout is not None \
                else (lambda r: r)
            culprits = set(report.culprits)
            self.settings.telemetry.publish(HangReported(
                iteration=max(0, report.iteration), ranks=sorted({device(r) for r in culprits}),
                waiting=sorted({device(r) for r in report.ops if r not in culprits}), op=report.op[:200],
                stuck_for_s=min(report.stuck_for_s, 1e6), deadline_s=min(report.deadline_s, 1e6),
                summary=report.summary()[:2000],
                stacks="\n".join(f"--- rank {r}\n{stacks.get(r, '')}" for r in sorted(culprits))[-16000:]))
        if self.settings.on_hang == "restart":
            for rank in report.culprits:
                if rank in by_rank:
                    os.kill(by_rank[rank], signal.SIGKILL)
        elif self.settings.on_failure == "shrink" and set(report.culprits) < set(report.ops):
            # Some ranks wait for the culprits: the world goes on without them, and takes them back
            # when they run again (a SIGCONT, a stall that ends; trainer/agent/shrink.py).
            for rank in set(report.culprits) & set(by_rank):
                mark_lost(self._store_of_ranks(worker_group), rank, 0)
                self.benched.add(rank)
                print(f"resihp run: rank {rank} benched: its peers go on without it and take it back when it "
                      "runs again (--on-failure shrink)", file=sys.stderr, flush=True)


def _flight_entry(body: Any) -> FlightEntry:
    """A rank's flight record as its agent shared it (signed, trainer/agent/signed_store.py)."""
    return FlightEntry(**{**body, "recent_step_s": tuple(body.get("recent_step_s", ()))})
