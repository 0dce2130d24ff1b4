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

Retention (off by default: the log keeps everything): ``retention_s={topic: seconds}``, or
RESIHP_EMBEDDED_TELEMETRY_RETENTION_S for the telemetry topic, deletes a topic's oldest records once
they are older than that, as Kafka's ``retention.ms`` does. Telemetry is what fills a disk (one
message per rank per iteration) and only the live analytics consumer reads it; the control topic is
the remediation lifecycle's record, folded from its first event, so it cannot be given a retention.
Deletion takes a prefix of the log and always keeps the newest record, so offsets never restart. A
consumer whose position was deleted under it continues from the oldest record left, logs a warning
naming the range it lost, and counts it in ``lost_to_retention``.

Who can read it: only its owner. The log holds every event, signed ones included, so it is created
0600 (directories made for it 0700) before SQLite opens it, whatever the umask; SQLite gives the
``-wal`` and ``-shm`` files the mode of the log. A log made group- or world-readable before is made
0600 on open (collector/private_files.py).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from collector.bus import Bus, Consumer, OnAssign, RawMessage, Record, TopicPartition
from collector.private_files import create_private_file, private_dir, tighten
from collector.settings import environment
from collector.topics import CONTROL, TELEMETRY

log = logging.getLogger(__name__)

_record = tuple.__new__  # a Record from (topic, partition, offset, key, value, timestamp_s)
_BUSY_TIMEOUT_MS = 60_000
_PARTITION = 0
_TRIM_EVERY_FRACTION = 0.1  # look for expired records at most every tenth of the retention
RETENTION_ENV = "RESIHP_EMBEDDED_TELEMETRY_RETENTION_S"


# A new log's page size. Records are a rank report each (a few KiB, often past SQLite's default
# 4 KiB page, whose overflow pages then chain one per 4 KiB): at 64 KiB a batch is written in a
# few large pages instead of many small ones. Set before WAL mode, on an empty file only: SQLite
# keeps an existing log's page size (a log made before this setting reads and writes as it was).
PAGE_SIZE = 65536


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise RuntimeError(f"embedded bus at {path}: SQLite refused WAL mode (got {mode}); use a local disk")
    sync = environment().embedded_sync.lower()
    if sync not in ("normal", "full"):
        raise ValueError(f"RESIHP_EMBEDDED_SYNC={sync!r}: choose 'normal' or 'full'")
    conn.execute(f"PRAGMA synchronous={sync.upper()}")
    return conn


def _table(topic: str) -> str:
    return '"log:' + topic.replace('"', '""') + '"'


def _retention_from_env() -> dict[str, float]:
    raw = environment().embedded_telemetry_retention_s.strip()
    if not raw:
        return {}
    try:
        return {TELEMETRY: float(raw)}
    except ValueError:
        raise ValueError(f"{RETENTION_ENV}={raw!r}: give the telemetry retention in seconds") from None


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE … COMMIT, rolled back on any error. A failed COMMIT (a full disk, say) has
    already rolled back: a second ROLLBACK would raise "no transaction is active" and hide the error
    that names the problem, so it is issued only while a transaction is open."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _checked_retention(retention_s: Mapping[str, float]) -> dict[str, float]:
    for topic, seconds in retention_s.items():
        if topic == CONTROL:
            raise ValueError(f"{topic} cannot have a retention: the remediation lifecycle is folded from its "
                             "first event, and deleting any would lose plans and decisions")
        if not seconds > 0:  # also refuses NaN
            raise ValueError(f"retention of {topic} must be a positive number of seconds, got {seconds!r}")
    return dict(retention_s)


