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
  dies at once (a node of a two-node job), the lower third is the dead ranks' own time; so the
  reference never trails the newest watermark by more than ``reference_max_lag_intervals``
  intervals, which bounds how long any dead set can go unjudged.
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
  has caught up after it (resihp/commands/analytics.py decides, from the bus client's own
  connection errors): nothing is judged dead meanwhile, since what is missing is the bus, not the
  ranks. ``resume`` then counts every live rank as heard at the job's reference time, so a rank
  that died during the outage is named ``heartbeat_miss_intervals`` after it, and one whose
  producer reconnects a little later than the others' is not.

What can go wrong: while the job hangs (nobody progresses, so there is no proof of life) a live
rank whose partition lags the others by more than the hung threshold looks dead until its
heartbeats arrive; it is then revived (``alive``) and its incident resolved.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from analytics.detector_config import DetectorConfig
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


@dataclass
class RankStream:
    """What one rank's own stream told us so far."""

    time_s: float = float("-inf")  # watermark: newest event time
    hb_time_s: float | None = None
    hb_interval_s: float = 1.0
    epoch: int = -1
    reported: int = -1  # newest iteration reported in ``epoch``
    started: int = -1  # newest iteration a heartbeat said it started in ``epoch``
    claimed_s: float = float("-inf")  # the newest time it stamped that was not believed (Clocks)
    untrusted: int = 0  # its events whose time was not believed

    def known_iteration(self, epoch: int) -> int:
        """The newest iteration of ``epoch`` this stream proves the rank got to (−1 if none)."""
        if self.epoch > epoch:
            return 1 << 40
        if self.epoch < epoch:
            return -1
        return max(self.reported, self.started - 1)

    def passed(self, epoch: int, iteration: int) -> bool:
        """True when the stream moved beyond (epoch, iteration): a report of it can no longer come."""
        if self.epoch != epoch:
            return self.epoch > epoch
        return self.reported > iteration or self.started >= iteration + 2


