"""A node's place in a running job, left by an agent that died, and the agent that takes it.

Under ``--on-failure shrink`` the job goes on without a dead agent's ranks (trainer/agent/presence.py,
node.py). The surviving agent that marked them lost also publishes a **vacancy** in the job's
rendezvous store: the dead node's group rank and global ranks, the rendezvous round's store
prefix, and where the ranks' store is. ``resihp run --join-running`` (the same flags as the
node it replaces) does not join torch's rendezvous — that would make every other agent restart
its worker group — but claims a vacancy with :class:`VacancyRendezvous`, a rendezvous handler
that answers ``next_rendezvous`` with the dead node's place. torch's agent then starts this node's
ranks with the dead ranks' ids; each finds itself marked lost, asks to join, and the world takes
it back at its next step boundary (``ShrinkingWorld.join``, trainer/agent/shrink.py) with the state
of the most advanced survivor. With ``--join-on-command`` the replacement takes only the place a
signed join order names (a :class:`PlaceChooser`, trainer/agent/commands.py's ``JoinOrders``); a
node stopped by a node command leaves its place the same way as one that died.

A vacancy is a signed record (trainer/agent/signed_store.py, scoped to the job's rendezvous id):
a stranger who reaches the store cannot offer a place of its own making (its round, its ranks'
store). It can add to the claim count first (the replacement then finds the place taken: a stall),
but a process it starts in a place is never admitted: the world takes back a rank only on its
signed request (trainer/agent/shrink.py).

What can fail: no vacancy appears within the join timeout (nothing died, or the job runs without
``--on-failure shrink``): the rendezvous times out with one line; a vacancy of a node with another
number of ranks is not taken.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo, RendezvousTimeoutError
from torch.distributed.elastic.utils.store import _NUM_MEMBERS, _barrier_nonblocking

from trainer.agent.signed_store import SignedStore

VACANCIES_KEY = "resihp/vacancies"  # how many were ever published; vacancy n is under VACANCY_KEY
VACANCY_KEY = "resihp/vacancy/{n}"


@dataclass(frozen=True)
class Vacancy:
    group_rank: int
    group_world_size: int
    ranks: tuple[int, ...]
    round_prefix: str  # the rendezvous round's store: where the agents of the round meet
    master_addr: str
    master_port: int

    @property
    def round(self) -> int:
        """The rendezvous round the place belongs to."""
        return _round_of_prefix(self.round_prefix)


def check_in_for_dead_agent(round_store: dist.Store, group_world_size: int) -> None:
    """Check in at torch's exit barrier (in the round's store) for an agent that died, so the
    survivors' agents do not wait out that barrier's timeout at the end; a replacement that takes
    its place withdraws this check-in (:meth:`VacancyRendezvous.next_rendezvous`) and makes its own."""
    _barrier_nonblocking(round_store, group_world_size, _TERMINAL_STATE_SYNC_ID)


def publish_vacancy(job_records: SignedStore, vacancy: Vacancy) -> None:
    """Offer the dead node's place to a replacement (``resihp run --join-running``): the count
    numbers the place, the place itself is a signed record."""
    n = job_records.store.add(VACANCIES_KEY, 1)
    job_records.set(VACANCY_KEY.format(n=n), asdict(vacancy))


def _vacancy(body: Any) -> Vacancy:
    vacancy = Vacancy(**{**body, "ranks": tuple(body["ranks"])})
    if not all(type(r) is int for r in vacancy.ranks) or type(vacancy.master_port) is not int \
            or not isinstance(vacancy.round_prefix, str) or not isinstance(vacancy.master_addr, str):
        raise ValueError("a vacancy names ranks, a round prefix and the ranks' store")
    if vacancy.round < 0:  # the prefix ends in the round's number (ValueError if it does not)
        raise ValueError(f"round prefix {vacancy.round_prefix!r} names no round")
    return vacancy


def round_store_prefix(handler: RendezvousHandler) -> str:
    """The prefix of the current round's store (torch's dynamic handler builds it from the run id
    and the round number, and does not say it; ``_wrap_store`` in dynamic_rendezvous.py)."""
    if isinstance(handler, VacancyRendezvous):
        if handler.taken is None:
            raise RuntimeError("no vacancy was taken yet")
        return handler.taken.round_prefix
    state = getattr(handler, "_state_holder").state  # noqa: B009 - torch's private state
    return f"torch.rendezvous.{handler.get_run_id()}.{state.round}"


def rendezvous_round(handler: RendezvousHandler) -> int:
    """The job's rendezvous round this agent is in (a replacement: the round of the place it took):
    node commands name it as their epoch (trainer/agent/commands.py)."""
    return _round_of_prefix(round_store_prefix(handler))


def _round_of_prefix(prefix: str) -> int:
    return int(prefix.rsplit(".", 1)[1])


class PlaceChooser(Protocol):
    """Which open place a replacement may take now (``--join-on-command``: the one a signed join
    order names, trainer/agent/commands.py), and what came of the claim."""

    def pick(self, places: Mapping[int, Vacancy]) -> int | None: ...

    def claimed(self, vacancy: Vacancy, won: bool) -> None: ...

    def expired(self, timeout_s: float) -> None: ...


class VacancyRendezvous(RendezvousHandler):
    """A rendezvous that gives this agent a dead node's place in the running round: the first
    that fits, or the one ``chooser`` picks."""

    def __init__(self, job_store: dist.Store, run_id: str, local_world_size: int, timeout_s: float,
                 chooser: PlaceChooser | None = None, records: SignedStore | None = None) -> None:
        """``records``: the job store's signed records (default: scoped by ``run_id``, refusals
        logged); only a signed vacancy is a place to take."""
        self.job_store, self.run_id, self.local_world_size, self.timeout_s = (job_store, run_id, local_world_size,
                                                                              timeout_s)
        self.records = records or SignedStore(job_store, run_id, reader="replacement")
        self.chooser = chooser
        self.taken: Vacancy | None = None

    def get_backend(self) -> str:
        return "c10d"

    def next_rendezvous(self) -> RendezvousInfo:
        """Wait for a vacancy of a node with as many ranks as this one and claim it (the first
        agent to add to its claim key wins)."""
        if self.taken is not None:
            raise RendezvousTimeoutError("a replacement takes one place once; it cannot be restarted in the job")
        deadline = time.monotonic() + self.timeout_s
        unread: set[int] = set()  # numbers counted whose signed place has not been read yet
        counted = 0
        places: dict[int, Vacancy] = {}  # published places of a node this size, not yet tried
        while time.monotonic() < deadline:
            published = self.job_store.add(VACANCIES_KEY, 0)
            unread |= set(range(counted + 1, published + 1))
            counted = max(counted, published)
            for n in sorted(unread):
                # Absent (its publisher writes it right after counting it) or refused (reported; the
                # number's real publisher may still write it): looked at again next time.
                vacancy = self.records.read(VACANCY_KEY.format(n=n), _vacancy)
                if vacancy is None:
                    continue
                unread.discard(n)
                if len(vacancy.ranks) == self.local_world_size:
                    places[n] = vacancy
            chosen = self.chooser.pick(places) if self.chooser is not None else next(iter(places), None)
            if chosen is not None:
                vacancy = places.pop(chosen)
                won = self.job_store.add(f"{VACANCY_KEY.format(n=chosen)}/claimed", 1) == 1
                if self.chooser is not None:
                    self.chooser.claimed(vacancy, won)
                if won:
                    self.taken = vacancy
                    store = dist.PrefixStore(vacancy.round_prefix, self.job_store)
                    store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, -1)  # the survivor's check-in for the dead
                    return RendezvousInfo(store, vacancy.group_rank, vacancy.group_world_size,
                                          RendezvousStoreInfo(vacancy.master_addr, vacancy.master_port))
                continue
            time.sleep(0.05)
        if self.chooser is not None:
            self.chooser.expired(self.timeout_s)
        raise RendezvousTimeoutError(f"no node of job {self.run_id!r} left a place with {self.local_world_size} "
                                     f"ranks within {self.timeout_s:g} s; --join-running replaces an agent that died "
                                     "in a job run with --on-failure shrink")

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True