class EmbeddedBus(Bus):
    name = "embedded"

    def __init__(self, path: str | os.PathLike[str], retention_s: Mapping[str, float] | None = None) -> None:
        self.path = Path(path)
        self.retention_s = _checked_retention(_retention_from_env() if retention_s is None else retention_s)
        self._next_trim: dict[str, float] = {}  # monotonic time of each retained topic's next trim
        private_dir(self.path.parent)
        if not create_private_file(self.path):  # SQLite gives its -wal and -shm files the log's own mode
            for f in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                tighten(f)
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
            with _transaction(self._conn):
                for topic, rows in by_topic.items():
                    table = _table(topic)
                    (nxt,) = self._conn.execute(f"SELECT COALESCE(MAX(offset) + 1, 0) FROM {table}").fetchone()
                    self._conn.executemany(
                        f"INSERT INTO {table} (offset, key, value, ts) VALUES (?, ?, ?, ?)",
                        ((nxt + i, k, v, now) for i, (k, v) in enumerate(rows)),
                    )
            for topic in by_topic:
                if topic in self.retention_s and time.monotonic() >= self._next_trim.get(topic, 0.0):
                    self._next_trim[topic] = time.monotonic() + _TRIM_EVERY_FRACTION * self.retention_s[topic]
                    try:
                        self._trim(topic, now - self.retention_s[topic])
                    except sqlite3.Error as exc:  # the batch is durable: a failed trim must not fail the publish
                        log.warning("embedded bus %s: retention could not trim %s: %s", self.path, topic, exc)

    def trim(self, topic: str, older_than_s: float) -> int:
        """Delete the prefix of ``topic`` published before ``older_than_s`` (Unix time), keeping the
        newest record; returns how many records went. Publishing does this for topics with a
        retention; calling it directly is for operators and tests."""
        if topic == CONTROL:
            raise ValueError(f"{topic} cannot be trimmed: the remediation lifecycle is folded from its first event")
        with self._lock:
            self._ensure_topic(self._conn, topic)
            return self._trim(topic, older_than_s)

    def _trim(self, topic: str, older_than_s: float) -> int:
        table = _table(topic)
        first, last = self._conn.execute(f"SELECT MIN(offset), MAX(offset) FROM {table}").fetchone()
        if first is None:
            return 0
        # The first offset at or after the cutoff, by bisection: publish times rise with offsets,
        # up to how long a writer waited for the lock after reading the clock, which only moves
        # the cut by as much.
        lo, hi = first, last  # the newest record stays, whatever its age
        while lo < hi:
            mid = (lo + hi) // 2
            (ts,) = self._conn.execute(f"SELECT ts FROM {table} WHERE offset = ?", (mid,)).fetchone()
            if ts < older_than_s:
                lo = mid + 1
            else:
                hi = mid
        if lo == first:
            return 0
        with _transaction(self._conn):
            self._conn.execute(f"DELETE FROM {table} WHERE offset < ?", (lo,))
        return lo - first

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
        committed = {
            (t, p): o
            for t, p, o in self._conn.execute(
                "SELECT topic, part, next_offset FROM group_offsets WHERE grp = ?", (group,)
            )
        }
        self._pos = {tp: committed.get(tp, 0) for tp in self._partitions}
        self.lost_to_retention: dict[TopicPartition, int] = {}
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
                if rows[0][0] > self._pos[tp]:  # offsets are dense: only retention leaves a hole
                    self._lost(tp, rows[0][0])
                where = (tp.topic, tp.partition)
                out += [_record(Record, where + row) for row in rows]  # NamedTuple's own __new__ is a Python call
                self._pos[tp] = rows[-1][0] + 1
        self._next_topic = (self._next_topic + 1) % n
        return out

    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        positions = dict(self._pos if positions is None else positions)
        with _transaction(self._conn):
            self._conn.executemany(
                "INSERT INTO group_offsets (grp, topic, part, next_offset) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (grp, topic, part) DO UPDATE SET next_offset = excluded.next_offset",
                [(self.group, tp.topic, tp.partition, off) for tp, off in positions.items()],
            )

    def seek(self, positions: Mapping[TopicPartition, int]) -> None:
        for tp, off in positions.items():
            if tp not in self._pos:
                raise ValueError(f"cannot seek {tp}: this consumer reads {sorted(self._pos)}")
            if off < 0:
                raise ValueError(f"cannot seek {tp} to negative offset {off}")
            self._pos[tp] = off

    def _lost(self, tp: TopicPartition, first_held: int) -> None:
        lost = first_held - self._pos[tp]
        self.lost_to_retention[tp] = self.lost_to_retention.get(tp, 0) + lost
        log.warning("embedded bus %s: group %s lost %s offsets %d-%d of %s to retention (deleted before it "
                    "read them); continuing from %d", self._bus.path, self.group, f"{lost:,}", self._pos[tp],
                    first_held - 1, tp.topic, first_held)

    def seek_to_beginning(self) -> None:
        for tp in self._pos:  # the oldest record still held: nothing before it is a loss to report
            (first,) = self._conn.execute(f"SELECT MIN(offset) FROM {_table(tp.topic)}").fetchone()
            self._pos[tp] = first or 0

    def positions(self) -> dict[TopicPartition, int]:
        return dict(self._pos)

    def close(self) -> None:
        self._conn.close()
