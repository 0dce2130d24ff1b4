"""Fail-stop: a rank whose heartbeats stop, or whose telemetry stops, judged in event time.

Every rank's events reach the detector through its own ordered stream (on Kafka one partition per
key, ``job/rank-N``), but different streams arrive unevenly: one partition can be a dozen
iterations ahead of another. So nothing here uses the order in which streams interleave, nor this
process's clock. Each rank has a *watermark* — the newest event time seen from its own stream — and
a rank is judged against the others' progress:

- **Heartbeats**: rank r is dead when its last heartbeat is more than ``heartbeat_miss_intervals``
  intervals older than the job's reference time, the lower third (``REFERENCE_QUANTILE``) of the
  watched ranks' watermarks. A low quantile, not the newest: when a group of partitions lags, the
  reference lags with it, so the lagging ranks are not called dead; when a node dies (a quarter of
  a 32-GPU job, say) the reference still comes from the living. When a third or more of the job
  dies at once (a node of a two-node job), the lower third is the dead ranks' own time; so, where
  the plan places ranks on nodes, a late rank is judged against the other nodes' progress
  (``_row_references_s``), and otherwise the reference never trails the newest watermark by more
  than ``reference_max_lag_intervals`` intervals, which bounds how long any dead set can go unjudged.
- **Hung job**: a dead rank stalls a synchronous job, and a stall is itself evidence. When no
  iteration of the newest epoch completed for ``hang_stall_iterations`` typical iterations (and at
  least one heartbeat interval) of the job's progress, a rank is dead after
  ``hang_miss_intervals`` missed intervals instead of ``heartbeat_miss_intervals``: the others'
  heartbeats say they are waiting, and the one that stopped is what they wait for. Not while a
  newer plan than the newest reporting epoch has been announced: a reshape's pause is a stall
  with a reason, and heartbeats may be late through it (ranks restarting their groups). This halves
  the time a dead rank holds the job before remediation can start.
- **Proof of life**: a synchronous job cannot finish iteration j+1 unless every rank of the plan
  finished j. So if peers of r's epoch reported iteration ≥ k+2 while r's stream only got to k,
  r's events are late (its partition lags), not missing: r is not judged dead, however old its
  last delivered heartbeat is. This is what makes a lagging partition harmless.
- **Behind its peers' epoch**: a reshape is collective, so when peers' streams already show a
  newer epoch (their heartbeats through the reshape's pause, before any report of it, and before
  the new plan arrives on the control topic) a rank whose stream is still in an older epoch is
  lagging, and no peer can prove it alive until the new epoch completes iterations. Its heartbeats
  are then judged with ``reference_max_lag_intervals`` (the bound on how long any lag is ridden
  out), not the ordinary miss; and heartbeats of a newer epoch than any report make the job count
  as pausing to reshape, not hung. Without this, a lagging partition across a reshape read as a
  dead rank.
- **Telemetry stopped**: r's *own* stream moved on (a heartbeat that says it started iteration
  ≥ i+2, or a report of a later iteration) without a report of i, ``telemetry_lag_iterations``
  times in a row: its reports are being lost. Sources without heartbeats fall back to the frames
  the detector had to score without them (``missing``).

- **Sampled tracing**: a producer that records only some ranks or some steps says so
  (``TracingDeclared``, routed here by ``declare``). A declared-untraced rank is never judged dead
  for missing telemetry (nothing is expected of it) and is kept watched across a new epoch, so its
  heartbeats, if it sends any, still count. Gaps between traced steps are not a stall: the hung-job
  threshold stretches by ``step_every``.

- **Clocks**: an event's time is believed only within a bounded skew of what had arrived before
  it: at most ``reference_max_lag_intervals`` heartbeat intervals ahead of the newer of the rank's
  own watermark and the job's newest. A heartbeat (or report) stamped further in the future is not
  believed — it would drag the job's reference ahead and make every other rank look dead — unless
  a third of the watched ranks corroborate the jump (a job resuming after downtime moves all its
  clocks at once); it is counted (``untrusted_times``) and logged, and never judges anybody. A
  heartbeat stamped in the past never moves a rank's last heartbeat back nor revives a dead rank.
- **Bus outages**: ``suspend`` while the bus client cannot reach the log, and until this consumer
  has caught up after it (analytics/service/consumer.py decides, from the bus client's own
  connection errors): nothing is judged dead meanwhile, since what is missing is the bus, not the
  ranks. ``resume`` then counts every live rank as heard at the job's reference time, so a rank
  that died during the outage is named ``heartbeat_miss_intervals`` after it, and one whose
  producer reconnects a little later than the others' is not.

- **Batches**: the sharded merge receives every rank's heartbeats and report progress from the
  shards (analytics/sharding/merge.py) and applies them as arrays (``ingest``): per rank what its rows leave,
  then one judgement if one is due. The same rules, checked to hold before anything is applied
  (every time believable, no dead rank revived, no interval changed); a batch that needs the
  one-by-one rules for any row goes event by event. A rank is named at the end of the batch.

What can go wrong: while the job hangs (nobody progresses, so there is no proof of life) a live
rank whose partition lags the others by more than the hung threshold looks dead until its
heartbeats arrive; it is then revived (``alive``) and its incident resolved.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from analytics.detection.config import DetectorConfig
from analytics.detection.rank_streams import RankStreams
from collector.events import Heartbeat, TracingDeclared

REFERENCE_QUANTILE = 1 / 3
log = logging.getLogger(__name__)


def tracing_at(declarations: tuple[TracingDeclared, ...], epoch: int) -> TracingDeclared | None:
    """The declaration in force at ``epoch``: the newest declared at or before it (a producer
    declares at start and when it changes; a reshape alone does not re-declare). None: all traced."""
    best = None
    for d in declarations:
        if d.epoch <= epoch and (best is None or d.epoch >= best.epoch):
            best = d
    return best


@dataclass(frozen=True)
class LivenessChange:
    rank: int
    alive: bool
    reason: str
    iteration: int = 0  # event-derived: the rank's last known iteration + 1 (dead), or where it came back


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of an array that holds few (epochs), without sorting or hashing it."""
    if not len(values):
        return []
    lo, hi = int(values.min()), int(values.max())
    return [lo] if lo == hi else np.unique(values).tolist()


