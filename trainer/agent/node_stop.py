"""A running node's ``stop`` orders: which are its to obey, why one is refused, and the stop itself.

The orders come verified from the bus (trainer/agent/commands.py's :class:`NodeCommands`, which
also fences them by round and id); what this module adds is what only the running node knows: the
nodes of its round, whether it hosts the job's stores, and its ranks' processes. A stop ends the
agent (:class:`NodeStopped`) as a death looks to its peers, so under ``--on-failure shrink`` they go
on without the node and offer its place (trainer/agent/presence.py, trainer/agent/vacancy.py).
"""

from __future__ import annotations

import signal
import sys
import time

from torch.distributed.elastic.agent.server.api import WorkerGroup

from collector.events import AckStatus, NodeCommand
from trainer.agent.commands import NodeCommands
from trainer.agent.pcontext import RankWatch
from trainer.agent.vacancy import rendezvous_round


class NodeStopped(Exception):
    """This node obeyed a ``stop`` command: its ranks are stopped and the agent ends (run_agent)."""

    def __init__(self, command: NodeCommand, detail: str) -> None:
        super().__init__(detail)
        self.command, self.detail = command, detail


class StopOrders:
    """The stop orders of one node agent, read on each monitor pass (:meth:`obey`)."""

    def __init__(self, commands: NodeCommands, hosts_rendezvous: bool, stop_grace_s: float) -> None:
        self.commands, self.hosts_rendezvous, self.stop_grace_s = commands, hosts_rendezvous, stop_grace_s

    def obey(self, worker_group: WorkerGroup, watch: RankWatch) -> None:
        """Read the stop orders addressed to this node (node 0 also answers for nodes the round does
        not have), acknowledge those it will not obey, and obey the rest (raises
        :class:`NodeStopped`). A ``join`` is a spare's to answer (trainer/agent/commands.py's
        ``JoinOrders``), not a running node's."""
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
            self.stop(worker_group, watch, command, round_)

    def refusal(self, command: NodeCommand, node: int, nodes: int) -> str:
        """Why this running node cannot obey a command that passed the fence ("" : it can)."""
        if command.node >= nodes:
            return f"the job has no node {command.node} in this round: its nodes are 0–{nodes - 1}"
        if nodes > 1 and (node == 0 or self.hosts_rendezvous):
            return (f"node {node} hosts the job's rendezvous and its ranks' store, so stopping it would end the job; "
                    "stop another node, or stop the job (SIGTERM to every agent)")
        return ""

    def stop(self, worker_group: WorkerGroup, watch: RankWatch, command: NodeCommand, round_: int) -> None:
        """SIGTERM every rank of this node (its process group), SIGKILL what is left after the
        grace, acknowledge, and end the agent (:class:`NodeStopped`): its peers see it go as a
        death and, under ``--on-failure shrink``, go on without its ranks (presence.py)."""
        ranks = [w.global_rank for w in worker_group.workers]
        grace = self.stop_grace_s
        print(f"resihp run: node {worker_group.group_rank} stops its ranks {ranks} on command {command.command_id}"
              f"{f' ({command.reason})' if command.reason else ''}: SIGTERM, SIGKILL after {grace:g} s",
              file=sys.stderr, flush=True)
        running = [lr for lr in range(len(worker_group.workers)) if watch.exit_code(lr) is None]
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
        detail += f"; {termed} exited on SIGTERM" if termed else ""
        detail += f"; {killed} were SIGKILLed after {grace:g} s" if killed else ""
        self.commands.ack(command, round_, AckStatus.APPLIED, detail, ranks)
        raise NodeStopped(command, detail)
