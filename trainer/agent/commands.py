"""Node commands from the bus: the orders one node agent obeys (``command.node``), and its answers.

Who may order a node: the remediation engine or a signed-in operator (collector/auth.py signs and
verifies ``command.node``), and only from the commands topic (collector/topics.py's
``obeyed_from``). The agent reads this job's node commands from the log's end at its start (an
order older than the agent was not meant for it) and verifies only the ones addressed to it, so
one forgery is reported once, by the agent it names, as a ``control.rejected``. A verified command
must name this job's run (the rendezvous id, ``--rdzv-id``, as collector/epoch_fence.py's ``run_of``
gives it) and not be past its expiry on the host's clock, else it is refused and reported like a
forgery (a signed order of another run, or one kept and republished, is history); it
is then fenced by the job's rendezvous round (collector/epoch_fence.py's ``node_fence_verdict``: node
numbers hold within one round) and by its id; what is not obeyed is acknowledged with why
(``command.node_ack``, signed as the executor) and never touches a rank.

What the agent does with a ``stop`` that passes is trainer/agent/node.py's. A ``join`` is for a
spare (``--join-running --join-on-command``): :class:`JoinOrders` holds it until the place that
node left is published (trainer/agent/vacancy.py) and lets the spare claim that place and no other.
A bus that cannot be read leaves the node as it is (logged): an order is never guessed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from collector import topics
from collector.auth import Gate, Keyring, Signer, load_keyring
from collector.bus import Bus
from collector.epoch_fence import new_run, node_fence_verdict, order_refusal
from collector.events import AckStatus, EventFactory, NodeCommand, NodeCommandAck, NodeSpare
from collector.stream import EventStream
from trainer.integration import signed_history

if TYPE_CHECKING:
    from trainer.agent.vacancy import Vacancy

log = logging.getLogger("resihp.agent")
SPARE_ANNOUNCE_S = 20.0  # a waiting spare says so this often on the control topic (kept forever: not often)


class NodeCommands:
    """One agent's reader of its job's node commands, with its signature gate and its answers."""

    def __init__(self, bus: Bus, job: str, source: str, keyring: Keyring | None = None,
                 from_beginning: bool = False, run: str | None = None, clock: Callable[[], float] = time.time) -> None:
        """Reads ``bus`` (and closes it in :meth:`close`) from its end now; ``from_beginning``
        re-reads the whole log (an audit of every order ever written). ``run``: the job's run id,
        which an order must name (None: a fresh one no order names); ``clock``: Unix time, for
        orders' expiries."""
        self.bus, self.job, self.source = bus, job, source
        keyring = keyring or load_keyring()
        self.gate = Gate(source, keyring)
        self.signer = Signer(EventFactory(job, source), "executor", keyring)
        self.seen: set[str] = set()
        self.run, self.clock = run or new_run(), clock
        if run is not None:  # a restarted agent of the run: the orders it answered stay answered
            self.seen.update(ack.payload.command_id for ack in signed_history(bus, job, (NodeCommandAck,), keyring)
                             if isinstance(ack.payload, NodeCommandAck) and ack.payload.run == run)
        self.acks: list[NodeCommandAck] = []
        # From the log's end *now*, not when the consumer gets its partition (collector/stream.py).
        start = {} if from_beginning else bus.end_offsets([topics.COMMANDS])
        self._stream = EventStream(bus, f"agent:{job}:{source}", [topics.COMMANDS], job=job,
                                   on_assign=lambda tps: {tp: start.get(tp, 0) for tp in tps})

    def read(self, addressed: Callable[[NodeCommand], bool]) -> list[NodeCommand]:
        """The verified node commands of this job that ``addressed`` says are this agent's, since
        the last call; the unverified ones among them are reported (``control.rejected``)."""
        out: list[NodeCommand] = []
        try:
            for delivery in self._stream.poll(timeout_s=0):
                ev, command = delivery.event, delivery.event.payload
                if ev.job != self.job or not isinstance(command, NodeCommand) or not addressed(command):
                    continue
                if delivery.topic != topics.obeyed_from(ev.kind) or not self.gate.admit(ev):
                    continue
                refusal = order_refusal(command, self.run, ev.time_s, self.clock())
                if refusal is not None:
                    self.gate.refuse(ev, refusal)
                else:
                    out.append(command)
            self._stream.commit()
            rejected = self.gate.take()
            if rejected:
                self.bus.publish(rejected)
        except Exception as exc:  # noqa: BLE001 - the node runs on as it is; the order is read again later
            log.warning("cannot read node commands for %s: %s", self.job, exc)
        return out

    def judge(self, command: NodeCommand, running_round: int) -> tuple[AckStatus | None, str]:
        """The fence's verdict (None: obey it), and the command counts as seen from now on."""
        verdict = node_fence_verdict(command, running_round, self.seen)
        self.seen.add(command.command_id)
        return verdict

    def ack(self, command: NodeCommand, running_round: int, status: AckStatus, detail: str,
            ranks: Sequence[int] = ()) -> None:
        ack = NodeCommandAck(command_id=command.command_id, node=command.node, action=command.action,
                             round=command.round, status=status, running_round=running_round, ranks=list(ranks),
                             detail=detail[:2000], run=self.run)
        self.acks.append(ack)
        line = f"node command {command.command_id} ({command.action} node {command.node}, round {command.round}): "
        print(f"resihp run: {line}{status.value}: {detail}", file=sys.stderr, flush=True)
        self.say(ack, f"the ack of node command {command.command_id}")

    def say(self, payload: NodeCommandAck | NodeSpare, what: str) -> None:
        """Publish ``payload`` signed as the executor; a bus that cannot take it is logged, not fatal."""
        try:
            self.bus.publish([self.signer.make(payload)])
        except Exception as exc:  # noqa: BLE001 - the agent's own line still says it
            log.warning("cannot publish %s: %s", what, exc)

    def close(self) -> None:
        self._stream.close()
        self.bus.close()


