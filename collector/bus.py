"""The Bus: one interface, two backends (the embedded log and Kafka), one behaviour.

The interface is deliberately Kafka's shape, kept small: publish a batch and return once it is
durable; consume as a member of a consumer group from committed offsets (or from offsets the
consumer stored itself, for exactly-once effect); seek to the beginning to replay. Every backend
passes the same conformance suite (tests/test_bus_conformance.py).

Offsets are positions of the *next* record to read, as in Kafka: committing ``{tp: 10}`` means
records 0..9 are done.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Self

from collector.codec import encode
from collector.events import Envelope
from collector.settings import DEFAULT_EMBEDDED_PATH as DEFAULT_EMBEDDED_PATH
from collector.settings import DEFAULT_KAFKA_BOOTSTRAP as DEFAULT_KAFKA_BOOTSTRAP
from collector.settings import environment
from collector.topics import PartitionKeys, topics_for

log = logging.getLogger(__name__)


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class Record(NamedTuple):
    """One raw record as stored: its position, key, bytes and the time the log accepted it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_s: float


class RawMessage(NamedTuple):
    topic: str
    key: bytes | None
    value: bytes


# Called when partitions are assigned to a consumer; returns where to start in each (partitions
# it leaves out start from the group's committed offset, or the beginning).
OnAssign = Callable[[Sequence[TopicPartition]], Mapping[TopicPartition, int]]


@dataclass
class BusHealth:
    """Whether the bus client can reach the log, as its own connections found (shared by a bus and
    the consumers it opened). A backend marks it down on a connection error or when it has no
    metadata, and up at its next success; ``outages`` counts the transitions to down, so a reader
    that looked at it before and after can tell that an outage happened in between, however short."""

    down_since: float | None = None  # time.time() of the first failure of the current outage
    reason: str = ""
    outages: int = 0
    last_down_since: float | None = None  # the first failure of the newest outage, kept after it ended

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def mark_down(self, reason: str) -> None:
        if self.down_since is None:
            self.down_since, self.outages = time.time(), self.outages + 1
            self.last_down_since = self.down_since
            log.warning("%s", json.dumps({"event": "bus_outage", "reason": reason[:300]}))
        self.reason = reason

    def mark_up(self) -> None:
        if self.down_since is not None:
            log.warning("%s", json.dumps({"event": "bus_reconnected", "down_s": round(time.time() - self.down_since, 1)}))
            self.down_since, self.reason = None, ""


class _Closing(ABC):
    """A consumer or a bus holds a connection or open files: ``with`` closes it on the way out."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Consumer(_Closing):
    """A member of a consumer group reading some topics."""

    health: BusHealth = BusHealth()  # a backend that can lose its log gives each consumer its bus's

    @abstractmethod
    def poll(self, max_records: int = 10_000, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records in offset order per partition; waits up to ``timeout_s``
        when none are ready and returns an empty list then."""

    @abstractmethod
    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        """Store the group's positions (default: just past everything polled so far)."""

    @abstractmethod
    def seek(self, positions: Mapping[TopicPartition, int]) -> None:
        """Continue reading from these positions (assigned partitions only)."""

    @abstractmethod
    def seek_to_beginning(self) -> None:
        """Replay: continue every assigned partition from its first record."""

    @abstractmethod
    def positions(self) -> dict[TopicPartition, int]:
        """The next offset this consumer will read in each assigned partition."""

    def joining(self) -> bool:
        """Whether the group's membership waits on this consumer's next poll (a Kafka member joining
        or rejoining in a rebalance): a reader holding off its reads must poll then, or every member
        waits for it. A backend without groups never waits."""
        return False


class Bus(_Closing):
    """Where events go. ``publish`` returns only once the log has them durably."""

    name: str
    health: BusHealth = BusHealth()  # the embedded log is a local file: never down

    def publish(self, events: Iterable[Envelope]) -> int:
        """Encode, route and key a batch of events; returns how many were published (an event
        routed to two topics, a command, counts once).

        Raises InvalidEvent (before anything is sent) if an event cannot be encoded.
        """
        keys: PartitionKeys = self.__dict__.setdefault("_partition_keys", PartitionKeys())  # per producer
        batch, count = [], 0
        for e in events:
            raw, key, count = encode(e), keys.key(e.job, e.source, e.kind, e.payload), count + 1
            for topic in topics_for(e.kind):
                batch.append(RawMessage(topic, key, raw))
        if batch:
            self.publish_raw(batch)
        return count

    @abstractmethod
    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        """Append already-encoded records (replay, dead letters, and tests of bad input)."""

    @abstractmethod
    def consumer(
        self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None, instance_id: str | None = None
    ) -> Consumer:
        """Join ``group`` reading ``topics``. Without stored positions a new group starts at the
        beginning of the log. ``instance_id`` makes the membership static (Kafka): a restarted
        process with the same id takes its partitions back at once instead of after a session
        timeout."""

    @abstractmethod
    def end_offsets(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        """The offset the next published record of each partition will get."""


def open_bus(backend: str | None = None, *, path: str | None = None, bootstrap: str | None = None) -> Bus:
    """The bus a process should use: ``embedded`` (default) or ``kafka``.

    Environment: RESIHP_BUS (embedded|kafka), RESIHP_EMBEDDED_PATH, RESIHP_KAFKA_BOOTSTRAP.
    """
    env = environment()
    backend = backend or env.bus
    if backend == "embedded":
        from collector.embedded import EmbeddedBus

        return EmbeddedBus(path or env.embedded_path)
    if backend == "kafka":
        from collector.kafka_bus import KafkaBus

        return KafkaBus(bootstrap or env.kafka_bootstrap)
    raise ValueError(f"unknown bus backend {backend!r}; choose 'embedded' or 'kafka'")
