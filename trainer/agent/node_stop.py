"""A running node's ``stop`` orders: which are its to obey, why one is refused, and the stop itself.

The orders come verified from the bus (trainer/agent/commands.py's :class:`NodeCommands`, which
also fences them by round and id); what this module adds is what only the running node knows: the
nodes of its round, whether it hosts the job's stores, and its ranks' processes. A stop ends the
agent (:class:`NodeStopped`) as a death looks to its peers, so under ``--on-failure shrink`` they go
on without the node and offer its place (trainer/agent/presence.py, trainer/agent/vacancy.py).

Under ``--on-failure shrink`` a stop first **drains**: the agent asks the world to let its ranks go
at the next step boundary (trainer/agent/shrink.py's ``drain``), so every rank finishes the step it
is in, the node's ranks leave after it and exit 0, and the others go on from that step: no work is
lost and nothing is redone. A drain is bounded by ``drain_s``; a rank still running after it (a
hung step, a job that does not support the drain) is stopped as before: SIGTERM, then SIGKILL
after ``stop_grace_s``, and its peers recover from the failed step (the fail-stop path).
"""

from __future__ import annotations

import signal
import sys
import time

from torch.distributed.elastic.agent.server.api import WorkerGroup

from collector.events import AckStatus, NodeCommand
from trainer.agent.commands import NodeCommands
from trainer.agent.pcontext import RankWatch
from trainer.agent.shrink import drain, mark_lost
from trainer.agent.signed_store import SignedStore
from trainer.agent.vacancy import rendezvous_round


class NodeStopped(Exception):
    """This node obeyed a ``stop`` command: its ranks are stopped and the agent ends (run_agent)."""

    def __init__(self, command: NodeCommand, detail: str) -> None:
        super().__init__(detail)
        self.command, self.detail = command, detail