class JoinOrders:
    """A spare's wait for a signed ``join`` order (``--join-running --join-on-command``): the place
    it may take is the one the ordered node left, in the round the order names. An order is held
    until that place is published; one of another round is stale, and one whose place another
    agent claimed first fails. Every order is answered once (:class:`NodeCommands`' acks).

    While it waits the spare says so on the bus (``node.spare``, every ``announce_s``, each claim
    stale after three of them), so the engine can order it into a blamed node's place; an order
    that names another spare is not this one's and is left to that spare. Once it took a place or
    gave up it says it waits no more."""

    def __init__(self, commands: NodeCommands, ranks: int, announce_s: float = SPARE_ANNOUNCE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.commands, self.ranks, self.announce_s, self.clock = commands, ranks, announce_s, clock
        self.waiting: list[NodeCommand] = []  # verified orders whose place is not published yet
        self._chosen: NodeCommand | None = None
        self._next_announce = 0.0
        self.done = False  # it took a place or gave up: it waits no more, and said so

    @property
    def spare(self) -> str:
        """This spare's id, the one a join order names (its agent's source)."""
        return self.commands.source

    def announce(self, waiting: bool, detail: str = "") -> None:
        """Say on the bus whether this spare waits for an order (``node.spare``)."""
        self.done = not waiting
        now = self.clock()
        self._next_announce = now + self.announce_s
        self.commands.say(NodeSpare(spare=self.spare, run=self.commands.run, ranks=self.ranks, waiting=waiting,
                                    expires_at_s=now + 3 * self.announce_s if waiting else None, detail=detail[:2000]),
                          "that this spare waits" if waiting else "that this spare waits no more")

    def pick(self, places: Mapping[int, Vacancy]) -> int | None:
        """The number of the place to claim now, or None (no order yet, or its place not yet)."""
        if self.clock() >= self._next_announce:
            self.announce(True, f"waiting for a join order to take the place of a node with {self.ranks} ranks")
        self.waiting += self.commands.read(lambda c: c.action == "join" and c.spare in (None, self.spare))
        for order in list(self.waiting):
            fits = [n for n, v in places.items() if v.group_rank == order.node]
            if not fits:
                continue
            self.waiting.remove(order)
            n = max(fits)  # the newest place that node left
            status, detail = self.commands.judge(order, places[n].round)
            if status is not None:
                self.commands.ack(order, places[n].round, status, detail)
                continue
            self._chosen = order
            return n
        return None

    def claimed(self, vacancy: Vacancy, won: bool) -> None:
        order, self._chosen = self._chosen, None
        if order is None:
            return
        if won:
            self.commands.ack(order, vacancy.round, AckStatus.APPLIED,
                              f"took the place of node {vacancy.group_rank}: its ranks {list(vacancy.ranks)} start here "
                              "and join the world at its next step", vacancy.ranks)
            self.announce(False, f"took the place of node {vacancy.group_rank} in round {vacancy.round}")
        else:
            self.commands.ack(order, vacancy.round, AckStatus.FAILED,
                              f"another agent took the place of node {vacancy.group_rank} first")

    def expired(self, timeout_s: float) -> None:
        """The spare gave up waiting: the orders still held fail."""
        for order in self.waiting:
            self.commands.ack(order, order.round, AckStatus.FAILED,
                              f"node {order.node} left no place with this agent's number of ranks within {timeout_s:g} s")
        self.waiting = []
        self.announce(False, f"no place within {timeout_s:g} s")

    def close(self) -> None:
        """The spare's agent ends: if it still waited, it says it waits no more."""
        if not self.done and self._next_announce:
            self.announce(False, "the spare's agent stopped")
