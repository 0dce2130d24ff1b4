"""The detector inside the projector's transaction: exactly-once detection and publication.

The detector is stateful, so for a crash to replay to the same incidents its state must move with
the offsets. This projection runs the detectors (one per job) on every batch and, in the same
DuckDB transaction as the rows and offsets, stores (1) each detector's pickled state and (2) the
events it produced in an outbox. After the commit the outbox is published and emptied. A crash
before the commit loses nothing (the batch is re-read and re-detected from the old state); a crash
after publishing but before emptying the outbox publishes the same events again, with the same
ids (they are derived from the job and a counter kept in the state), which consumers dedupe.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Sequence

import duckdb
import pyarrow as pa

from analytics.detector import Detector
from analytics.detector_config import DetectorConfig
from analytics.tables import insert_arrow
from collector.bus import Bus
from collector.codec import decode, encode
from collector.events import EventFactory, Payload
from collector.stream import Delivery

_NS = uuid.UUID("a3b7e5d1-2c4f-4e8a-9b6d-7f1e3c5a9d20")
SOURCE = "analytics"
_OUTBOX_SCHEMA = pa.schema([("seq", pa.int64()), ("event", pa.binary())])


class DetectorProjection:
    tables = ("detector_state", "detector_outbox")

    def __init__(self, config_path: str | None = None, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig.load(config_path)
        self.detectors: dict[str, Detector] = {}
        self.emitted: dict[str, int] = {}
        self._outbox_seq = 0

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS detector_state (job VARCHAR PRIMARY KEY, emitted BIGINT, "
                     "state BLOB)")
        conn.execute("CREATE TABLE IF NOT EXISTS detector_outbox (seq BIGINT PRIMARY KEY, event BLOB)")
        for job, emitted, state in conn.execute("SELECT job, emitted, state FROM detector_state").fetchall():
            self.detectors[job] = pickle.loads(state)
            self.emitted[job] = emitted
        (top,) = conn.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM detector_outbox").fetchone()
        self._outbox_seq = top

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        rows: dict[str, list] = {"seq": [], "event": []}
        touched: set[str] = set()
        for d in deliveries:
            e = d.event
            if e.source == SOURCE:
                continue  # our own output, read back from the analytics topic
            det = self.detectors.get(e.job)
            if det is None:
                det = self.detectors[e.job] = Detector(e.job, self.config)
                self.emitted[e.job] = 0
            payloads = det.on_event(e)
            if payloads:
                touched.add(e.job)
                for p in payloads:
                    rows["seq"].append(self._outbox_seq)
                    rows["event"].append(encode(self._envelope(e.job, p, e.time_s)))
                    self._outbox_seq += 1
            elif e.kind.startswith("telemetry"):
                touched.add(e.job)
        insert_arrow(conn, "detector_outbox", pa.Table.from_pydict(rows, schema=_OUTBOX_SCHEMA))
        for job in touched:
            conn.execute("INSERT OR REPLACE INTO detector_state VALUES (?, ?, ?)",
                         [job, self.emitted[job], pickle.dumps(self.detectors[job], protocol=pickle.HIGHEST_PROTOCOL)])

    def _envelope(self, job: str, payload: Payload, time_s: float):
        n = self.emitted[job]
        self.emitted[job] = n + 1
        event_id = uuid.uuid5(_NS, f"{job}/{n}").hex
        return EventFactory(job, SOURCE, first_seq=n).make(payload, time_s=time_s, event_id=event_id)

    def flush_outbox(self, conn: duckdb.DuckDBPyConnection, bus: Bus) -> int:
        """Publish what committed transactions produced, then forget it; returns how many."""
        rows = conn.execute("SELECT seq, event FROM detector_outbox ORDER BY seq").fetchall()
        if not rows:
            return 0
        bus.publish([decode(bytes(raw)) for _, raw in rows])
        conn.execute("DELETE FROM detector_outbox WHERE seq <= ?", [rows[-1][0]])
        return len(rows)
