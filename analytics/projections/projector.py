"""Projections of the log into DuckDB, with exactly-once effect.

A projector reads the bus as a consumer group and, for every polled batch, runs each projection's
``apply`` and stores the consumer's positions in the *same* DuckDB transaction. On start (and on
every Kafka rebalance) the consumer seeks to the positions stored in DuckDB, not to the group's
committed offsets, so a process killed at any instant — before, during or after a transaction —
restarts exactly where its tables end: nothing lost, nothing applied twice. The group offsets are
committed too, after the transaction, only so that lag is visible to Kafka's tools.

Each event id is applied once (the contract's idempotence). Offsets alone cannot give that: a
republished record, a replayed trace or a producer's retry is a *new* record with an old id. So the
projector keeps every applied id in ``applied_events`` (a primary key, written in the same
transaction) and hands the projections only the first delivery of each id; the others are counted
in ``duplicates`` and change nothing — no row, no detector state, no incident. Every projection,
the detector included, is idempotent through this one filter rather than each on its own.

Control events (plans, commands, incidents, ``plan.current``, probe results: collector/auth.py's
``WRITERS``) reach the projections only when their signature verifies: with a ``gate``, a forged or
unsigned one is kept out of every table — it is an applied id all the same, so a replay does not
judge it again — and becomes one ``control.rejected`` event, handed to ``on_rejected`` inside the
transaction (the detector's outbox publishes it). The tables are then what the platform acted on,
not what anyone wrote.

Each process owns its DuckDB file (DuckDB allows one writer process); whatever others need is
published back to the bus as events. Only that process's user reads it: the file is 0600 and its
directory one others cannot enter (made 0700, or refused when open), because DuckDB creates its
``.wal`` with the umask's mode (collector/private_files.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import duckdb
import pyarrow as pa

from collector.auth import Gate
from collector.bus import Bus, TopicPartition
from collector.events import Envelope
from collector.private_files import FILE_MODE, require_private_dir
from collector.stream import Delivery, EventStream

_OFFSETS_DDL = (
    "CREATE TABLE IF NOT EXISTS consumer_offsets (grp VARCHAR NOT NULL, topic VARCHAR NOT NULL, "
    "part INTEGER NOT NULL, next_offset BIGINT NOT NULL, PRIMARY KEY (grp, topic, part))"
)
_APPLIED_DDL = "CREATE TABLE IF NOT EXISTS applied_events (id VARCHAR PRIMARY KEY)"


class Projection(Protocol):
    """A fold of events into tables. ``apply`` runs inside the projector's transaction."""

    tables: tuple[str, ...]

    def create(self, conn: duckdb.DuckDBPyConnection) -> None: ...

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None: ...


class Projector:
    def __init__(
        self,
        bus: Bus,
        db_path: str | Path,
        group: str,
        topics: Sequence[str],
        projections: Sequence[Projection],
        *,
        rebuild: bool = False,
        instance_id: str | None = None,
        gate: Gate | None = None,
        on_rejected: Callable[[duckdb.DuckDBPyConnection, list[Envelope]], None] | None = None,
    ) -> None:
        self.bus = bus
        self.group = group
        self.projections = list(projections)
        self.gate, self.on_rejected = gate, on_rejected
        require_private_dir(Path(db_path).parent, f"DuckDB file {db_path}")
        self.conn = duckdb.connect(str(db_path))
        os.chmod(db_path, FILE_MODE)  # its .wal takes the umask's mode: the directory keeps others out
        if rebuild:
            self._drop_all()
        self.conn.execute(_OFFSETS_DDL)
        self.conn.execute(_APPLIED_DDL)
        for p in self.projections:
            p.create(self.conn)
        self.stream = EventStream(bus, group, topics, on_assign=self._stored_positions, instance_id=instance_id)
        self.transactions = 0
        self.duplicates = 0  # deliveries whose event id was applied before (republished, replayed)

    def _drop_all(self) -> None:
        """--rebuild: forget every table and position; the log is replayed from its beginning."""
        for p in self.projections:
            for table in p.tables:
                self.conn.execute(f"DROP TABLE IF EXISTS {table}")
        self.conn.execute("DROP TABLE IF EXISTS consumer_offsets")
        self.conn.execute("DROP TABLE IF EXISTS applied_events")

    def _stored_positions(self, partitions: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        rows = self.conn.execute(
            "SELECT topic, part, next_offset FROM consumer_offsets WHERE grp = ?", [self.group]
        ).fetchall()
        stored = {TopicPartition(t, p): o for t, p, o in rows}
        # A partition with no stored position starts at 0: the tables hold nothing from it yet.
        return {tp: stored.get(tp, 0) for tp in partitions}

    def step(self, max_records: int = 20_000, timeout_s: float = 0.5) -> int:
        """Poll one batch and apply it atomically; returns the number of records consumed."""
        before = self.stream.positions_after_poll()
        deliveries = self.stream.poll(max_records, timeout_s)
        after = self.stream.positions_after_poll()
        moved = {tp: off for tp, off in after.items() if before.get(tp) != off}
        if not moved:
            return 0
        self.conn.begin()
        try:
            fresh = self._verified(self._first_seen(deliveries))
            for p in self.projections:
                p.apply(self.conn, fresh)
            self.conn.executemany(
                "INSERT OR REPLACE INTO consumer_offsets VALUES (?, ?, ?, ?)",
                [[self.group, tp.topic, tp.partition, off] for tp, off in moved.items()],
            )
            self.conn.commit()
        except BaseException:
            self.conn.rollback()
            raise
        self.transactions += 1
        self.stream.commit(moved)
        return self.stream.last_polled

    def _first_seen(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """The deliveries whose event id was never applied, each id once (the first in log order);
        records their ids as applied, inside the caller's transaction."""
        if not deliveries:
            return []
        first: dict[str, Delivery] = {}
        for d in deliveries:
            first.setdefault(d.event.id, d)
        self.conn.register("_batch_ids", pa.table({"id": pa.array(list(first), pa.string())}))
        try:
            new = self.conn.execute("INSERT INTO applied_events SELECT id FROM _batch_ids ON CONFLICT DO NOTHING "
                                    "RETURNING id").fetchall()
        finally:
            self.conn.unregister("_batch_ids")
        fresh_ids = {i for (i,) in new}
        fresh = [d for d in deliveries if d.event.id in fresh_ids and first[d.event.id] is d]
        self.duplicates += len(deliveries) - len(fresh)
        return fresh

    def _verified(self, fresh: list[Delivery]) -> list[Delivery]:
        """The deliveries that may reach the tables: all, without a gate; else those whose control
        signature verifies. Refusals go to ``on_rejected`` (inside the caller's transaction)."""
        if self.gate is None:
            return fresh
        admitted = [d for d in fresh if self.gate.admit(d.event, time_s=d.event.time_s)]
        rejected = self.gate.take()
        if rejected and self.on_rejected is not None:
            self.on_rejected(self.conn, rejected)
        return admitted

    def run(
        self,
        *,
        stop: Callable[[], bool] = lambda: False,
        idle_exit_s: float | None = None,
        max_records: int = 20_000,
    ) -> None:
        """Consume until ``stop()`` says so, or until nothing arrived for ``idle_exit_s``."""
        idle_since = time.monotonic()
        while not stop():
            if self.step(max_records=max_records):
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                return

    def close(self) -> None:
        self.stream.close()
        self.conn.close()