@dataclass
class FailStopWatch:
    config: DetectorConfig
    dead: set[int] = field(default_factory=set)
    streams: dict[int, RankStream] = field(default_factory=dict)
    watched: set[int] = field(default_factory=set)  # the running plan's ranks (or those heard from)
    _epoch_top: dict[int, int] = field(default_factory=dict)  # epoch -> newest iteration any rank reported
    _top_time_s: dict[int, float] = field(default_factory=dict)  # epoch -> event time its top was first reported
    _iteration_s: float | None = None  # typical event time between iterations of the newest epoch
    _missing: dict[int, int] = field(default_factory=dict)
    _retired: set[int] = field(default_factory=set)
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

    # ---- input ----------------------------------------------------------------------------------

    def stream(self, rank: int) -> RankStream:
        s = self.streams.get(rank)
        if s is None:
            s = self.streams[rank] = RankStream()
        return s

    def heartbeat(self, hb: Heartbeat, time_s: float) -> list[LivenessChange]:
        s = self.stream(hb.rank)
        if not self._believable(hb.rank, s, time_s, "heartbeat"):
            return []
        self._advance(hb.rank, s, hb.epoch, time_s)
        if s.hb_time_s is None or s.hb_interval_s != hb.interval_s:
            self._interval_cache_s = None
        if s.hb_time_s is None:
            self.heartbeating += 1
        newer = s.hb_time_s is None or time_s > s.hb_time_s
        s.hb_time_s, s.hb_interval_s = time_s if newer else s.hb_time_s, hb.interval_s
        if hb.epoch == s.epoch:
            s.started = max(s.started, hb.iteration)
        if hb.rank not in self._retired:
            self.watched.add(hb.rank)
        revived = self._revive(hb.rank, "heartbeats resumed") if newer else []
        return revived + self._maybe_check(time_s)

    def _believable(self, rank: int, s: RankStream, time_s: float, what: str) -> bool:
        """Whether ``time_s`` is within the skew bound of what arrived before (module docstring,
        Clocks); an unbelieved time is counted, logged (the first per rank, then every 100th) and
        remembered as the rank's claim, which peers' claims can corroborate."""
        if not math.isfinite(time_s):
            self.untrusted_times += 1
            return False
        base = max(s.time_s, self._newest_s)
        bound = self.config.reference_max_lag_intervals * self._interval_s()
        if base == float("-inf") or time_s <= base + bound:
            return True
        s.claimed_s = max(s.claimed_s, time_s)
        floor = time_s - bound
        backers = sum(1 for r in self.watched if r in self.streams
                      and max(self.streams[r].time_s, self.streams[r].claimed_s) >= floor)
        if self.watched and backers > REFERENCE_QUANTILE * len(self.watched):
            self._believe_claims(floor, time_s)  # the job's clocks moved together (a restart after downtime)
            return True
        self.untrusted_times += 1
        s.untrusted += 1
        if s.untrusted % 100 == 1:
            log.warning("%s", json.dumps({"event": "clock_skew", "rank": rank, "what": what,
                                          "ahead_s": round(time_s - base, 3), "bound_s": round(bound, 3),
                                          "untrusted": s.untrusted}))
        return False

    def _believe_claims(self, floor_s: float, now_s: float) -> None:
        """The jump to ``now_s`` is corroborated: the claims at or after ``floor_s`` were true too,
        and the time before it was observed for nobody, so every other live rank counts as heard
        at ``now_s`` (as after an outage: only silence after the jump is judged)."""
        for r in self.watched - self.dead:
            st = self.streams.get(r)
            if st is None:
                continue
            heard = st.claimed_s if st.claimed_s >= floor_s else now_s
            st.time_s = max(st.time_s, heard)
            if st.hb_time_s is not None:
                st.hb_time_s = max(st.hb_time_s, heard)
            self._newest_s = max(self._newest_s, heard)
            st.claimed_s = float("-inf")

    def telemetry(self, rank: int, epoch: int, iteration: int, time_s: float) -> list[LivenessChange]:
        s = self.stream(rank)
        if not self._believable(rank, s, time_s, "report"):
            return []
        self._advance(rank, s, epoch, time_s)
        if epoch == s.epoch:
            s.reported = max(s.reported, iteration)
        self._note_progress(epoch, iteration, time_s)
        self._missing[rank] = 0
        if rank not in self._retired:
            self.watched.add(rank)
        return self._revive(rank, f"telemetry resumed at iteration {iteration}") + self._maybe_check(time_s)

    def _note_progress(self, epoch: int, iteration: int, time_s: float) -> None:
        """Keep the epoch's top iteration, when it was reached, and the typical time per iteration."""
        top = self._epoch_top.get(epoch, -1)
        if iteration <= top:
            return
        if top >= 0 and time_s > self._top_time_s[epoch]:
            step = (time_s - self._top_time_s[epoch]) / (iteration - top)
            self._iteration_s = step if self._iteration_s is None else 0.8 * self._iteration_s + 0.2 * step
        self._epoch_top[epoch], self._top_time_s[epoch] = iteration, time_s

    def _advance(self, rank: int, s: RankStream, epoch: int, time_s: float) -> None:
        if s.time_s <= self._deadline_s < time_s and rank in self.watched and rank not in self.dead:
            self._short_of_deadline -= 1  # one more stream the reference's quantile can rise past
        s.time_s = max(s.time_s, time_s)
        self._newest_s = max(self._newest_s, time_s)
        if epoch > s.epoch:
            s.epoch, s.reported, s.started = epoch, -1, -1
        self._heard_epoch = max(self._heard_epoch, epoch)

    def _revive(self, rank: int, reason: str) -> list[LivenessChange]:
        if rank in self.dead and rank not in self._retired:
            self.dead.discard(rank)
            self._missing[rank] = 0
            return [LivenessChange(rank, True, reason, max(self.streams[rank].reported, 0))]
        return []

    def declare(self, tracing: TracingDeclared) -> list[LivenessChange]:
        """A producer's tracing declaration (replaces an earlier one of the same epoch). A rank
        judged dead for its silence before the declaration came (it travels on another partition
        than the ranks' reports) and now declared untraced is revived, unless it ever sent a
        heartbeat: then heartbeats are what judge it, and they still count."""
        self.tracing = tuple(d for d in self.tracing if d.epoch != tracing.epoch) + (tracing,)
        out = []
        for rank in sorted(self.dead):
            s = self.streams.get(rank)
            if not self.traced(rank) and (s is None or s.hb_time_s is None) and rank not in self._retired:
                self.dead.discard(rank)
                self._missing[rank] = 0
                out.append(LivenessChange(rank, True, f"declared not traced ({tracing.dialect}): its silence is "
                                                      "expected", max(s.reported, 0) if s is not None else 0))
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
        theirs can say they stopped (analytics/hidden_stop.py judges them from the job's stall)."""
        return {r for r in self._untraced_planned() - self.dead
                if r not in self.streams or self.streams[r].hb_time_s is None}

    def planned(self) -> set[int]:
        """The ranks of the newest announced plan (the watched ones when none was announced)."""
        return set(self._newest_plan[1]) if self._newest_plan is not None else set(self.watched)

    def plan_announced(self, epoch: int, devices: set[int]) -> None:
        """A plan (plan.current or a command) for ``epoch``: a rank it leaves out is being
        reconfigured away, so its silence is not judged, even before the epoch's first frame."""
        if self._newest_plan is None or epoch >= self._newest_plan[0]:
            self._newest_plan = (epoch, set(devices))

    def top_iteration(self, epoch: int) -> int:
        """The newest iteration of ``epoch`` any rank reported (−1 if none)."""
        return self._epoch_top.get(epoch, -1)

    def newest_epoch(self) -> int:
        return max(self._epoch_top, default=-1)

    # ---- judgement ------------------------------------------------------------------------------

    def reference_s(self) -> float:
        """The job's progress in event time: the lower third of the watched live ranks' watermarks,
        but no more than ``reference_max_lag_intervals`` heartbeat intervals behind the newest."""
        times = [self.streams[r].time_s for r in self.watched if r not in self.dead and r in self.streams]
        if not times:
            return float("-inf")
        lower = float(np.quantile(np.asarray(times), REFERENCE_QUANTILE, method="lower"))
        return max(lower, max(times) - self.config.reference_max_lag_intervals * self._interval_s())

    def stalled_now(self) -> float:
        """How long the newest epoch has completed nothing, at the job's reference (0: not hung)."""
        return 0.0 if self.suspended else self.stalled_s(self.reference_s(), self._interval_s())

    def interval_s(self) -> float:
        return self._interval_s()

    def _interval_s(self) -> float:
        """The shortest heartbeat interval announced (1 s before any heartbeat). Cached: it is asked
        at every event, and walking every rank's stream each time made this quadratic in ranks."""
        if self._interval_cache_s is None:
            self._interval_cache_s = min((s.hb_interval_s for s in self.streams.values() if s.hb_time_s is not None),
                                         default=1.0)
        return self._interval_cache_s

    def proof_of_life(self, rank: int) -> bool:
        """Peers completed iterations the rank must have run: its stream is just late. Peers of its
        own epoch, or of the newest announced plan when that plan keeps the rank: right after a
        reshape a lagging stream's last event is of the old epoch, while the job's progress is
        in the new one, which cannot complete an iteration without the rank either."""
        s = self.streams.get(rank)
        if s is None:
            return False
        need = s.known_iteration(s.epoch) + 2
        if self._epoch_top.get(s.epoch, -1) >= need:
            return True
        plan = self._newest_plan
        return plan is not None and plan[0] > s.epoch and rank in plan[1] and self._epoch_top.get(plan[0], -1) >= need

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
        if not due and time_s < self._next_check_s and self._events_since_check < max(len(self.watched) // 3, 8):
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
        for rank in self.watched - self.dead:
            s = self.streams.get(rank)
            if s is not None and s.hb_time_s is not None and ref > s.hb_time_s:
                s.hb_time_s = ref
        self._missing = {r: 0 for r in self._missing}
        self.suspended = False
        self._deadline_s, self._short_of_deadline, self._next_check_s = float("inf"), 0, float("-inf")

    def check(self) -> list[LivenessChange]:
        """Judge every watched rank's heartbeats against the reference; then find the next deadline."""
        if self.suspended:
            return []
        ref = self.reference_s()
        interval = self._interval_s()
        stalled = self.stalled_s(ref, interval)
        miss = self.config.heartbeat_miss_intervals
        if stalled:
            miss = min(miss, self.config.hang_miss_intervals)
        why = f"; the job completed nothing for {stalled:.1f} s" if stalled else ""
        stall_from = self._stall_from_s(interval)
        out = []
        deadline = float("inf")
        for rank in sorted(self.watched):
            s = self.streams.get(rank)
            if s is None or s.hb_time_s is None or rank in self.dead or rank in self._retired:
                continue
            if self._newest_plan is not None and rank not in self._newest_plan[1] and s.epoch < self._newest_plan[0]:
                continue
            late_s = ref - s.hb_time_s
            if self.proof_of_life(rank):
                continue
            behind = s.epoch < self._heard_epoch
            rank_miss = self._behind_miss() if behind else miss
            if late_s > rank_miss * s.hb_interval_s:
                self.dead.add(rank)
                more = (f"; its stream is still in epoch {s.epoch} while peers are in {self._heard_epoch}"
                        if behind else why)
                out.append(LivenessChange(
                    rank, False, f"no heartbeat for {late_s:.1f} s of the job's progress "
                                 f"(> {rank_miss:g} intervals of {s.hb_interval_s:g} s{more})",
                    s.known_iteration(s.epoch) + 1 if s.epoch >= 0 else 0))
            else:
                deadline = min(deadline, self._rank_deadline_s(s, stall_from))
        self._arm(deadline, ref)
        return out

    def _behind_miss(self) -> float:
        """The miss, in intervals, for a stream still in an older epoch than its peers' streams."""
        return max(self.config.heartbeat_miss_intervals, self.config.reference_max_lag_intervals)

    def _rank_deadline_s(self, s: RankStream, stall_from_s: float) -> float:
        """The reference beyond which this rank is dead: its last heartbeat plus the ordinary miss,
        or the hung miss once the job counts as stalled (whichever comes first); the longer miss of
        a stream behind its peers' epoch."""
        assert s.hb_time_s is not None
        if s.epoch < self._heard_epoch:
            return s.hb_time_s + self._behind_miss() * s.hb_interval_s
        plain = s.hb_time_s + self.config.heartbeat_miss_intervals * s.hb_interval_s
        return min(plain, max(s.hb_time_s + self.config.hang_miss_intervals * s.hb_interval_s, stall_from_s))

    def _arm(self, deadline_s: float, ref_s: float) -> None:
        """Count the live watched streams at or before ``deadline_s``: the reference (their lower
        ``REFERENCE_QUANTILE``) passes it once only ⌊q·(n−1)⌋ of them are left there. A deadline
        the reference is already past (a rank the judgement kept alive) disarms the trigger, so it
        cannot fire on every event; the periodic judgement still runs."""
        times = [self.streams[r].time_s for r in self.watched if r not in self.dead and r in self.streams]
        if not times or deadline_s == float("inf") or ref_s > deadline_s:
            self._deadline_s, self._short_of_deadline = float("inf"), 0
            return
        behind = sum(t <= deadline_s for t in times)
        short = behind - int(REFERENCE_QUANTILE * (len(times) - 1))
        self._deadline_s, self._short_of_deadline = (deadline_s, short) if short > 0 else (float("inf"), 0)

    def missing(self, ranks: set[int], iteration: int) -> list[LivenessChange]:
        """Ranks expected in this iteration's frame that did not report (the frame was scored
        without them because their stream moved on, or, without heartbeats, the wait ran out)."""
        out: list[LivenessChange] = []
        if self.suspended:
            return out  # a report missing through a bus outage is the bus's
        for rank in sorted(ranks):
            if not self.traced(rank):
                continue  # declared untraced: its silence is expected, not a death
            n = self._missing.get(rank, 0) + 1
            self._missing[rank] = n
            if n >= self.config.telemetry_lag_iterations and rank not in self.dead and rank not in self._retired:
                self.dead.add(rank)
                out.append(LivenessChange(rank, False, f"telemetry stopped: no report for {n} iterations "
                                                       f"while peers reported (up to iteration {iteration})",
                                          iteration - n + 1))
        return out

    def new_epoch(self, present: set[int]) -> None:
        """Ranks outside the new plan are no longer watched (nor dead: they were reconfigured away).
        The plan's declared-untraced ranks stay: ``present`` holds only the ranks that report."""
        present = set(present) | self._untraced_planned()
        self._retired = (set(self.streams) | self.watched) - present
        self.watched = set(present)
        self.dead &= present
        self._missing = {r: 0 for r in present}