class StopOrders:
    """The stop orders of one node agent, read on each monitor pass (:meth:`obey`)."""

    def __init__(self, commands: NodeCommands, hosts_rendezvous: bool, stop_grace_s: float, *,
                 serves_ranks_store: bool = True, drain_s: float = 0.0) -> None:
        """``serves_ranks_store``: node 0 serves its round's ranks' store (the c10d rendezvous; not
        when the job's stores are on etcd). ``drain_s``: how long a stop waits for the node's ranks
        to leave at a step boundary (0: no drain)."""
        self.commands, self.hosts_rendezvous, self.stop_grace_s = commands, hosts_rendezvous, stop_grace_s
        self.serves_ranks_store, self.drain_s = serves_ranks_store, drain_s

    def obey(self, worker_group: WorkerGroup, watch: RankWatch, ranks_store: SignedStore | None = None) -> None:
        """Read the stop orders addressed to this node (node 0 also answers for nodes the round does
        not have), acknowledge those it will not obey, and obey the rest (raises
        :class:`NodeStopped`). A ``join`` is a spare's to answer (trainer/agent/commands.py's
        ``JoinOrders``), not a running node's. ``ranks_store``: where the ranks meet (under
        ``--on-failure shrink``): a stop drains through it."""
        commands = self.commands
        node, nodes = worker_group.group_rank or 0, worker_group.group_world_size or 1
        round_ = rendezvous_round(worker_group.spec.rdzv_handler)

        def addressed(c: NodeCommand) -> bool:
            return c.action == "stop" and (c.node == node or (node == 0 and c.node >= nodes))

        for command in commands.read(addressed):
            status, detail = commands.judge(command, round_)
            refusal = self.refusal(command, node, nodes) if status is None else ""
            if refusal:
                status, detail = AckStatus.FAILED, refusal
            if status is not None:
                commands.ack(command, round_, status, detail)
                continue
            self.stop(worker_group, watch, command, round_, ranks_store if nodes > 1 else None)

    def refusal(self, command: NodeCommand, node: int, nodes: int) -> str:
        """Why this running node cannot obey a command that passed the fence ("" : it can)."""
        if command.node >= nodes:
            return f"the job has no node {command.node} in this round: its nodes are 0–{nodes - 1}"
        if nodes > 1 and (self.hosts_rendezvous or (node == 0 and self.serves_ranks_store)):
            return (f"node {node} hosts the job's rendezvous and its ranks' store, so stopping it would end the job; "
                    "stop another node, or stop the job (SIGTERM to every agent)")
        return ""

    def stop(self, worker_group: WorkerGroup, watch: RankWatch, command: NodeCommand, round_: int,
             ranks_store: SignedStore | None = None) -> None:
        """Drain this node's ranks through ``ranks_store`` (when given and ``drain_s`` > 0), SIGTERM
        every rank still running (its process group), SIGKILL what is left after the grace,
        acknowledge, and end the agent (:class:`NodeStopped`): its peers see it go as a death and,
        under ``--on-failure shrink``, go on without its ranks (presence.py)."""
        ranks = [w.global_rank for w in worker_group.workers]
        grace = self.stop_grace_s
        running = [lr for lr in range(len(worker_group.workers)) if watch.exit_code(lr) is None]
        drained: list[int] = []
        if ranks_store is not None and self.drain_s > 0 and running:
            drained = self.drain(worker_group, watch, command, ranks_store, running)
            running = [lr for lr in running if watch.exit_code(lr) is None]
        if running:
            print(f"resihp run: node {worker_group.group_rank} stops its ranks "
                  f"{[worker_group.workers[lr].global_rank for lr in running]} on command {command.command_id}"
                  f"{f' ({command.reason})' if command.reason else ''}: SIGTERM, SIGKILL after {grace:g} s",
                  file=sys.stderr, flush=True)
        for lr in running:
            watch.signal_rank(lr, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(watch.exit_code(lr) is None for lr in running):
            time.sleep(0.05)
        killed = sorted(worker_group.workers[lr].global_rank for lr in running if watch.exit_code(lr) is None)
        for lr in running:
            if watch.exit_code(lr) is None:
                watch.signal_rank(lr, signal.SIGKILL)
        while any(watch.exit_code(lr) is None for lr in running):
            time.sleep(0.05)
        termed = sorted(set(worker_group.workers[lr].global_rank for lr in running) - set(killed))
        detail = f"node {worker_group.group_rank} stopped its ranks {ranks}"
        detail += f"; {drained} left the world at a step boundary" if drained else ""
        detail += f"; {termed} exited on SIGTERM" if termed else ""
        detail += f"; {killed} were SIGKILLed after {grace:g} s" if killed else ""
        self.commands.ack(command, round_, AckStatus.APPLIED, detail, ranks)
        raise NodeStopped(command, detail)

    def drain(self, worker_group: WorkerGroup, watch: RankWatch, command: NodeCommand, ranks_store: SignedStore,
              running: list[int]) -> list[int]:
        """Ask the world to let this node's running ranks go at its next step boundary and wait up to
        ``drain_s`` for them to leave (exit 0); returns the ranks that did. Each is then marked lost
        without waking the world (it is no longer in it), so its place is open to a replacement."""
        ranks = [worker_group.workers[lr].global_rank for lr in running]
        print(f"resihp run: node {worker_group.group_rank} drains its ranks {ranks} on command {command.command_id}"
              f"{f' ({command.reason})' if command.reason else ''}: they leave after the step they are in "
              f"(up to {self.drain_s:g} s, then SIGTERM)", file=sys.stderr, flush=True)
        drain(ranks_store, ranks)
        deadline = time.monotonic() + self.drain_s
        while time.monotonic() < deadline and any(watch.exit_code(lr) is None for lr in running):
            time.sleep(0.05)
        left = [lr for lr in running if watch.exit_code(lr) == 0]
        for lr in left:
            mark_lost(ranks_store, worker_group.workers[lr].global_rank, 0, wake=False)
        return sorted(worker_group.workers[lr].global_rank for lr in left)
