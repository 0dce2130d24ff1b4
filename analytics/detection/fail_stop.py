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

The watch composes its parts: the job's progress (``JobProgress``, fail_stop_progress.py), the
clock it believes and the heartbeat interval it counts in (``EventClock``, ``HeartbeatIntervals``,
fail_stop_clock.py), the judgement and its next deadline (``DeadlineJudgement``,
fail_stop_judgement.py) and the merge's batches (fail_stop_batch.py). It keeps the transitions
itself: which ranks are watched, dead, revived, declared untraced or reconfigured away.

What can go wrong: while the job hangs (nobody progresses, so there is no proof of life) a live
rank whose partition lags the others by more than the hung threshold looks dead until its
heartbeats arrive; it is then revived (``alive``) and its incident resolved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from analytics.detection import fail_stop_batch
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop_clock import REFERENCE_QUANTILE, EventClock, HeartbeatIntervals
from analytics.detection.fail_stop_judgement import DeadlineJudgement
from analytics.detection.fail_stop_progress import JobProgress
from analytics.detection.rank_streams import RankStreams
from collector.events import Heartbeat, TracingDeclared


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


@dataclass
class FailStopWatch:
    config: DetectorConfig
    dead: set[int] = field(default_factory=set)
    table: RankStreams = field(default_factory=RankStreams)  # every rank's stream (analytics/detection/rank_streams.py)
    progress: JobProgress = field(default_factory=JobProgress)
    clock: EventClock = field(default_factory=EventClock)
    intervals: HeartbeatIntervals = field(default_factory=HeartbeatIntervals)
    judgement: DeadlineJudgement = field(default_factory=DeadlineJudgement)
    watched_n: int = 0  # rows watched (the table's ``watched`` column, counted)
    newest_plan: tuple[int, set[int]] | None = None  # (epoch, devices) of the newest plan announced
    suspended: bool = False  # a bus outage: judge nobody until resume()
    tracing: tuple[TracingDeclared, ...] = ()  # every TracingDeclared seen, oldest first
    gpus_per_node: int | None = None  # from plan.current: a node's devices are consecutive ids (None: unknown)
    # dead because their agent reported them hung: alive again only on progress (a report), never on
    # a heartbeat (the agent beats for a stuck process too). Immutable, so an older pickle restores.
    hung_ranks: frozenset[int] = frozenset()

    @property
    def untrusted_times(self) -> int:
        """Events whose time was not believed (too far ahead of the job's)."""
        return self.clock.untrusted_times

    @property
    def heartbeating(self) -> int:
        """Streams that delivered a heartbeat so far."""
        return self.intervals.heartbeating

    @property
    def watched(self) -> set[int]:
        """The running plan's ranks (or those heard from)."""
        t = self.table
        return set(t.rank[t.watched].tolist())

    def _watch(self, i: int) -> None:
        c = self.table.cols
        if not c["watched"][i] and not c["retired"][i]:
            c["watched"][i] = True
            self.watched_n += 1

    def live(self) -> np.ndarray:
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
        if had:
            self.intervals.changed(float(c["hb_interval_s"][i]), hb.interval_s)
        else:
            self.intervals.first(hb.interval_s)
        newer = not had or time_s > last
        if newer:
            c["hb_time_s"][i] = time_s
        c["hb_interval_s"][i] = hb.interval_s
        if hb.epoch == c["epoch"][i] and hb.iteration > c["started"][i]:
            c["started"][i] = hb.iteration
        self._watch(i)
        revived = self._revive(hb.rank, i, "heartbeats resumed") if newer and hb.rank not in self.hung_ranks else []
        return revived + self.judgement.maybe_check(self, time_s)

    def _believable(self, rank: int, i: int, time_s: float, what: str) -> bool:
        """Whether ``time_s`` is within the skew bound of what arrived before (module docstring,
        Clocks; ``EventClock.believable``)."""
        bound_s = self.config.reference_max_lag_intervals * self.interval_s() if math.isfinite(time_s) else math.inf
        return self.clock.believable(self.table, rank, i, time_s, what, bound_s, self.watched_n, self.live)

    def telemetry(self, rank: int, epoch: int, iteration: int, time_s: float) -> list[LivenessChange]:
        i = self.table.row(rank)
        c = self.table.cols
        c["heard"][i] = True
        if not self._believable(rank, i, time_s, "report"):
            return []
        self._advance(rank, i, epoch, time_s)
        if epoch == c["epoch"][i] and iteration > c["reported"][i]:
            c["reported"][i] = iteration
        self.progress.note(epoch, iteration, time_s)
        c["missing"][i] = 0
        self._watch(i)
        if rank in self.hung_ranks:
            self.hung_ranks = self.hung_ranks - {rank}
        return (self._revive(rank, i, f"telemetry resumed at iteration {iteration}")
                + self.judgement.maybe_check(self, time_s))

    def _advance(self, rank: int, i: int, epoch: int, time_s: float) -> None:
        c = self.table.cols
        before = float(c["time_s"][i])
        deadline = self.judgement
        if before <= deadline.deadline_s < time_s and c["watched"][i] and rank not in self.dead:
            deadline.short_of_deadline -= 1  # one more stream the reference's quantile can rise past
        if time_s > before:
            c["time_s"][i] = time_s
        self.clock.newest_s = max(self.clock.newest_s, time_s)
        if epoch > c["epoch"][i]:
            c["epoch"][i], c["reported"][i], c["started"][i] = epoch, -1, -1
        self.progress.heard(epoch)

    def ingest(self, kind: np.ndarray, rank: np.ndarray, epoch: np.ndarray, iteration: np.ndarray,
               time_s: np.ndarray, interval_s: np.ndarray) -> list[LivenessChange] | None:
        """A shard's batch of rows as arrays (``fail_stop_batch.ingest``; None: apply them one by one)."""
        return fail_stop_batch.ingest(self, kind, rank, epoch, iteration, time_s, interval_s)

    # ---- dead and alive -------------------------------------------------------------------------

    def _revive(self, rank: int, i: int, reason: str) -> list[LivenessChange]:
        c = self.table.cols
        if rank in self.dead and not c["retired"][i]:
            self.dead.discard(rank)
            c["missing"][i] = 0
            return [LivenessChange(rank, True, reason, max(int(c["reported"][i]), 0))]
        return []

    def check(self) -> list[LivenessChange]:
        """Judge every watched rank's heartbeats against the reference (``DeadlineJudgement.judge``);
        mark the ones that die; then arm the next deadline."""
        if self.suspended:
            return []
        v = self.judgement.judge(self)
        t = self.table
        out = []
        for j in np.flatnonzero(v.dies)[np.argsort(t.rank[v.rows[v.dies]], kind="stable")].tolist():
            i = int(v.rows[j])
            rank, epoch, hb_interval = int(t.rank[i]), int(t.epoch[i]), float(t.hb_interval_s[i])
            self.dead.add(rank)
            why = f"; the job completed nothing for {v.stalled_s[j]:.1f} s" if v.stalled_s[j] > 0 else ""
            more = (f"; its stream is still in epoch {epoch} while peers are in {self.progress.heard_epoch}"
                    if v.behind[j] else why)
            out.append(LivenessChange(
                rank, False, f"no heartbeat for {v.late_s[j]:.1f} s of the job's progress "
                             f"(> {v.miss[j]:g} intervals of {hb_interval:g} s{more})",
                t.known_iteration(i, epoch) + 1 if epoch >= 0 else 0))
        self.judgement.arm(self, v)
        return out

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

    def hung(self, ranks: Iterable[int], iteration: int, op: str, stuck_for_s: float) -> list[LivenessChange]:
        """Ranks their node agent found making no progress (``telemetry.hang``): stopped like the
        dead until they report again (``telemetry`` revives them). The agent's deadline already
        held them for several expected steps; a rank declared untraced, retired or already dead is
        left as it is."""
        out: list[LivenessChange] = []
        if self.suspended:
            return out
        c = self.table.cols
        for rank in sorted(set(ranks)):
            if not self.traced(rank) or rank in self.dead:
                continue
            i = self.table.row(rank)
            if c["retired"][i]:
                continue
            self.dead.add(rank)
            self.hung_ranks = self.hung_ranks | {rank}
            out.append(LivenessChange(rank, False, f"hung: no progress in {op!r} for {stuck_for_s:.1f} s "
                                                   f"(its node agent's hang report)", iteration))
        return out

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
        self.judgement.disarm()

    # ---- plans and tracing ----------------------------------------------------------------------

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
        if self.newest_plan is None:
            return set()
        epoch, devices = self.newest_plan
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
        return set(self.newest_plan[1]) if self.newest_plan is not None else self.watched

    def plan_announced(self, epoch: int, devices: set[int], gpus_per_node: int | None = None) -> None:
        """A plan (plan.current or a command) for ``epoch``: a rank it leaves out is being
        reconfigured away, so its silence is not judged, even before the epoch's first frame.
        ``gpus_per_node`` (plan.current says it; a command does not) places ranks on nodes."""
        if gpus_per_node is not None:
            self.gpus_per_node = gpus_per_node
        if self.newest_plan is None or epoch >= self.newest_plan[0]:
            self.newest_plan = (epoch, set(devices))
            t = self.table
            t.rows(np.fromiter(devices, np.int64, len(devices)))
            t.in_plan[:] = t.mask(self.newest_plan[1])

    def new_epoch(self, present: set[int]) -> None:
        """Ranks outside the new plan are no longer watched (nor dead: they were reconfigured away).
        The plan's declared-untraced ranks stay: ``present`` holds only the ranks that report."""
        present = set(present) | self._untraced_planned()
        t = self.table
        t.rows(np.fromiter(present, np.int64, len(present)))
        keep = t.mask(present)
        # A rank back in the plan (a spare took its node's place, a repaired device) reported in this
        # epoch: that report is its proof of life, not a heartbeat from before it left.
        back = keep & ~t.watched & ~np.isnan(t.hb_time_s) & np.isfinite(t.time_s)
        t.hb_time_s[back] = np.fmax(t.hb_time_s[back], t.time_s[back])
        t.retired[:] = (t.heard | t.watched) & ~keep
        t.watched[:] = keep
        self.watched_n = len(present)
        self.dead &= present
        t.missing[:] = 0

    # ---- the job's progress ---------------------------------------------------------------------

    def top_iteration(self, epoch: int) -> int:
        """The newest iteration of ``epoch`` any rank reported (−1 if none)."""
        return self.progress.top_iteration(epoch)

    def newest_epoch(self) -> int:
        return self.progress.newest_epoch()

    def reference_s(self) -> float:
        """The job's progress in event time: the lower third of the watched live ranks' watermarks,
        but no more than ``reference_max_lag_intervals`` heartbeat intervals behind the newest."""
        times = self.table.time_s[self.live()]
        if not len(times):
            return float("-inf")
        lower = float(np.quantile(times, REFERENCE_QUANTILE, method="lower"))
        return max(lower, float(times.max()) - self.config.reference_max_lag_intervals * self.interval_s())

    def interval_s(self) -> float:
        """The shortest heartbeat interval announced (1 s before any heartbeat)."""
        return self.intervals.shortest_s(self.table)

    def proof_of_life(self, rank: int) -> bool:
        """Peers completed iterations the rank must have run: its stream is just late."""
        i = self.table.find(rank)
        return (i is not None and bool(self.table.cols["heard"][i])
                and bool(self.judgement.proof_of_life(self, np.array([i]))[0]))

    def stall_from_s(self, interval_s: float) -> float:
        """The reference beyond which the job counts as hung (``JobProgress.stall_from_s``), traced
        steps counted as the declaration in force at the newest epoch says."""
        declared = tracing_at(self.tracing, self.progress.newest_epoch())
        every = declared.step_every if declared is not None else 1  # the top moves once per traced step
        return self.progress.stall_from_s(interval_s, self.config.hang_stall_iterations, every,
                                          self.newest_plan[0] if self.newest_plan is not None else None)

    def stalled_s(self, ref_s: float, interval_s: float) -> float:
        """How long (in the job's progress) the newest epoch has completed nothing, or 0 while the
        job does not count as hung (``stall_from_s``)."""
        return self.progress.stalled_s(ref_s, self.stall_from_s(interval_s))

    def stalled_now(self) -> float:
        """How long the newest epoch has completed nothing, at the job's reference (0: not hung)."""
        return 0.0 if self.suspended else self.stalled_s(self.reference_s(), self.interval_s())
