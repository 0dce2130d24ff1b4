"""The embedded backend: a durable log in one SQLite file, shared by processes on one machine.

Why SQLite in WAL mode: many processes may read while one writes, a committed transaction survives
the crash of any process (``synchronous=NORMAL`` in WAL mode; set RESIHP_EMBEDDED_SYNC=full to
survive power loss too, at an fsync per batch), and it ships with Python — zero set-up.

Layout: one table per topic, ``offset INTEGER PRIMARY KEY`` (so the offset is the rowid and reads
are range scans), and one table of group positions. Each topic has a single partition (0): one
machine does not need more, and per-key order is then trivially kept. Writers serialise on
``BEGIN IMMEDIATE`` and assign offsets inside the transaction, so offsets become visible in order
and a reader never sees a gap that later fills. A consumer group should have one active member at
a time; a second member of the same group reads the same records (there is nothing to split).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from collector.bus import Bus, Consumer, OnAssign, RawMessage, Record, TopicPartition

_BUSY_TIMEOUT_MS = 60_000
_PARTITION = 0


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise RuntimeError(f"embedded bus at {path}: SQLite refused WAL mode (got {mode}); use a local disk")
    sync = os.environ.get("RESIHP_EMBEDDED_SYNC", "normal").lower()
    if sync not in ("normal", "full"):
        raise ValueError(f"RESIHP_EMBEDDED_SYNC={sync!r}: choose 'normal' or 'full'")
    conn.execute(f"PRAGMA synchronous={sync.upper()}")
    return conn


def _table(topic: str) -> str:
    return '"log:' + topic.replace('"', '""') + '"'


class EmbeddedBus(Bus):
    name = "embedded"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = _connect(self.path)
        self._lock = threading.Lock()  # one writer connection, shared by this process's threads
        self._known_topics: set[str] = set()
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS group_offsets (grp TEXT NOT NULL, topic TEXT NOT NULL, "
            "part INTEGER NOT NULL, next_offset INTEGER NOT NULL, PRIMARY KEY (grp, topic, part))"
        )

    def _ensure_topic(self, conn: sqlite3.Connection, topic: str) -> None:
        if topic not in self._known_topics:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_table(topic)} "
                "(offset INTEGER PRIMARY KEY, key BLOB, value BLOB NOT NULL, ts REAL NOT NULL)"
            )
            self._known_topics.add(topic)

    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        by_topic: dict[str, list[tuple[bytes | None, bytes]]] = {}
        for topic, key, value in messages:
            by_topic.setdefault(topic, []).append((key, value))
        now = time.time()
        with self._lock:
            for topic in by_topic:
                self._ensure_topic(self._conn, topic)
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for topic, rows in by_topic.items():
                    table = _table(topic)
                    (nxt,) = self._conn.execute(f"SELECT COALESCE(MAX(offset) + 1, 0) FROM {table}").fetchone()
                    self._conn.executemany(
                        f"INSERT INTO {table} (offset, key, value, ts) VALUES (?, ?, ?, ?)",
                        ((nxt + i, k, v, now) for i, (k, v) in enumerate(rows)),
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (a full disk, say) has already rolled back: a second ROLLBACK would
                # raise "no transaction is active" and hide the error that names the problem.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def consumer(
        self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None, instance_id: str | None = None
    ) -> Consumer:
        return EmbeddedConsumer(self, group, topics, on_assign)

    def end_offsets(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        out = {}
        with self._lock:
            for topic in topics:
                self._ensure_topic(self._conn, topic)
                (nxt,) = self._conn.execute(f"SELECT COALESCE(MAX(offset) + 1, 0) FROM {_table(topic)}").fetchone()
                out[TopicPartition(topic, _PARTITION)] = nxt
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class EmbeddedConsumer(Consumer):
    """Reads with its own connection, so a slow reader never blocks the process's writers."""

    def __init__(self, bus: EmbeddedBus, group: str, topics: Sequence[str], on_assign: OnAssign | None) -> None:
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        self._bus = bus
        self.group = group
        self._conn = _connect(bus.path)
        for topic in topics:
            bus._ensure_topic(self._conn, topic)
        self._partitions = [TopicPartition(t, _PARTITION) for t in topics]
        committed = dict(
            ((t, p), o)
            for t, p, o in self._conn.execute(
                "SELECT topic, part, next_offset FROM group_offsets WHERE grp = ?", (group,)
            )
        )
        self._pos = {tp: committed.get(tp, 0) for tp in self._partitions}
        if on_assign is not None:
            self.seek(on_assign(list(self._partitions)))
        self._next_topic = 0

    def poll(self, max_records: int = 10_000, timeout_s: float = 1.0) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        backoff_s = 0.001
        while True:
            out = self._read(max_records)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(backoff_s, max(0.0, deadline - time.monotonic())))
            backoff_s = min(backoff_s * 2, 0.02)

    def _read(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        n = len(self._partitions)
        for i in range(n):  # rotate the starting topic so no topic starves another
            tp = self._partitions[(self._next_topic + i) % n]
            room = max_records - len(out)
            if room <= 0:
                break
            rows = self._conn.execute(
                f"SELECT offset, key, value, ts FROM {_table(tp.topic)} WHERE offset >= ? ORDER BY offset LIMIT ?",
                (self._pos[tp], room),
            ).fetchall()
            if rows:
                out.extend(Record(tp.topic, tp.partition, o, k, v, ts) for o, k, v, ts in rows)
                self._pos[tp] = rows[-1][0] + 1
        self._next_topic = (self._next_topic + 1) % n
        return out

    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        positions = dict(self._pos if positions is None else positions)
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.executemany(
                "INSERT INTO group_offsets (grp, topic, part, next_offset) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (grp, topic, part) DO UPDATE SET next_offset = excluded.next_offset",
                [(self.group, tp.topic, tp.partition, off) for tp, off in positions.items()],
            )
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # as in publish_raw: keep the error that names the problem
                self._conn.execute("ROLLBACK")
            raise

    def seek(self, positions: Mapping[TopicPartition, int]) -> None:
        for tp, off in positions.items():
            if tp not in self._pos:
                raise ValueError(f"cannot seek {tp}: this consumer reads {sorted(self._pos)}")
            if off < 0:
                raise ValueError(f"cannot seek {tp} to negative offset {off}")
            self._pos[tp] = off

    def seek_to_beginning(self) -> None:
        for tp in self._pos:
            self._pos[tp] = 0

    def positions(self) -> dict[TopicPartition, int]:
        return dict(self._pos)

    def close(self) -> None:
        self._conn.close()
