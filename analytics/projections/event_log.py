"""The simplest projection: every event, one row each, with where it came from.

It is what ``resihp analytics`` always keeps (the richer tables of the detector sit beside it), and
it is how the platform proves that nothing published was lost: the count of telemetry events in
DuckDB is compared with the count published. Rows go in through Arrow, one batch per transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pyarrow as pa

from collector.events import ENVELOPE_HEADER
from collector.stream import Delivery

_SCHEMA = pa.schema(
    [
        ("id", pa.string()), ("kind", pa.string()), ("schema_version", pa.int32()), ("job", pa.string()),
        ("source", pa.string()), ("seq", pa.int64()), ("time_s", pa.float64()), ("topic", pa.string()),
        ("part", pa.int32()), ("log_offset", pa.int64()), ("payload", pa.string()),
    ]
)


class EventLogProjection:
    tables: tuple[str, ...] = ("events",)

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS events (id VARCHAR, kind VARCHAR, schema_version INTEGER, job VARCHAR, "
            "source VARCHAR, seq BIGINT, time_s DOUBLE, topic VARCHAR, part INTEGER, log_offset BIGINT, payload JSON)"
        )

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        cols: dict[str, list] = {name: [] for name in _SCHEMA.names}
        for d in deliveries:
            e = d.event
            for name in ENVELOPE_HEADER:
                cols[name].append(getattr(e, name))
            cols["topic"].append(d.topic)
            cols["part"].append(d.partition)
            cols["log_offset"].append(d.offset)
            cols["payload"].append(e.payload.model_dump_json())
        batch = pa.Table.from_pydict(cols, schema=_SCHEMA)
        conn.register("event_batch", batch)
        try:
            conn.execute("INSERT INTO events SELECT * FROM event_batch")
        finally:
            conn.unregister("event_batch")
