"""The detector inside the projector's transaction: exactly-once detection and publication.

The detector is stateful, so for a crash to replay to the same incidents its state must move with
the offsets. This projection runs the detectors (one per job) on every batch and, in the same
DuckDB transaction as the rows and offsets, stores (1) each detector's pickled state and (2) the
events it produced in an outbox. After the commit the outbox is published and emptied. A crash
before the commit loses nothing (the batch is re-read and re-detected from the old state); a crash
after publishing but before emptying the outbox publishes the same events again, with the same
ids (they are derived from the job and a counter kept in the state), which consumers dedupe.

A restart restores each job's detector under the config the consumer was started with
(``Detector.retune``). State pickled by a build with another ``STATE_VERSION``, or that this build
cannot unpickle, is refused with ``DetectorStateError`` naming the job and the way out: replaying
the log (``resihp analytics --rebuild``) rebuilds every table and the detectors with this build.

No record stops the consumer. The projector hands this projection each event id once, so a replay
or a republished record never re-folds. The detector keeps arrays indexed by device id and by
pipeline coordinates, so an event whose numbers no real job has (:func:`undetectable` says which:
a device id or coordinate of a million or more, more pipeline stages than a million devices hold)
goes to the tables but not to the detector, and is counted in ``skipped``; so does a report that
would make one iteration's arrays exceed ``MAX_CELLS`` (replicas × stages × virtual stages ×
micro-batch span). The shapes admitted are kept in memory only: after a restart they are learned
again. An event the detector still fails on (or whose output the contract refuses: a non-finite
factor) is logged and dead-lettered through the outbox with the reason, and the consumer goes on.
"""

from __future__ import annotations

import logging
import pickle
import uuid
from collections.abc import Sequence

import duckdb
import pyarrow as pa

from analytics.detection.detector import STATE_VERSION, Detector
from analytics.detection.admission import EpochShape, undetectable
from analytics.detection.config import DetectorConfig
from analytics.projections.tables import insert_arrow
from collector.auth import Signer, load_keyring
from collector.bus import Bus
from collector.codec import dead_letter, decode, encode
from collector.events import (
    Envelope, EventFactory, Payload,
)
from collector.stream import Delivery

_NS = uuid.UUID("a3b7e5d1-2c4f-4e8a-9b6d-7f1e3c5a9d20")
SOURCE = "analytics"
_OUTBOX_SCHEMA = pa.schema([("seq", pa.int64()), ("event", pa.binary())])
_REBUILD = "stop this consumer and replay the log with this build: resihp analytics --rebuild"
log = logging.getLogger(__name__)


class DetectorStateError(RuntimeError):
    """Stored detector state this build cannot go on from."""


