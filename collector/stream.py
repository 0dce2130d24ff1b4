"""Decoded events from a consumer, with bad records sent to the dead-letter topic.

This is the one place consumers turn bytes into events. A record that does not decode never
crashes the consumer and is never dropped silently: it is published to ``resihp.deadletter``
with the reason and its raw bytes (a prefix and a digest when they are long: a dead letter always
fits the bus) *before* its offset can be committed, and counted. The dead
letter's id is derived from the record's position, so a consumer that crashes after publishing it
and reads the record again produces the same id, which dead-letter readers dedupe on.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from collector.bus import Bus, Consumer, OnAssign, TopicPartition
from collector.codec import InvalidEvent, dead_letter, decode
from collector.events import DeadLetter, Envelope, EventFactory
from collector.topics import misplaced


class Delivery(NamedTuple):
    topic: str
    partition: int
    offset: int
    event: Envelope


@dataclass
class StreamCounters:
    delivered: int = 0
    dead_letters: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


_delivery = tuple.__new__  # a Delivery from its fields: a NamedTuple's own __new__ is a Python call a record
_DLQ_NAMESPACE = uuid.UUID("6f1c2a4e-3d2b-4c55-9a57-2f4d0b9c1e10")


class EventStream:
    """A consumer-group member that yields events and dead-letters everything else."""

    def __init__(
        self,
        bus: Bus,
        group: str,
        topics: Sequence[str],
        *,
        on_assign: OnAssign | None = None,
        instance_id: str | None = None,
        job: str = "resihp",
    ) -> None:
        self.bus = bus
        self.group = group
        self.consumer: Consumer = bus.consumer(group, topics, on_assign, instance_id)
        self.counters = StreamCounters()
        self._dead = EventFactory(job[:200], f"consumer:{group}"[:200])
        self._next: dict[TopicPartition, int] = {}
        self.last_polled = 0  # records (valid or not) returned by the last poll

    def poll(self, max_records: int = 10_000, timeout_s: float = 1.0) -> list[Delivery]:
        records = self.consumer.poll(max_records, timeout_s)
        self.last_polled = len(records)
        out: list[Delivery] = []
        dead: list[Envelope] = []
        reasons: list[str] = []
        last: dict[tuple[str, int], int] = {}
        for r in records:
            last[r[:2]] = r.offset  # (topic, partition): a plain tuple costs a record less than a TopicPartition
            try:
                event = decode(r.value)
                if (why := misplaced(event.kind, r.topic)) is not None:
                    raise InvalidEvent(why)
            except InvalidEvent as exc:
                letter = dead_letter(r.topic, r.partition, r.offset, self.group, exc.reason, r.value)
                dead.append(self._dead_letter_event(letter, r.topic, r.partition, r.offset))
                reasons.append(letter.reason)
                continue
            out.append(_delivery(Delivery, (r.topic, r.partition, r.offset, event)))
        for (topic, partition), offset in last.items():
            self._next[TopicPartition(topic, partition)] = offset + 1
        if dead:
            self.bus.publish(dead)
            self.counters.dead_letters += len(dead)
            for reason in reasons:
                key = reason.split(":", 2)[-1].strip()[:80]
                self.counters.reasons[key] = self.counters.reasons.get(key, 0) + 1
        self.counters.delivered += len(out)
        return out

    def _dead_letter_event(self, payload: DeadLetter, topic: str, partition: int, offset: int) -> Envelope:
        event_id = uuid.uuid5(_DLQ_NAMESPACE, f"{self.group}/{topic}/{partition}/{offset}").hex
        return self._dead.make(payload, event_id=event_id)

    def positions_after_poll(self) -> dict[TopicPartition, int]:
        """Just past every record returned by polls so far (dead letters included)."""
        return dict(self._next)

    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        self.consumer.commit(self.positions_after_poll() if positions is None else positions)

    def seek_to_beginning(self) -> None:
        self.consumer.seek_to_beginning()
        self._next.clear()

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
