"""Fold the lifecycle from the log on demand (``resihp plans list``, the console).

Reads the control and analytics topics from the beginning, never committing, up to the end
offsets seen at the start, so it terminates even while others keep publishing.

The consumer group is stable per terminal user (``plans-view-<user>``), not a throw-away one: a
malformed record is dead-lettered with an id derived from (group, topic, partition, offset), so
listing again re-publishes the *same* dead letter, which every dead-letter reader dedupes, instead
of a new one per listing. Caveat (Kafka): two listings by the same user at the same moment share
the group and may split the partitions between them; run them one after the other.
"""

from __future__ import annotations

import getpass

from collector import topics
from collector.bus import Bus
from collector.stream import EventStream
from remediation.lifecycle import LifecycleState, initial_state, step


def view_group(user: str | None = None) -> str:
    """The consumer group of a terminal user's read-only views."""
    name = user or getpass.getuser()
    return "plans-view-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def fold_log(bus: Bus, job: str, *, max_polls: int = 100_000, group: str | None = None) -> LifecycleState:
    wanted = [topics.ANALYTICS, topics.CONTROL]
    end = bus.end_offsets(wanted)
    state = initial_state(job)
    if not any(end.values()):
        return state
    stream = EventStream(bus, group or view_group(), wanted,
                         on_assign=lambda parts: {tp: 0 for tp in parts}, job=job)
    try:
        for _ in range(max_polls):
            for d in stream.poll(timeout_s=0.2):
                step(state, d.event)
            pos = stream.consumer.positions()
            if all(pos.get(tp, 0) >= off for tp, off in end.items()):
                break
    finally:
        stream.close()
    return state
