"""Keeps a ReadModel up to date from the bus, with a consumer group of its own.

Each console process reads the log from its beginning on start (the read model lives in memory,
so there is nothing to resume) under a group no one else uses, and then polls what is new on every
refresh. Streamlit runs each browser session in its own thread; one Feed is shared by all of them,
so ``refresh`` holds a lock and at most one session folds at a time.

What can go wrong: the bus is unreachable (Kafka down) — ``refresh`` raises and the page shows the
error; a record that is not an event — the stream dead-letters it and the fold never sees it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from collector import topics
from collector.bus import Bus, TopicPartition
from collector.events import Envelope
from collector.stream import EventStream
from ui.read_model import ReadModel

CONSOLE_TOPICS: tuple[str, ...] = (topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL, topics.TRUTH)


def _from_beginning(partitions: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
    return {tp: 0 for tp in partitions}


class Feed:
    """The bus, this console's stream over it, and the model it folds into."""

    def __init__(self, bus_factory: Callable[[], Bus], *, group: str | None = None,
                 topics_read: Sequence[str] = CONSOLE_TOPICS, max_rank_iterations: int = 4096) -> None:
        self.bus = bus_factory()
        self.group = group or f"ui-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stream = EventStream(self.bus, self.group, list(topics_read), on_assign=_from_beginning, job="resihp-ui")
        self.model = ReadModel(max_rank_iterations=max_rank_iterations)
        self.lock = threading.Lock()
        self.last_refresh_s = 0.0
        self.last_fold_s = 0.0

    def refresh(self, *, max_records: int = 20_000, budget_s: float = 30.0, timeout_s: float = 0.05) -> int:
        """Fold everything new (or as much as ``budget_s`` allows); returns events applied."""
        applied = 0
        with self.lock:
            start = time.perf_counter()
            while True:
                deliveries = self.stream.poll(max_records, timeout_s)
                for d in deliveries:
                    self.model.apply(d.event)
                applied += len(deliveries)
                if self.stream.last_polled == 0 or time.perf_counter() - start > budget_s:
                    break
                timeout_s = 0.0
            self.last_fold_s = time.perf_counter() - start
            self.last_refresh_s = time.time()
        return applied

    def publish(self, event: Envelope) -> None:
        """Publish a decision and fold it at once, so the page that made it shows it."""
        self.bus.publish([event])
        self.refresh()

    def close(self) -> None:
        self.stream.close()
        self.bus.close()
