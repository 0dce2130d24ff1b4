"""What an incident is about (its key) and which probe it has asked: the incident book's types.

One incident per location: the key names the location's kind and where it is. The incident's id
hashes the key's text (``str(key)``), so the same location at the same opening iteration gets the
same id in every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class KeyKind(str, Enum):
    RANKS = "ranks"  # a compute fail-slow: one rank, or a TP group telemetry cannot split
    LINK = "link"  # a fail-slow p2p link a → b
    COMM = "comm"  # communication: the iteration slower than its compute explains
    UNTRACED = "untraced"  # time lost on the ranks nobody traces
    DEAD = "dead"  # a fail-stop rank
    DEAD_HIDDEN = "dead_hidden"  # a fail-stop among ranks nobody traces (the job hangs)


@dataclass(frozen=True)
class IncidentKey:
    """The location an open incident is about; the incident book holds one incident per key."""

    kind: KeyKind
    ranks: tuple[int, ...] = ()  # RANKS: the suspects; DEAD: the rank
    link: tuple[int, int] | None = None  # LINK: (sender, receiver)

    @staticmethod
    def of_ranks(ranks: tuple[int, ...]) -> IncidentKey:
        return IncidentKey(KeyKind.RANKS, tuple(ranks))

    @staticmethod
    def of_link(a: int, b: int) -> IncidentKey:
        return IncidentKey(KeyKind.LINK, link=(a, b))

    @staticmethod
    def of_dead(rank: int) -> IncidentKey:
        return IncidentKey(KeyKind.DEAD, (rank,))

    def __str__(self) -> str:
        """The key's text, which incident ids hash: ``('ranks', (3,))``, ``('link', 0, 1)``,
        ``('dead', 5)``, ``('comm',)``."""
        if self.kind is KeyKind.RANKS:
            return str((self.kind.value, self.ranks))
        if self.kind is KeyKind.LINK and self.link is not None:
            return str((self.kind.value, *self.link))
        if self.kind is KeyKind.DEAD:
            return str((self.kind.value, self.ranks[0]))
        return str((self.kind.value,))


COMM_KEY = IncidentKey(KeyKind.COMM)
UNTRACED_KEY = IncidentKey(KeyKind.UNTRACED)
DEAD_HIDDEN_KEY = IncidentKey(KeyKind.DEAD_HIDDEN)


class ProbeKind(str, Enum):
    """Which probe an incident has pending (or asked last): what its answers are judged as."""

    NAMING = "naming"  # the suspects' compute (or a link's ends): names the slow one and confirms
    LINKS = "links"  # nobody it named computes slow: every rank's links, for a slow link or NIC
    REPROBE = "reprobe"  # the named rank got slower: its TP group again, for a peer slowing too
    HEALTH = "health"  # a slow rank no telemetry sees: is it healthy again
