"""Whether the other agents of the job are still there: one TCP connection to each.

Under ``--on-failure shrink`` an agent marks its own dead ranks lost so their peers can shrink
past them (trainer/agent/shrink.py). When the whole agent dies (SIGKILL, OOM killer, a crash) its
ranks die with it (trainer/agent/child.py) and nobody is left to mark them; the survivors'
quorum would wait out its timeout. So every agent listens on a socket of its own and connects to
every other agent's; the kernel closes a dead process's sockets, so a peer that reads end-of-file
knows at once that the agent is gone — no lease, no timeout to tune, no false alarm from an agent
that is merely slow. An agent that ends on purpose (its ranks finished, or were all lost already)
first writes one byte, ``DONE``, so its peers tell it apart from a death.

Where to meet: each agent writes ``resihp/agent/<group rank>`` (its address, port and global
ranks) into the rendezvous round's store, signed for the round (trainer/agent/signed_store.py);
each reads the others' and connects. A registration that does not verify is refused and reported:
a stranger cannot name ranks for the survivors to mark lost by registering and hanging up. An agent that
never registers is not watched (its ranks are not lost either: they were never started).

What it does not see: a machine that vanishes without closing its sockets (power, a cable) keeps
its connections open until TCP gives up on them; that case still waits out the quorum's timeout.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from trainer.agent.signed_store import SignedStore

DONE = b"d"
REGISTRATION_KEY = "resihp/agent/{group_rank}"


@dataclass(frozen=True)
class PeerAgent:
    group_rank: int
    ranks: tuple[int, ...]  # the global ranks it started
    token: str  # which agent: a replacement takes a dead agent's group rank (trainer/agent/vacancy.py)


def _registration(body: Any) -> tuple[str, int, tuple[int, ...], str]:
    """A signed registration: where the agent listens, the ranks it started, its token."""
    ranks = tuple(body["ranks"])
    if not isinstance(body["address"], str) or type(body["port"]) is not int or not isinstance(body["token"], str) \
            or not all(type(r) is int for r in ranks):
        raise ValueError("a registration holds an address, a port, the ranks and a token")
    return body["address"], body["port"], ranks, body["token"]


def listen_address(address: str | None, store: object) -> str:
    """Where the presence listener binds and what it registers: the address the agent was given
    (``--local-addr``, or the one the rendezvous is bound to); else the address this host reaches
    the rendezvous store from (so the interface its peers share; loopback for a store on
    loopback). One interface, never every one: anyone who reaches a listener can hold a place in
    the round's watch. No packet is sent to find it (a UDP socket's connect only picks a route)."""
    if address:
        return address
    while store is not None and not hasattr(store, "host"):  # a PrefixStore: the TCPStore under it
        store = getattr(store, "underlying_store", None)
    host = getattr(store, "host", None)
    if not isinstance(host, str) or not host:
        return "127.0.0.1"
    try:
        family, _, _, _, where = socket.getaddrinfo(host, getattr(store, "port", 1) or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as route:
            route.connect(where)
            return str(route.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class AgentPresence:
    """This agent's listening socket and its connections to every other agent of the round."""

    def __init__(self, records: SignedStore, group_rank: int, group_world_size: int, ranks: tuple[int, ...],
                 address: str | None) -> None:
        """Listen on ``address`` (when None: :func:`listen_address`) and register there, signed, in
        the round's store (``records``)."""
        self.records, self.group_rank, self.group_world_size = records, group_rank, group_world_size
        reachable = listen_address(address, records.store)
        family = socket.AF_INET6 if ":" in reachable else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((reachable, 0))
        self.listener.listen(max(1, group_world_size))
        self.listener.setblocking(False)
        records.set(REGISTRATION_KEY.format(group_rank=group_rank),
                    {"address": reachable, "port": self.listener.getsockname()[1], "ranks": list(ranks),
                     "token": f"{socket.gethostname()}-{os.getpid()}"})
        self.watched: dict[int, tuple[socket.socket, PeerAgent]] = {}  # connections to the others
        self.accepted: list[socket.socket] = []  # the others' connections to this agent
        self.gone: set[str] = set()  # tokens of the agents seen to end

    def poll(self) -> list[PeerAgent]:
        """Accept and make connections; returns the agents that died since the last call."""
        self._accept()
        died = self._connect()
        for group_rank, (conn, peer) in list(self.watched.items()):
            try:
                data = conn.recv(1)
            except BlockingIOError:
                continue  # open and silent: alive
            except OSError:
                data = b""  # reset: gone as surely as end-of-file
            del self.watched[group_rank]
            conn.close()
            self.gone.add(peer.token)
            if data != DONE:
                died.append(peer)
        return died

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            self.accepted.append(conn)

    def _connect(self) -> list[PeerAgent]:
        """Connect to the agents that registered since the last call; returns those that
        registered and no longer listen (they died before this agent looked). Only signed
        registrations count: a stranger's (which would name ranks for this agent to mark lost
        once its socket closes) is refused and reported, and that place stays unwatched."""
        died = []
        for group_rank in range(self.group_world_size):
            key = REGISTRATION_KEY.format(group_rank=group_rank)
            if group_rank == self.group_rank or group_rank in self.watched:
                continue
            seen = self.records.read(key, _registration)
            if seen is None:
                continue  # not registered yet, or refused
            address, port, ranks, token = seen
            peer = PeerAgent(group_rank, ranks, token)
            if peer.token in self.gone:
                continue  # its place is empty until a replacement registers there
            try:
                conn = socket.create_connection((address, port), timeout=5)
            except OSError:
                self.gone.add(peer.token)
                died.append(peer)
                continue
            conn.setblocking(False)
            self.watched[group_rank] = (conn, peer)
        return died

    def close(self, finished: bool) -> None:
        """Stop watching and being watched. ``finished``: this agent ends on purpose (its peers
        must not take its ranks for lost); otherwise its peers see what a death looks like."""
        self._accept()  # a connection still in the backlog would otherwise be reset: a death to its peer
        for conn in self.accepted:
            try:
                if finished:
                    conn.sendall(DONE)
            except OSError:
                pass  # that peer is gone already
            conn.close()
        for conn, _ in self.watched.values():
            conn.close()
        self.listener.close()
        self.accepted, self.watched = [], {}
