"""The telemetry projections: chunks, rank iterations, iteration summaries, heartbeats, ranks.

Each is a fold of the log into DuckDB tables, applied by the Projector inside the transaction that
also stores the consumer's offsets, so a crash at any instant replays to identical tables. Rows go
in through Arrow: one pyarrow table per batch and table, registered into DuckDB and inserted with a
single ``INSERT ... SELECT`` (row-by-row inserts would cap ingestion at a few thousand rows/s).

``sum_sq_len`` (Σ lᵢ² of a chunk's packed sequences) is NULL when the source did not report
``seq_lens``; the cost model then falls back to what can be inferred (see analytics/detection/cost_model.py).
``tokens`` is NULL when the source did not report it (unknown, never 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import duckdb
import numpy as np
import pyarrow as pa

from analytics.detection.frame import sum_sq_lens, sum_sq_of
from collector.events import CommOp, Heartbeat, IterationSummary, RankIteration
from collector.rank_columns import joined, joined_seq_lens
from collector.stream import Delivery

CHUNK_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("iteration", pa.int64()), ("rank", pa.int32()),
    ("tp", pa.int32()), ("pp", pa.int32()), ("dp", pa.int32()), ("kind", pa.string()),
    ("microbatch", pa.int32()), ("virtual_stage", pa.int32()), ("tokens", pa.int64()),
    ("sum_sq_len", pa.float64()), ("n_seqs", pa.int32()), ("start_s", pa.float64()), ("duration_s", pa.float64()),
])

RANK_ITERATION_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("iteration", pa.int64()), ("rank", pa.int32()),
    ("wall_s", pa.float64()), ("compute_s", pa.float64()), ("tp_wait_s", pa.float64()),
    ("pp_wait_s", pa.float64()), ("dp_wait_s", pa.float64()), ("time_s", pa.float64()),
])

ITERATION_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("iteration", pa.int64()), ("tokens", pa.int64()),
    ("wall_s", pa.float64()), ("loss", pa.float64()), ("time_s", pa.float64()),
])

HEARTBEAT_SCHEMA = pa.schema([
    ("job", pa.string()), ("rank", pa.int32()), ("epoch", pa.int32()), ("iteration", pa.int64()),
    ("interval_s", pa.float64()), ("time_s", pa.float64()), ("source", pa.string()),
])

RANK_SCHEMA = pa.schema([
    ("job", pa.string()), ("epoch", pa.int32()), ("rank", pa.int32()), ("node", pa.int32()),
    ("tp", pa.int32()), ("pp", pa.int32()), ("dp", pa.int32()), ("first_iteration", pa.int64()),
])

_DDL = (
    "CREATE TABLE IF NOT EXISTS chunks (job VARCHAR, epoch INTEGER, iteration BIGINT, rank INTEGER, tp INTEGER, "
    "pp INTEGER, dp INTEGER, kind VARCHAR, microbatch INTEGER, virtual_stage INTEGER, tokens BIGINT, "
    "sum_sq_len DOUBLE, n_seqs INTEGER, start_s DOUBLE, duration_s DOUBLE)",
    "CREATE TABLE IF NOT EXISTS rank_iterations (job VARCHAR, epoch INTEGER, iteration BIGINT, rank INTEGER, "
    "wall_s DOUBLE, compute_s DOUBLE, tp_wait_s DOUBLE, pp_wait_s DOUBLE, dp_wait_s DOUBLE, time_s DOUBLE)",
    "CREATE TABLE IF NOT EXISTS iterations (job VARCHAR, epoch INTEGER, iteration BIGINT, tokens BIGINT, "
    "wall_s DOUBLE, loss DOUBLE, time_s DOUBLE)",
    "CREATE TABLE IF NOT EXISTS heartbeats (job VARCHAR, rank INTEGER, epoch INTEGER, iteration BIGINT, "
    "interval_s DOUBLE, time_s DOUBLE, source VARCHAR)",
    "CREATE TABLE IF NOT EXISTS ranks (job VARCHAR NOT NULL, epoch INTEGER NOT NULL, rank INTEGER NOT NULL, "
    "node INTEGER, tp INTEGER, pp INTEGER, dp INTEGER, first_iteration BIGINT, PRIMARY KEY (job, epoch, rank))",
)


def insert_arrow(conn: duckdb.DuckDBPyConnection, table: str, batch: pa.Table, *, upsert_key: str | None = None,
                 order_by: str | None = None) -> None:
    """Insert one Arrow batch with one statement. ``upsert_key`` (a column list) turns it into an
    insert-if-absent that keeps, per key, the first row of the batch in ``order_by`` order (so the
    result does not depend on how records were split into batches) and never overwrites an older row."""
    if batch.num_rows == 0:
        return
    view = f"_batch_{table}"
    conn.register(view, batch)
    try:
        if upsert_key is None:
            conn.execute(f"INSERT INTO {table} SELECT * FROM {view}")
        else:
            conn.execute(
                f"INSERT INTO {table} SELECT * FROM (SELECT DISTINCT ON ({upsert_key}) * FROM {view} "
                f"ORDER BY {upsert_key}{', ' + order_by if order_by else ''}) ON CONFLICT DO NOTHING"
            )
    finally:
        conn.unregister(view)


class TelemetryProjection:
    """chunks, rank_iterations, iterations, heartbeats and ranks, from the telemetry topic."""

    tables: tuple[str, ...] = ("chunks", "rank_iterations", "iterations", "heartbeats", "ranks")

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        for ddl in _DDL:
            conn.execute(ddl)

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        reports: list[tuple[str, RankIteration]] = []
        ri: dict[str, list] = {n: [] for n in RANK_ITERATION_SCHEMA.names}
        it: dict[str, list] = {n: [] for n in ITERATION_SCHEMA.names}
        hb: dict[str, list] = {n: [] for n in HEARTBEAT_SCHEMA.names}
        rk: dict[str, list] = {n: [] for n in RANK_SCHEMA.names}
        for d in deliveries:
            e = d.event
            p = e.payload
            if isinstance(p, RankIteration):
                reports.append((e.job, p))
                _add_rank_iteration(ri, rk, e.job, e.time_s, p)
            elif isinstance(p, Heartbeat):
                for name, value in zip(HEARTBEAT_SCHEMA.names,
                                       (e.job, p.rank, p.epoch, p.iteration, p.interval_s, e.time_s, e.source)):
                    hb[name].append(value)
            elif isinstance(p, IterationSummary):
                for name, value in zip(ITERATION_SCHEMA.names,
                                       (e.job, p.epoch, p.iteration, p.tokens, p.wall_s, p.loss, e.time_s)):
                    it[name].append(value)
        insert_arrow(conn, "chunks", chunk_rows(reports))
        insert_arrow(conn, "rank_iterations", pa.Table.from_pydict(ri, schema=RANK_ITERATION_SCHEMA))
        insert_arrow(conn, "iterations", pa.Table.from_pydict(it, schema=ITERATION_SCHEMA))
        insert_arrow(conn, "heartbeats", pa.Table.from_pydict(hb, schema=HEARTBEAT_SCHEMA))
        insert_arrow(conn, "ranks", pa.Table.from_pydict(rk, schema=RANK_SCHEMA), upsert_key="job, epoch, rank",
                     order_by="first_iteration")


def chunk_rows(reports: Sequence[tuple[str, RankIteration]]) -> pa.Table:
    """The chunks of every (job, report) as one Arrow table. Reports read from the bus hold their
    columns as arrays (collector/rank_columns.py): those are joined, with no Python value per
    chunk; reports built in the process or read from JSON are read value by value."""
    tables = [p.chunk_table for _, p in reports]
    counts = np.fromiter((len(t.kind) for t in tables), np.int64, len(tables))
    total = int(counts.sum())

    def per_report(values: list, dtype: type | str) -> np.ndarray:
        return np.repeat(np.array(values, dtype=dtype), counts)

    lens = joined_seq_lens([t.seq_lens for t in tables])
    if lens is None:
        listed = list(itertools.chain.from_iterable(t.seq_lens for t in tables))
        sum_sq = sum_sq_lens(listed)
        n_seqs = np.fromiter((-1 if x is None else len(x) for x in listed), np.int64, total)
    else:
        sum_sq, n_seqs = sum_sq_of(*lens), lens[1]
    tokens = joined([t.tokens for t in tables], float, total, unknown=np.nan)
    columns = {
        "job": pa.array(per_report([job for job, _ in reports], object), pa.string()),
        "epoch": per_report([p.epoch for _, p in reports], np.int32),
        "iteration": per_report([p.iteration for _, p in reports], np.int64),
        "rank": per_report([p.rank for _, p in reports], np.int32),
        "tp": per_report([p.coords.tp for _, p in reports], np.int32),
        "pp": per_report([p.coords.pp for _, p in reports], np.int32),
        "dp": per_report([p.coords.dp for _, p in reports], np.int32),
        "kind": pa.array(list("".join(t.kind for t in tables)), pa.string()),
        "microbatch": joined([t.microbatch for t in tables], np.int32, total),
        "virtual_stage": joined([t.virtual_stage for t in tables], np.int32, total),
        "tokens": pa.array(np.nan_to_num(tokens, nan=0).astype(np.int64), pa.int64(), mask=np.isnan(tokens)),
        "sum_sq_len": pa.array(sum_sq, pa.float64(), from_pandas=True),  # NaN -> NULL
        "n_seqs": pa.array(np.maximum(n_seqs, 0).astype(np.int32), pa.int32(), mask=n_seqs < 0),
        "start_s": joined([t.start_s for t in tables], np.float64, total),
        "duration_s": joined([t.duration_s for t in tables], np.float64, total),
    }
    return pa.Table.from_pydict(columns, schema=CHUNK_SCHEMA)


def _add_rank_iteration(ri: dict[str, list], rk: dict[str, list], job: str, time_s: float, p: RankIteration) -> None:
    c = p.coords
    compute_s = sum(p.chunk_table.duration_s)
    value: object  # a column's value: the rows hold text and numbers
    waits = dict.fromkeys(CommOp, 0.0)  # the other collectives (all-gather, ...) have no column of their own
    comm = p.waits()
    for op, duration in zip(comm.op, comm.duration_s):
        waits[op] += duration
    pp_wait_s = waits[CommOp.PP_SEND] + waits[CommOp.PP_RECV] + waits[CommOp.PP_SENDRECV]
    for col, value in (("job", job), ("epoch", p.epoch), ("iteration", p.iteration), ("rank", p.rank),
                       ("wall_s", p.wall_s), ("compute_s", compute_s), ("tp_wait_s", waits[CommOp.TP_ALLREDUCE]),
                       ("pp_wait_s", pp_wait_s), ("dp_wait_s", waits[CommOp.DP_ALLREDUCE]),
                       ("time_s", time_s)):
        ri[col].append(value)
    for col, value in (("job", job), ("epoch", p.epoch), ("rank", p.rank), ("node", p.node), ("tp", c.tp),
                       ("pp", c.pp), ("dp", c.dp), ("first_iteration", p.iteration)):
        rk[col].append(value)