@dataclass
class FailStopWatch:
    config: DetectorConfig
    dead: set[int] = field(default_factory=set)
    table: RankStreams = field(default_factory=RankStreams)  # every rank's stream (analytics/detection/rank_streams.py)
    _epoch_top: dict[int, int] = field(default_factory=dict)  # epoch -> newest iteration any rank reported
    _top_time_s: dict[int, float] = field(default_factory=dict)  # epoch -> event time its top was first reported
    _iteration_s: float | None = None  # typical event time between iterations of the newest epoch
    _watched_n: int = 0  # rows watched (the table's ``watched`` column, counted)
    _next_check_s: float = float("-inf")
    _events_since_check: int = 0
    _newest_plan: tuple[int, set[int]] | None = None  # (epoch, devices) of the newest plan announced
    _deadline_s: float = float("inf")  # the reference beyond which the next rank would be judged dead
    _short_of_deadline: int = 0  # live watched streams still to pass _deadline_s before the reference can
    _interval_cache_s: float | None = None  # _interval_s(), until a stream's announced interval changes
    _heard_epoch: int = -1  # the newest epoch any stream showed (a heartbeat's included)
    heartbeating: int = 0  # streams that delivered a heartbeat so far
    suspended: bool = False  # a bus outage: judge nobody until resume()
    untrusted_times: int = 0  # events whose time was not believed (too far ahead of the job's)
    _newest_s: float = float("-inf")  # the newest believed event time of any stream
    # Immutable with a class-level default, so a detector pickled before declarations existed restores.
    tracing: tuple[TracingDeclared, ...] = ()  # every TracingDeclared seen, oldest first
    gpus_per_node: int | None = None  # from plan.current: a node's devices are consecutive ids (None: unknown)

    @property
    def watched(self) -> set[int]:
        """The running plan's ranks (or those heard from)."""
        t = self.table
        return set(t.rank[t.watched].tolist())

    def _watch(self, i: int) -> None:
        c = self.table.cols
        if not c["watched"][i] and not c["retired"][i]:
            c["watched"][i] = True
            self._watched_n += 1

    def _live(self) -> np.ndarray:
        """Rows of watched live ranks whose streams delivered something: the job's progress."""
        t = self.table
        live = t.watched & t.heard
        if self.dead:
            live &= ~t.mask(self.dead)
        return live

    # ---- input ----------------------------------------------------------------------------------

    def heartbeat(self, hb: Heartbeat, time_s: float) -> list[LivenessChange]:
        i = self.table.row(hb.rank)
        c = self.table.cols
        c["heard"][i] = True
        if not self._believable(hb.rank, i, time_s, "heartbeat"):
            return []
        self._advance(hb.rank, i, hb.epoch, time_s)
        last = float(c["hb_time_s"][i])
        had = not math.isnan(last)
        self._interval_changed(float(c["hb_interval_s"][i]) if had else None, hb.interval_s)
        if not had:
            self.heartbeating += 1
        newer = not had or time_s > last
        if newer:
            c["hb_time_s"][i] = time_s
        c["hb_interval_s"][i] = hb.interval_s
        if hb.epoch == c["epoch"][i] and hb.iteration > c["started"][i]:
            c["started"][i] = hb.iteration
        self._watch(i)
        revived = self._revive(hb.rank, i, "heartbeats resumed") if newer else []
        return revived + self._maybe_check(time_s)

    def _interval_changed(self, old_s: float | None, new_s: float) -> None:
        """Keep ``_interval_s``'s cache: the minimum falls with a shorter interval; it may rise
        only when a stream that held it announces a longer one (then it is walked again)."""
        cached = self._interval_cache_s
        if cached is None or old_s == new_s:
            return
        if self.heartbeating == 0 or new_s <= cached:
            self._interval_cache_s = new_s
        elif old_s is not None and old_s <= cached:
            self._interval_cache_s = None

    def _believable(self, rank: int, i: int, time_s: float, what: str) -> bool:
        """Whether ``time_s`` is within the skew bound of what arrived before (module docstring,
        Clocks); an unbelieved time is counted, logged (the first per rank, then every 100th) and
        remembered as the rank's claim, which peers' claims can corroborate."""
        if not math.isfinite(time_s):
            self.untrusted_times += 1
            return False
        c = self.table.cols
        base = max(float(c["time_s"][i]), self._newest_s)
        bound = self.config.reference_max_lag_intervals * self._interval_s()
        if base == float("-inf") or time_s <= base + bound:
            return True
        c["claimed_s"][i] = max(float(c["claimed_s"][i]), time_s)
        floor = time_s - bound
        t = self.table
        backers = int(np.count_nonzero(t.watched & t.heard & (np.maximum(t.time_s, t.claimed_s) >= floor)))
        if self._watched_n and backers > REFERENCE_QUANTILE * self._watched_n:
            self._believe_claims(floor, time_s)  # the job's clocks moved together (a restart after downtime)
            return True
        self.untrusted_times += 1
        c["untrusted"][i] += 1
        untrusted = int(c["untrusted"][i])
        if untrusted % 100 == 1:
            log.warning("%s", json.dumps({"event": "clock_skew", "rank": rank, "what": what,
                                          "ahead_s": round(time_s - base, 3), "bound_s": round(bound, 3),
                                          "untrusted": untrusted}))
        return False

    def _believe_claims(self, floor_s: float, now_s: float) -> None:
        """The jump to ``now_s`` is corroborated: the claims at or after ``floor_s`` were true too,
        and the time before it was observed for nobody, so every other live rank counts as heard
        at ``now_s`` (as after an outage: only silence after the jump is judged)."""
        t = self.table
        live = self._live()
        heard = np.where(t.claimed_s >= floor_s, t.claimed_s, now_s)[live]
        t.time_s[live] = np.maximum(t.time_s[live], heard)
        hb = t.hb_time_s[live]
        t.hb_time_s[live] = np.where(np.isnan(hb), hb, np.maximum(hb, heard))
        if len(heard):
            self._newest_s = max(self._newest_s, float(heard.max()))
        t.claimed_s[live] = -np.inf

    def telemetry(self, rank: int, epoch: int, iteration: int, time_s: float) -> list[LivenessChange]:
        i = self.table.row(rank)
        c = self.table.cols
        c["heard"][i] = True
        if not self._believable(rank, i, time_s, "report"):
            return []
        self._advance(rank, i, epoch, time_s)
        if epoch == c["epoch"][i] and iteration > c["reported"][i]:
            c["reported"][i] = iteration
        self._note_progress(epoch, iteration, time_s)
        c["missing"][i] = 0
        self._watch(i)
        return self._revive(rank, i, f"telemetry resumed at iteration {iteration}") + self._maybe_check(time_s)

    def _note_progress(self, epoch: int, iteration: int, time_s: float) -> None:
        """Keep the epoch's top iteration, when it was reached, and the typical time per iteration."""
        top = self._epoch_top.get(epoch, -1)
        if iteration <= top:
            return
        if top >= 0 and time_s > self._top_time_s[epoch]:
            step = (time_s - self._top_time_s[epoch]) / (iteration - top)
            self._iteration_s = step if self._iteration_s is None else 0.8 * self._iteration_s + 0.2 * step
        self._epoch_top[epoch], self._top_time_s[epoch] = iteration, time_s

    def _advance(self, rank: int, i: int, epoch: int, time_s: float) -> None:
        c = self.table.cols
        before = float(c["time_s"][i])
        if before <= self._deadline_s < time_s and c["watched"][i] and rank not in self.dead:
            self._short_of_deadline -= 1  # one more stream the reference's quantile can rise past
        if time_s > before:
            c["time_s"][i] = time_s
        self._newest_s = max(self._newest_s, time_s)
        if epoch > c["epoch"][i]:
            c["epoch"][i], c["reported"][i], c["started"][i] = epoch, -1, -1
        self._heard_epoch = max(self._heard_epoch, epoch)

    def _revive(self, rank: int, i: int, reason: str) -> list[LivenessChange]:
        c = self.table.cols
        if rank in self.dead and not c["retired"][i]:
            self.dead.discard(rank)
            c["missing"][i] = 0
            return [LivenessChange(rank, True, reason, max(int(c["reported"][i]), 0))]
        return []

    def ingest(self, kind: np.ndarray, rank: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
               time_s: np.ndarray, interval_s: np.ndarray) -> list[LivenessChange] | None:
        """A shard's batch of rows (``kind`` 1: a heartbeat with its interval, 0: a rank report),
        in the order the shard read them, applied as ``heartbeat`` and ``telemetry`` would apply
        them one by one, in a few numpy operations over the batch (the sharded merge's path).

        The judgement runs once, after the batch, when one of its events would have made it due:
        a rank is named at the end of the batch that made it dead, not at the event inside it.
        None, with nothing changed, when the batch holds what only the one-by-one rules settle:
        a time too far ahead to believe at once (Clocks), a row of a dead rank (it may revive),
        a heartbeat interval that changes, a non-finite time. The caller then applies the rows
        one by one (``Detector.on_liveness``)."""
        n = len(rank)
        if n == 0:
            return []
        if not np.isfinite(time_s).all():
            return None
        if self.dead and np.isin(rank, np.fromiter(self.dead, np.int64, len(self.dead))).any():
            return None
        t = self.table
        rows, u, inv = t.batch_rows(rank)
        hb = kind > 0
        # intervals: a stream's announced interval never changes inside a fast batch
        held = t.hb_interval_s[rows]
        had_hb = ~np.isnan(t.hb_time_s[rows])
        if (hb & had_hb & (interval_s != held)).any():
            return None
        hb_intervals = interval_s[hb]
        if len(hb_intervals) and hb_intervals.min() != hb_intervals.max():  # one interval for all: none changes
            first_int = np.full(len(u), np.nan)
            np.fmax.at(first_int, inv[hb], hb_intervals)
            low = np.full(len(u), np.nan)
            np.fmin.at(low, inv[hb], hb_intervals)
            if not np.array_equal(first_int, low, equal_nan=True):
                return None
        # Clocks: every row believable against the newest time of the rows before it
        base_int = self._interval_s() if self.heartbeating else np.inf
        lag = self.config.reference_max_lag_intervals
        if not (math.isfinite(base_int) and self._newest_s > -np.inf and not (hb & (interval_s < base_int)).any()
                and bool((time_s <= self._newest_s + lag * base_int).all())):
            # each row against the rows before it; not needed when every row is within the bound
            # of the newest time held before the batch, at an interval no heartbeat of it shortens
            hb_int = np.where(hb, interval_s, np.inf)
            int_before = np.minimum(base_int, np.concatenate([[np.inf], np.minimum.accumulate(hb_int)[:-1]]))
            int_before = np.where(np.isinf(int_before), 1.0, int_before)
            newest_before = np.maximum(self._newest_s, np.concatenate([[-np.inf], np.maximum.accumulate(time_s)[:-1]]))
            bound = lag * int_before
            if not ((newest_before == -np.inf) | (time_s <= newest_before + bound)).all():
                return None
        return self._apply(rows, u, inv, hb, epoch.astype(np.int64), iteration.astype(np.int64), time_s, interval_s)

    def _apply(self, rows: np.ndarray, u: np.ndarray, inv: np.ndarray, hb: np.ndarray, epoch: np.ndarray,
               iteration: np.ndarray, time_s: np.ndarray, interval_s: np.ndarray) -> list[LivenessChange]:
        """``ingest`` once the batch is known to be believable: per rank, what its rows leave."""
        t = self.table
        # the batch's rows as an index: a slice (views, no gathers) when it covers every row, as
        # the merge's batches do; ``u`` stays the rows' numbers
        uu: np.ndarray | slice = slice(0, t.n) if len(u) == t.n else u
        t.heard[uu] = True
        t_max = np.full(len(u), -np.inf)
        np.maximum.at(t_max, inv, time_s)
        before = t.time_s[uu]
        if self._deadline_s < np.inf:
            crossing = (before <= self._deadline_s) & (self._deadline_s < t_max) & t.watched[uu]
            if self.dead:
                crossing &= ~np.isin(t.rank[u], np.fromiter(self.dead, np.int64, len(self.dead)))
            self._short_of_deadline -= int(np.count_nonzero(crossing))
        t.time_s[uu] = np.maximum(before, t_max)
        self._newest_s = max(self._newest_s, float(time_s.max()))
        self._heard_epoch = max(self._heard_epoch, int(epoch.max()))
        e_max = np.full(len(u), -1, np.int64)
        np.maximum.at(e_max, inv, epoch)
        moved = e_max > t.epoch[uu]
        reset = u[moved]
        t.epoch[reset], t.reported[reset], t.started[reset] = e_max[moved], -1, -1
        current = epoch == t.epoch[rows]  # rows of the epoch each stream is now in
        for col, sel in (("reported", ~hb), ("started", hb)):
            top = np.full(len(u), -1, np.int64)
            np.maximum.at(top, inv[sel & current], iteration[sel & current])
            getattr(t, col)[uu] = np.maximum(getattr(t, col)[uu], top)
        if hb.any():
            last_hb = np.full(len(u), -np.inf)
            np.maximum.at(last_hb, inv[hb], time_s[hb])
            got = last_hb > -np.inf
            old = t.hb_time_s[uu]
            new_hb = got & np.isnan(old)
            for r in u[new_hb].tolist():  # a stream's first heartbeat: the interval's minimum may fall
                self._interval_changed(None, float(interval_s[hb & (rows == r)][0]))
                self.heartbeating += 1
            t.hb_time_s[uu] = np.where(got, np.fmax(old, last_hb), old)
            interval = np.full(len(u), np.nan)
            np.fmax.at(interval, inv[hb], interval_s[hb])
            t.hb_interval_s[uu] = np.where(got, interval, t.hb_interval_s[uu])
        t.missing[rows[~hb]] = 0
        fresh = u[~t.watched[uu] & ~t.retired[uu]]
        t.watched[fresh] = True
        self._watched_n += len(fresh)
        self._batch_progress(~hb, epoch, iteration, time_s)
        self._events_since_check += len(rows) - 1
        return self._maybe_check(float(time_s.max()))

    def _batch_progress(self, report: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
                        time_s: np.ndarray) -> None:
        """``_note_progress`` for the batch's reports that raise their epoch's top, in order (the
        others leave it as it is)."""
        raising = np.zeros(len(epoch), bool)
        for e in distinct(epoch[report]):
            sel = report & (epoch == e)
            its = np.where(sel, iteration, -1)
            prev = np.maximum(self._epoch_top.get(e, -1), np.concatenate([[-1], np.maximum.accumulate(its)[:-1]]))
            raising |= sel & (iteration > prev)
        for j in np.flatnonzero(raising).tolist():
            self._note_progress(int(epoch[j]), int(iteration[j]), float(time_s[j]))

    def declare(self, tracing: TracingDeclared) -> list[LivenessChange]:
        """A producer's tracing declaration (replaces an earlier one of the same epoch). A rank
        judged dead for its silence before the declaration came (it travels on another partition
        than the ranks' reports) and now declared untraced is revived, unless it ever sent a
        heartbeat: then heartbeats are what judge it, and they still count."""
        self.tracing = tuple(d for d in self.tracing if d.epoch != tracing.epoch) + (tracing,)
        out = []
        c = self.table.cols
        for rank in sorted(self.dead):
            i = self.table.find(rank)
            if not self.traced(rank) and (i is None or np.isnan(c["hb_time_s"][i])) and (
                    i is None or not c["retired"][i]):
                self.dead.discard(rank)
                if i is not None:
                    c["missing"][i] = 0
                out.append(LivenessChange(rank, True, f"declared not traced ({tracing.dialect}): its silence is "
                                                      "expected", max(int(c["reported"][i]), 0) if i is not None else 0))
        return out

    def traced(self, rank: int, epoch: int | None = None) -> bool:
        """Whether ``rank`` reports telemetry under the declaration in force at ``epoch`` (the
        newest epoch heard of by default); True without a declaration."""
        d = tracing_at(self.tracing, self.newest_epoch() if epoch is None else epoch)
        return d is None or d.rank_traced(rank)

    def _untraced_planned(self) -> set[int]:
        """Ranks of the newest announced plan that the declaration in force leaves untraced."""
        if self._newest_plan is None:
            return set()
        epoch, devices = self._newest_plan
        return {r for r in devices if not self.traced(r, epoch)}

    def silent_untraced(self) -> set[int]:
        """Live ranks of the newest plan left untraced that never sent a heartbeat: nothing of
        theirs can say they stopped (analytics/detection/hidden_stop.py judges them from the job's stall)."""
        return {r for r in self._untraced_planned() - self.dead if not self.has_heartbeat(r)}

    def has_heartbeat(self, rank: int) -> bool:
        i = self.table.find(rank)
        return i is not None and not np.isnan(self.table.cols["hb_time_s"][i])

    def passed(self, rank: int, epoch: int, iteration: int) -> bool | None:
        """Whether ``rank``'s stream moved beyond (epoch, iteration) (None: nothing of it arrived)."""
        i = self.table.find(rank)
        if i is None or not self.table.cols["heard"][i]:
            return None
        return self.table.passed(i, epoch, iteration)

    def planned(self) -> set[int]:
        """The ranks of the newest announced plan (the watched ones when none was announced)."""
        return set(self._newest_plan[1]) if self._newest_plan is not None else self.watched

    def plan_announced(self, epoch: int, devices: set[int], gpus_per_node: int | None = None) -> None:
        """A plan (plan.current or a command) for ``epoch``: a rank it leaves out is being
        reconfigured away, so its silence is not judged, even before the epoch's first frame.
        ``gpus_per_node`` (plan.current says it; a command does not) places ranks on nodes."""
        if gpus_per_node is not None:
            self.gpus_per_node = gpus_per_node
        if self._newest_plan is None or epoch >= self._newest_plan[0]:
            self._newest_plan = (epoch, set(devices))
            t = self.table
            t.rows(np.fromiter(devices, np.int64, len(devices)))
            t.in_plan[:] = t.mask(self._newest_plan[1])

    def top_iteration(self, epoch: int) -> int:
        """The newest iteration of ``epoch`` any rank reported (−1 if none)."""
        return self._epoch_top.get(epoch, -1)

    def newest_epoch(self) -> int:
        return max(self._epoch_top, default=-1)

    # ---- judgement ------------------------------------------------------------------------------

    def reference_s(self) -> float:
        """The job's progress in event time: the lower third of the watched live ranks' watermarks,
        but no more than ``reference_max_lag_intervals`` heartbeat intervals behind the newest."""
        times = self.table.time_s[self._live()]
        if not len(times):
            return float("-inf")
        lower = float(np.quantile(times, REFERENCE_QUANTILE, method="lower"))
        return max(lower, float(times.max()) - self.config.reference_max_lag_intervals * self._interval_s())

    def stalled_now(self) -> float:
        """How long the newest epoch has completed nothing, at the job's reference (0: not hung)."""
        return 0.0 if self.suspended else self.stalled_s(self.reference_s(), self._interval_s())

    def interval_s(self) -> float:
        return self._interval_s()

    def _interval_s(self) -> float:
        """The shortest heartbeat interval announced (1 s before any heartbeat). Cached: it is asked
        at every event (``_interval_changed`` keeps it)."""
        if self._interval_cache_s is None:
            t = self.table
            has = ~np.isnan(t.hb_time_s)
            self._interval_cache_s = float(t.hb_interval_s[has].min()) if has.any() else 1.0
        return self._interval_cache_s

    def proof_of_life(self, rank: int) -> bool:
        """Peers completed iterations the rank must have run: its stream is just late (``_proof_of_life``)."""
        i = self.table.find(rank)
        return i is not None and bool(self.table.cols["heard"][i]) and bool(self._proof_of_life(np.array([i]))[0])

    def _proof_of_life(self, rows: np.ndarray) -> np.ndarray:
        """Per row: peers completed iterations the rank must have run, so its stream is just late.
        Peers of its own epoch, or of the newest announced plan when that plan keeps the rank: right
        after a reshape a lagging stream's last event is of the old epoch, while the job's progress
        is in the new one, which cannot complete an iteration without the rank either."""
        t = self.table
        epoch = t.epoch[rows]
        need = np.maximum(t.reported[rows], t.started[rows] - 1) + 2
        tops = np.full(len(rows), -1, np.int64)
        for e in distinct(epoch):
            tops[epoch == e] = self._epoch_top.get(e, -1)
        proof = tops >= need
        plan = self._newest_plan
        if plan is not None:
            proof |= (plan[0] > epoch) & t.in_plan[rows] & (self._epoch_top.get(plan[0], -1) >= need)
        return proof

    def _stall_from_s(self, interval_s: float) -> float:
        """The reference beyond which the job counts as hung: the newest epoch's last completed
        iteration plus ``hang_stall_iterations`` typical iterations or one heartbeat interval,
        whichever is longer (never, before an iteration time is known or while a newer plan
        than the newest epoch has been announced)."""
        epoch = self.newest_epoch()
        if epoch < 0 or self._iteration_s is None:
            return float("inf")
        if self._newest_plan is not None and self._newest_plan[0] > epoch:
            return float("inf")  # a newer plan was announced: the job is pausing to reshape, not hung
        if self._heard_epoch > epoch:
            return float("inf")  # heartbeats of a newer epoch than any report: the same pause, seen by the ranks
        declared = tracing_at(self.tracing, epoch)
        every = declared.step_every if declared is not None else 1  # the top moves once per traced step
        return self._top_time_s[epoch] + max(interval_s, self.config.hang_stall_iterations * every * self._iteration_s)

    def stalled_s(self, ref_s: float, interval_s: float) -> float:
        """How long (in the job's progress) the newest epoch has completed nothing, or 0 while the
        job does not count as hung (``_stall_from_s``)."""
        if ref_s <= self._stall_from_s(interval_s):
            return 0.0
        return ref_s - self._top_time_s[self.newest_epoch()]

    def _maybe_check(self, time_s: float) -> list[LivenessChange]:
        """Judge when the reference can have passed the next rank's deadline (enough streams moved
        past it, or the newest event is past it by the reference's lag bound), so that a dead rank
        is named at the event that makes it dead, not one heartbeat round later. Otherwise judge
        when this event is half an interval newer than the last judgement's, or after a third as
        many events as there are watched ranks (so that lagging streams, whose events are older,
        still get judged). The judgement walks every rank; it runs O(1) times per heartbeat round."""
        self._events_since_check += 1
        due = (self._short_of_deadline <= 0
               or time_s - self.config.reference_max_lag_intervals * self._interval_s() > self._deadline_s)
        if not due and time_s < self._next_check_s and self._events_since_check < max(self._watched_n // 3, 8):
            return []
        self._events_since_check = 0
        interval = self._interval_s()
        self._next_check_s = max(self._next_check_s, time_s + 0.5 * interval)
        return self.check()

    def suspend(self) -> None:
        """The bus is down (or this consumer is catching up after it): judge nobody dead."""
        self.suspended = True

    def resume(self) -> None:
        """Caught up after an outage: every live rank counts as heard now (the job's reference), and
        the telemetry-gap counts restart, so only silence after the outage is judged."""
        ref = self.reference_s()
        t = self.table
        late = t.watched & (t.hb_time_s < ref)  # NaN (no heartbeat yet) compares False
        if self.dead:
            late &= ~t.mask(self.dead)
        t.hb_time_s[late] = ref
        t.missing[:] = 0
        self.suspended = False
        self._deadline_s, self._short_of_deadline, self._next_check_s = float("inf"), 0, float("-inf")

    def check(self) -> list[LivenessChange]:
        """Judge every watched rank's heartbeats against the reference; then find the next deadline."""
        if self.suspended:
            return []
        ref = self.reference_s()
        interval = self._interval_s()
        stall_from = self._stall_from_s(interval)
        t = self.table
        judged = t.watched & t.heard & ~np.isnan(t.hb_time_s) & ~t.retired
        if self.dead:
            judged &= ~t.mask(self.dead)
        if self._newest_plan is not None:
            judged &= t.in_plan | (t.epoch >= self._newest_plan[0])  # one left out is being reconfigured away
        rows = np.flatnonzero(judged)
        rows = rows[~self._proof_of_life(rows)]
        row_ref = self._row_references_s(rows, ref)
        late_s = row_ref - t.hb_time_s[rows]
        # hung at the rank's own reference: the job completed nothing for long as the others see it
        stalled = np.where(row_ref > stall_from, row_ref - self._top_time_s.get(self.newest_epoch(), 0.0), 0.0)
        miss = np.where(stalled > 0, min(self.config.heartbeat_miss_intervals, self.config.hang_miss_intervals),
                        self.config.heartbeat_miss_intervals)
        behind = t.epoch[rows] < self._heard_epoch
        rank_miss = np.where(behind, self._behind_miss(), miss)
        dies = late_s > rank_miss * t.hb_interval_s[rows]
        out = []
        for j in np.flatnonzero(dies)[np.argsort(t.rank[rows[dies]], kind="stable")].tolist():
            i = int(rows[j])
            rank, epoch, hb_interval = int(t.rank[i]), int(t.epoch[i]), float(t.hb_interval_s[i])
            self.dead.add(rank)
            why = f"; the job completed nothing for {stalled[j]:.1f} s" if stalled[j] > 0 else ""
            more = (f"; its stream is still in epoch {epoch} while peers are in {self._heard_epoch}"
                    if behind[j] else why)
            out.append(LivenessChange(
                rank, False, f"no heartbeat for {late_s[j]:.1f} s of the job's progress "
                             f"(> {rank_miss[j]:g} intervals of {hb_interval:g} s{more})",
                t.known_iteration(i, epoch) + 1 if epoch >= 0 else 0))
        alive = rows[~dies]
        deadline = float(self._rank_deadline_s(alive, stall_from).min()) if len(alive) else float("inf")
        self._arm(deadline, ref)
        return out

    def _row_references_s(self, rows: np.ndarray, ref_s: float) -> np.ndarray:
        """Per row, the progress its rank is judged against: the job's reference ``ref_s``, or the
        other nodes' progress when that is later. A node's progress is the lower third of its live
        ranks' watermarks; the other nodes' is the lower third of those of every node but the
        rank's own. Needs the nodes (``gpus_per_node`` from plan.current: a node's devices are
        consecutive ids) and two or more nodes whose ranks send events.

        Why: a node dies as a whole, while streams lag one by one (each rank's events have their own
        partition). When the dead node is a third or more of the ranks that heartbeat (half of them
        when a sampled job traces two nodes' replicas), the job's lower third is the dead ranks' own
        time, and only the reference's lag bound (``reference_max_lag_intervals``, 20 intervals)
        gets them judged: in the sampled suite, after the elastic restart. Judged against the other
        nodes, a rank's own silence cannot hold its reference back. A scattered lag of a third or more of the ranks still holds
        every reference back: a node with a third of its ranks behind reads behind, and so do a
        third or more of the nodes. What can go wrong: a whole node whose events are delivered late
        (its network) while the job hangs looks dead until they arrive, then is revived.

        Computed only when some row is late against the newest watermark: in a healthy job none is."""
        out = np.full(len(rows), ref_s)
        per_node = self.gpus_per_node
        t = self.table
        live = self._live()
        if per_node is None or not len(rows) or not live.any():
            return out
        times, nodes = t.time_s[live], t.rank[live] // per_node
        late = t.hb_time_s[rows] + min(self.config.heartbeat_miss_intervals, self.config.hang_miss_intervals) \
            * t.hb_interval_s[rows] < float(times.max())
        if not late.any():
            return out
        ids, counts = np.unique(nodes, return_counts=True)
        if len(ids) < 2:
            return out
        order = np.lexsort((times, nodes))  # by node, then time
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        progress = times[order][starts + np.floor(REFERENCE_QUANTILE * (counts - 1)).astype(np.int64)]
        ranked = np.sort(progress)
        k = int(REFERENCE_QUANTILE * (len(ids) - 2))  # the lower third of the other nodes' progress
        position = np.searchsorted(ranked, progress, side="left")
        # without its own node: the k-th of the rest is the k-th overall unless the node is at or below it
        others = np.where(position > k, ranked[k], ranked[min(k + 1, len(ranked) - 1)])
        row_nodes = t.rank[rows] // per_node
        at = np.searchsorted(ids, row_nodes)
        known = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == row_nodes)
        node_ref = np.where(known, others[np.minimum(at, len(ids) - 1)],
                            ranked[int(REFERENCE_QUANTILE * (len(ids) - 1))])
        return np.where(late, np.maximum(out, node_ref), out)

    def _behind_miss(self) -> float:
        """The miss, in intervals, for a stream still in an older epoch than its peers' streams."""
        return max(self.config.heartbeat_miss_intervals, self.config.reference_max_lag_intervals)

    def _rank_deadline_s(self, rows: np.ndarray, stall_from_s: float) -> np.ndarray:
        """Per row, the reference beyond which the rank is dead: its last heartbeat plus the
        ordinary miss, or the hung miss once the job counts as stalled (whichever comes first);
        the longer miss of a stream behind its peers' epoch."""
        t = self.table
        hb, interval = t.hb_time_s[rows], t.hb_interval_s[rows]
        plain = np.minimum(hb + self.config.heartbeat_miss_intervals * interval,
                           np.maximum(hb + self.config.hang_miss_intervals * interval, stall_from_s))
        return np.where(t.epoch[rows] < self._heard_epoch, hb + self._behind_miss() * interval, plain)

    def _arm(self, deadline_s: float, ref_s: float) -> None:
        """Count the live watched streams at or before ``deadline_s``: the reference (their lower
        ``REFERENCE_QUANTILE``) passes it once only ⌊q·(n−1)⌋ of them are left there. A deadline
        the reference is already past (a rank the judgement kept alive) disarms the trigger, so it
        cannot fire on every event; the periodic judgement still runs."""
        times = self.table.time_s[self._live()]
        if not len(times) or deadline_s == float("inf") or ref_s > deadline_s:
            self._deadline_s, self._short_of_deadline = float("inf"), 0
            return
        behind = int(np.count_nonzero(times <= deadline_s))
        short = behind - int(REFERENCE_QUANTILE * (len(times) - 1))
        self._deadline_s, self._short_of_deadline = (deadline_s, short) if short > 0 else (float("inf"), 0)

    def missing(self, ranks: Iterable[int], iteration: int) -> list[LivenessChange]:
        """Ranks expected in this iteration's frame that did not report (the frame was scored
        without them because their stream moved on, or, without heartbeats, the wait ran out)."""
        out: list[LivenessChange] = []
        if self.suspended:
            return out  # a report missing through a bus outage is the bus's
        c = self.table.cols
        for rank in sorted(ranks):
            if not self.traced(rank):
                continue  # declared untraced: its silence is expected, not a death
            i = self.table.row(rank)
            c["missing"][i] += 1
            n = int(c["missing"][i])
            if n >= self.config.telemetry_lag_iterations and rank not in self.dead and not c["retired"][i]:
                self.dead.add(rank)
                out.append(LivenessChange(rank, False, f"telemetry stopped: no report for {n} iterations "
                                                       f"while peers reported (up to iteration {iteration})",
                                          iteration - n + 1))
        return out

    def new_epoch(self, present: set[int]) -> None:
        """Ranks outside the new plan are no longer watched (nor dead: they were reconfigured away).
        The plan's declared-untraced ranks stay: ``present`` holds only the ranks that report."""
        present = set(present) | self._untraced_planned()
        t = self.table
        t.rows(np.fromiter(present, np.int64, len(present)))
        keep = t.mask(present)
        t.retired[:] = (t.heard | t.watched) & ~keep
        t.watched[:] = keep
        self._watched_n = len(present)
        self.dead &= present
        t.missing[:] = 0