class DetectorProjection:
    tables: tuple[str, ...] = ("detector_state", "detector_outbox")

    def __init__(self, config_path: str | None = None, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig.load(config_path)
        self.detectors: dict[str, Detector] = {}
        self.emitted: dict[str, int] = {}
        self._outbox_seq = 0
        self._keyring = load_keyring()  # incidents, probe requests and cost models go out signed as analytics
        self._stages: dict[tuple[str, int], EpochShape] = {}
        self.skipped = 0  # events with numbers no real job has, kept from the detector
        self.failed = 0  # events the detector failed on, dead-lettered

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS detector_state (job VARCHAR PRIMARY KEY, emitted BIGINT, "
                     "state BLOB)")
        conn.execute("ALTER TABLE detector_state ADD COLUMN IF NOT EXISTS version INTEGER")  # NULL: before versions, 1
        conn.execute("CREATE TABLE IF NOT EXISTS detector_outbox (seq BIGINT PRIMARY KEY, event BLOB)")
        rows = conn.execute("SELECT job, emitted, state, COALESCE(version, 1) FROM detector_state").fetchall()
        for job, emitted, state, version in rows:
            self.detectors[job] = self._restore(job, bytes(state), version)
            self.emitted[job] = emitted
        (self._outbox_seq,) = conn.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM detector_outbox").fetchall()[0]

    def _restore(self, job: str, state: bytes, version: int) -> Detector:
        if version != STATE_VERSION:
            raise DetectorStateError(f"the stored detector state of job {job!r} has layout version {version}; "
                                     f"this build reads version {STATE_VERSION}: {_REBUILD}")
        try:
            detector = pickle.loads(state)
        except Exception as exc:  # whatever unpickling raises, the remedy is the same
            raise DetectorStateError(f"the stored detector state of job {job!r} cannot be read by this build "
                                     f"({type(exc).__name__}: {exc}): {_REBUILD}") from exc
        if not isinstance(detector, Detector):
            raise DetectorStateError(f"the stored detector state of job {job!r} is a {type(detector).__name__}, "
                                     f"not a Detector: {_REBUILD}")
        if detector.config != self.config:
            log.info("job %s: the restored detector goes on under this consumer's detector config", job)
        try:
            detector.retune(self.config)
        except ValueError as exc:
            raise DetectorStateError(str(exc)) from exc
        return detector

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        rows: dict[str, list] = {"seq": [], "event": []}
        touched: set[str] = set()
        for d in deliveries:
            e = d.event
            if e.source == SOURCE:
                continue  # our own output, read back from the analytics topic
            why = undetectable(e, self._stages)
            if why is not None:
                self.skipped += 1
                log.warning("job %s: event %s (%s) is kept from the detector: %s", e.job, e.id, e.kind, why)
                continue
            det = self.detectors.get(e.job)
            if det is None:
                det = self.detectors[e.job] = Detector(e.job, self.config)
                self.emitted[e.job] = 0
            try:
                encoded = [encode(self._envelope(e.job, p, e.time_s)) for p in det.on_event(e)]
            except Exception as exc:  # one event must not stop the consumer (module docstring)
                self.failed += 1
                log.exception("job %s: the detector failed on event %s (%s); it is dead-lettered", e.job, e.id, e.kind)
                encoded = [self._dead_letter(d, exc)]
            if encoded or e.kind.startswith("telemetry"):
                touched.add(e.job)
            for raw in encoded:
                rows["seq"].append(self._outbox_seq)
                rows["event"].append(raw)
                self._outbox_seq += 1
        insert_arrow(conn, "detector_outbox", pa.Table.from_pydict(rows, schema=_OUTBOX_SCHEMA))
        for job in touched:
            conn.execute("INSERT OR REPLACE INTO detector_state (job, emitted, state, version) VALUES (?, ?, ?, ?)",
                         [job, self.emitted[job], pickle.dumps(self.detectors[job], protocol=pickle.HIGHEST_PROTOCOL),
                          STATE_VERSION])

    def _envelope(self, job: str, payload: Payload, time_s: float):
        n = self.emitted[job]
        self.emitted[job] = n + 1
        event_id = uuid.uuid5(_NS, f"{job}/{n}").hex
        return Signer(EventFactory(job, SOURCE, first_seq=n), "analytics", self._keyring).make(
            payload, time_s=time_s, event_id=event_id)

    def _dead_letter(self, d: Delivery, exc: BaseException) -> bytes:
        reason = f"the detector failed on this event: {type(exc).__name__}: {' '.join(str(exc).split())}"
        payload = dead_letter(d.topic, d.partition, d.offset, "analytics-detector", reason,
                              d.event.model_dump_json().encode())
        event_id = uuid.uuid5(_NS, f"deadletter/{d.event.id}").hex
        return encode(EventFactory(d.event.job, SOURCE).make(payload, time_s=d.event.time_s, event_id=event_id))

    def enqueue(self, conn: duckdb.DuckDBPyConnection, events: Sequence[Envelope]) -> None:
        """Add events another part of the transaction produced (the projector's ``control.rejected``)
        to the outbox, to be published with the detector's own after the commit."""
        seqs = list(range(self._outbox_seq, self._outbox_seq + len(events)))
        self._outbox_seq += len(events)
        insert_arrow(conn, "detector_outbox", pa.Table.from_pydict(
            {"seq": seqs, "event": [encode(e) for e in events]}, schema=_OUTBOX_SCHEMA))

    def flush_outbox(self, conn: duckdb.DuckDBPyConnection, bus: Bus) -> int:
        """Publish what committed transactions produced, then forget it; returns how many."""
        rows = conn.execute("SELECT seq, event FROM detector_outbox ORDER BY seq").fetchall()
        if not rows:
            return 0
        bus.publish([decode(bytes(raw)) for _, raw in rows])
        conn.execute("DELETE FROM detector_outbox WHERE seq <= ?", [rows[-1][0]])
        return len(rows)

    def discard_outbox(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Forget what committed transactions produced without publishing it: another consumer
        holds the bus (analytics/service/lease.py), and it publishes the same incidents."""
        conn.execute("DELETE FROM detector_outbox")
