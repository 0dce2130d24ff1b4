"""The operators' figures inside the analytics consumer's transaction: the goodput fold
(``collector/goodput.py``) and each job's rank-health summary, stored with the offsets.

The state of every job the batch touched is written as JSON in the same DuckDB transaction as the
projector's positions, so a consumer that restarts (or crashes anywhere) goes on from exactly the
counters it had published: a scrape never sees a loss counter go back. ``--rebuild`` drops the table
and replays the log: the counters start again from zero, which Prometheus reads as a counter reset
(as it does for any process restart).

Each batch is folded in event-time order (stable), so an incident published on the analytics topic
and the heartbeats that led to it are charged in the order they happened even when one poll hands
over the topics one after another. After each commit :meth:`snapshot` is what the exporter renders.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb

from collector.goodput import Goodput, GoodputFold, OpenIncident
from collector.events import RankHealth
from collector.stream import Delivery

# Upper bounds of the rank slowdown-factor histogram (1.0 is healthy; dead ranks are counted apart).
FACTOR_BUCKETS: tuple[float, ...] = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, float("inf"))


@dataclass(frozen=True)
class JobFigures:
    """Everything the exporter shows for one job, taken after one committed transaction."""

    job: str
    goodput: Goodput | None
    incidents: dict[str, OpenIncident]
    awaiting_since_s: tuple[float, ...]
    observed_s: float | None
    predicted_s: float | None
    stages: tuple[tuple[int, int, float, float], ...]  # (replica, stage, observed_s, predicted_s), the newest iteration's
    iterations: int
    tokens: int
    ranks_by_state: dict[str, int]
    factor_buckets: tuple[int, ...]  # cumulative counts per FACTOR_BUCKETS bound, ranks not dead
    factor_sum: float
    slow_ranks: dict[int, float]  # ranks the detector calls slow (bounded by the open incidents' ranks)


@dataclass
class _Health:
    ranks_by_state: dict[str, int] = field(default_factory=dict)
    factor_buckets: list[int] = field(default_factory=lambda: [0] * len(FACTOR_BUCKETS))
    factor_sum: float = 0.0
    slow_ranks: dict[int, float] = field(default_factory=dict)


_MAX_SLOW_RANKS = 256  # per job: per-rank series only for the ranks an incident names, and never more


def _health_of(p: RankHealth) -> _Health:
    h = _Health()
    for entry in p.entries():
        state = entry.state.value
        h.ranks_by_state[state] = h.ranks_by_state.get(state, 0) + 1
        if state == "dead" or state == "not_traced":
            continue
        h.factor_sum += entry.factor
        for i, bound in enumerate(FACTOR_BUCKETS):
            if entry.factor <= bound:
                h.factor_buckets[i] += 1
        if state == "slow" and len(h.slow_ranks) < _MAX_SLOW_RANKS:
            h.slow_ranks[entry.rank] = entry.factor
    return h


class GoodputProjection:
    tables: tuple[str, ...] = ("goodput_state",)

    def __init__(self) -> None:
        self.fold = GoodputFold()
        self.health: dict[str, _Health] = {}

    def create(self, conn: duckdb.DuckDBPyConnection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS goodput_state (job VARCHAR PRIMARY KEY, fold JSON, health JSON)")
        for job, fold, health in conn.execute("SELECT job, fold, health FROM goodput_state").fetchall():
            self.fold.load_state(job, json.loads(fold))
            h = json.loads(health)
            self.health[job] = _Health(h["ranks_by_state"], h["factor_buckets"], h["factor_sum"],
                                       {int(k): v for k, v in h["slow_ranks"].items()})

    def apply(self, conn: duckdb.DuckDBPyConnection, deliveries: Sequence[Delivery]) -> None:
        touched: set[str] = set()
        for d in sorted(deliveries, key=lambda d: d.event.time_s):
            e = d.event
            if e.kind == "telemetry.iteration":
                continue
            self.fold.apply(e)
            if isinstance(e.payload, RankHealth):
                self.health[e.job] = _health_of(e.payload)
            if e.job in self.fold.jobs:  # events that are no part of a job's time (ui.*, leases) start none
                touched.add(e.job)
        for job in touched:
            h = self.health.get(job, _Health())
            conn.execute("INSERT OR REPLACE INTO goodput_state VALUES (?, ?, ?)",
                         [job, json.dumps(self.fold.to_state(job)), json.dumps(h.__dict__)])

    def jobs(self) -> list[str]:
        return sorted(self.fold.jobs)

    def snapshot(self) -> dict[str, JobFigures]:
        """Immutable figures of every job (what one scrape renders)."""
        out = {}
        for job, s in self.fold.jobs.items():
            h = self.health.get(job, _Health())
            out[job] = JobFigures(
                job=job, goodput=self.fold.breakdown(job),
                incidents={k: OpenIncident(**v.__dict__) for k, v in s.incidents.items()},
                awaiting_since_s=tuple(t for t, _ in s.awaiting.values()),
                observed_s=s.last_observed_s, predicted_s=s.last_predicted_s,
                stages=tuple((int(r), int(st), o, p) for r, st, o, p in s.last_stages), iterations=s.iterations,
                tokens=s.tokens, ranks_by_state=dict(h.ranks_by_state), factor_buckets=tuple(h.factor_buckets),
                factor_sum=h.factor_sum, slow_ranks=dict(h.slow_ranks))
        return out
