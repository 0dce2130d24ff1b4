"""Fold the lifecycle from the log on demand (``resihp plans list``, the console).

Reads the control and analytics topics from the beginning with a throw-away consumer group that
never commits, up to the end offsets seen at the start, so it terminates even while others keep
publishing.
"""

from __future__ import annotations

import uuid

from collector import topics
from collector.bus import Bus
from collector.stream import EventStream
from remediation.lifecycle import LifecycleState, initial_state, step


def fold_log(bus: Bus, job: str, *, max_polls: int = 100_000) -> LifecycleState:
    wanted = [topics.ANALYTICS, topics.CONTROL]
    end = bus.end_offsets(wanted)
    state = initial_state(job)
    if not any(end.values()):
        return state
    stream = EventStream(bus, f"plans-view-{uuid.uuid4().hex[:12]}", wanted,
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
