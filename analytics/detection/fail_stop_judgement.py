"""The fail-stop watch's judgement: which ranks are dead now, and when to judge again.

Every watched rank's last heartbeat is held against the job's progress (its reference, or the other
nodes' when they are further on), with a shorter miss while the job hangs and a longer one for a
stream behind its peers' epoch; a rank whose peers completed iterations it must have run is alive
whatever its heartbeats say (analytics/detection/fail_stop.py has the rules). After each judgement
the next deadline is armed, so that a dead rank is named at the event that makes it dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop_clock import REFERENCE_QUANTILE
from analytics.detection.fail_stop_progress import distinct

if TYPE_CHECKING:
    from analytics.detection.fail_stop import FailStopWatch, LivenessChange


class Verdict(NamedTuple):
    """One judgement, per row judged (``rows``: the table's rows that had no proof of life)."""

    rows: np.ndarray
    dies: np.ndarray  # late past its miss: dead
    late_s: np.ndarray  # how far its last heartbeat trails its reference
    miss: np.ndarray  # the miss it was held to, in its heartbeat intervals
    stalled_s: np.ndarray  # how long the job had completed nothing at its reference (0: not hung)
    behind: np.ndarray  # its stream is in an older epoch than its peers'
    ref_s: float  # the job's reference
    stall_from_s: float  # the reference beyond which the job counts as hung


@dataclass
class DeadlineJudgement:
    """When the next judgement is due: the reference beyond which the next rank would be judged
    dead, how many live streams must still pass it, and the periodic judgement's pace."""

    deadline_s: float = float("inf")  # the reference beyond which the next rank would be judged dead
    short_of_deadline: int = 0  # live watched streams still to pass deadline_s before the reference can
    next_check_s: float = float("-inf")
    events_since_check: int = 0

    def disarm(self) -> None:
        """Forget the deadline and judge at the next event (after an outage)."""
        self.deadline_s, self.short_of_deadline, self.next_check_s = float("inf"), 0, float("-inf")

    def maybe_check(self, w: FailStopWatch, time_s: float) -> list[LivenessChange]:
        """Judge when the reference can have passed the next rank's deadline (enough streams moved
        past it, or the newest event is past it by the reference's lag bound), so that a dead rank
        is named at the event that makes it dead, not one heartbeat round later. Otherwise judge
        when this event is half an interval newer than the last judgement's, or after a third as
        many events as there are watched ranks (so that lagging streams, whose events are older,
        still get judged). The judgement walks every rank; it runs O(1) times per heartbeat round."""
        self.events_since_check += 1
        due = (self.short_of_deadline <= 0
               or time_s - w.config.reference_max_lag_intervals * w.interval_s() > self.deadline_s)
        if not due and time_s < self.next_check_s and self.events_since_check < max(w.watched_n // 3, 8):
            return []
        self.events_since_check = 0
        interval = w.interval_s()
        self.next_check_s = max(self.next_check_s, time_s + 0.5 * interval)
        return w.check()

    def judge(self, w: FailStopWatch) -> Verdict:
        """Judge every watched rank's heartbeats against the reference (the watch then marks the
        ranks that die, and ``arm`` finds the next deadline among those that live)."""
        config, t = w.config, w.table
        ref = w.reference_s()
        stall_from = w.stall_from_s(w.interval_s())
        judged = t.watched & t.heard & ~np.isnan(t.hb_time_s) & ~t.retired
        if w.dead:
            judged &= ~t.mask(w.dead)
        if w.newest_plan is not None:
            judged &= t.in_plan | (t.epoch >= w.newest_plan[0])  # one left out is being reconfigured away
        rows = np.flatnonzero(judged)
        rows = rows[~self.proof_of_life(w, rows)]
        row_ref = self._row_references_s(w, rows, ref)
        late_s = row_ref - t.hb_time_s[rows]
        # hung at the rank's own reference: the job completed nothing for long as the others see it
        stalled = np.where(row_ref > stall_from,
                           row_ref - w.progress.top_time_s.get(w.progress.newest_epoch(), 0.0), 0.0)
        miss = np.where(stalled > 0, min(config.heartbeat_miss_intervals, config.hang_miss_intervals),
                        config.heartbeat_miss_intervals)
        behind = t.epoch[rows] < w.progress.heard_epoch
        rank_miss = np.where(behind, behind_miss(config), miss)
        dies = late_s > rank_miss * t.hb_interval_s[rows]
        return Verdict(rows, dies, late_s, rank_miss, stalled, behind, ref, stall_from)

    def arm(self, w: FailStopWatch, verdict: Verdict) -> None:
        """After a judgement (its dead already marked): arm the earliest deadline of the ranks it
        kept alive."""
        alive = verdict.rows[~verdict.dies]
        deadline = float(self._rank_deadline_s(w, alive, verdict.stall_from_s).min()) if len(alive) else float("inf")
        self._arm(w, deadline, verdict.ref_s)

    @staticmethod
    def proof_of_life(w: FailStopWatch, rows: np.ndarray) -> np.ndarray:
        """Per row: peers completed iterations the rank must have run, so its stream is just late.
        Peers of its own epoch, or of the newest announced plan when that plan keeps the rank: right
        after a reshape a lagging stream's last event is of the old epoch, while the job's progress
        is in the new one, which cannot complete an iteration without the rank either."""
        t, progress = w.table, w.progress
        epoch = t.epoch[rows]
        need = np.maximum(t.reported[rows], t.started[rows] - 1) + 2
        tops = np.full(len(rows), -1, np.int64)
        for e in distinct(epoch):
            tops[epoch == e] = progress.top_iteration(e)
        proof = tops >= need
        plan = w.newest_plan
        if plan is not None:
            proof |= (plan[0] > epoch) & t.in_plan[rows] & (progress.top_iteration(plan[0]) >= need)
        return proof

    @staticmethod
    def _row_references_s(w: FailStopWatch, rows: np.ndarray, ref_s: float) -> np.ndarray:
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
        per_node = w.gpus_per_node
        t = w.table
        live = w.live()
        if per_node is None or not len(rows) or not live.any():
            return out
        times, nodes = t.time_s[live], t.rank[live] // per_node
        late = t.hb_time_s[rows] + min(w.config.heartbeat_miss_intervals, w.config.hang_miss_intervals) \
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

    @staticmethod
    def _rank_deadline_s(w: FailStopWatch, rows: np.ndarray, stall_from_s: float) -> np.ndarray:
        """Per row, the reference beyond which the rank is dead: its last heartbeat plus the
        ordinary miss, or the hung miss once the job counts as stalled (whichever comes first);
        the longer miss of a stream behind its peers' epoch."""
        t, config = w.table, w.config
        hb, interval = t.hb_time_s[rows], t.hb_interval_s[rows]
        plain = np.minimum(hb + config.heartbeat_miss_intervals * interval,
                           np.maximum(hb + config.hang_miss_intervals * interval, stall_from_s))
        return np.where(t.epoch[rows] < w.progress.heard_epoch, hb + behind_miss(config) * interval, plain)

    def _arm(self, w: FailStopWatch, deadline_s: float, ref_s: float) -> None:
        """Count the live watched streams at or before ``deadline_s``: the reference (their lower
        ``REFERENCE_QUANTILE``) passes it once only ⌊q·(n−1)⌋ of them are left there. A deadline
        the reference is already past (a rank the judgement kept alive) disarms the trigger, so it
        cannot fire on every event; the periodic judgement still runs."""
        times = w.table.time_s[w.live()]
        if not len(times) or deadline_s == float("inf") or ref_s > deadline_s:
            self.deadline_s, self.short_of_deadline = float("inf"), 0
            return
        behind = int(np.count_nonzero(times <= deadline_s))
        short = behind - int(REFERENCE_QUANTILE * (len(times) - 1))
        self.deadline_s, self.short_of_deadline = (deadline_s, short) if short > 0 else (float("inf"), 0)


def behind_miss(config: DetectorConfig) -> float:
    """The miss, in intervals, for a stream still in an older epoch than its peers' streams."""
    return max(config.heartbeat_miss_intervals, config.reference_max_lag_intervals)
