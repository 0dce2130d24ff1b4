"""The job's progress as the fail-stop watch sees it, in event time: how far each epoch got.

A synchronous job completes iteration j+1 only once every rank of its plan finished j, so the
newest iteration any rank reported is a floor under every rank's own progress (the watch's proof of
life), and an epoch whose newest iteration stops moving is a hung job (analytics/detection/fail_stop.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of an array that holds few (epochs), without sorting or hashing it."""
    if not len(values):
        return []
    lo, hi = int(values.min()), int(values.max())
    return [lo] if lo == hi else np.unique(values).tolist()


@dataclass
class JobProgress:
    epoch_top: dict[int, int] = field(default_factory=dict)  # epoch -> newest iteration any rank reported
    top_time_s: dict[int, float] = field(default_factory=dict)  # epoch -> event time its top was first reported
    iteration_s: float | None = None  # typical event time between iterations of the newest epoch
    heard_epoch: int = -1  # the newest epoch any stream showed (a heartbeat's included)

    def top_iteration(self, epoch: int) -> int:
        """The newest iteration of ``epoch`` any rank reported (−1 if none)."""
        return self.epoch_top.get(epoch, -1)

    def newest_epoch(self) -> int:
        return max(self.epoch_top, default=-1)

    def heard(self, epoch: int) -> None:
        """A stream showed ``epoch`` (a report or a heartbeat)."""
        self.heard_epoch = max(self.heard_epoch, epoch)

    def note(self, epoch: int, iteration: int, time_s: float) -> None:
        """Keep the epoch's top iteration, when it was reached, and the typical time per iteration."""
        top = self.epoch_top.get(epoch, -1)
        if iteration <= top:
            return
        if top >= 0 and time_s > self.top_time_s[epoch]:
            step = (time_s - self.top_time_s[epoch]) / (iteration - top)
            self.iteration_s = step if self.iteration_s is None else 0.8 * self.iteration_s + 0.2 * step
        self.epoch_top[epoch], self.top_time_s[epoch] = iteration, time_s

    def note_batch(self, report: np.ndarray, epoch: np.ndarray, iteration: np.ndarray, time_s: np.ndarray) -> None:
        """``note`` for the batch's reports that raise their epoch's top, in order (the others
        leave it as it is)."""
        raising = np.zeros(len(epoch), bool)
        for e in distinct(epoch[report]):
            sel = report & (epoch == e)
            its = np.where(sel, iteration, -1)
            prev = np.maximum(self.epoch_top.get(e, -1), np.concatenate([[-1], np.maximum.accumulate(its)[:-1]]))
            raising |= sel & (iteration > prev)
        for j in np.flatnonzero(raising).tolist():
            self.note(int(epoch[j]), int(iteration[j]), float(time_s[j]))

    def stall_from_s(self, interval_s: float, stall_iterations: float, step_every: int,
                     newest_plan_epoch: int | None) -> float:
        """The reference beyond which the job counts as hung: the newest epoch's last completed
        iteration plus ``stall_iterations`` typical iterations (of ``step_every`` steps each, when
        only every so many steps are traced) or one heartbeat interval, whichever is longer. Never,
        before an iteration time is known or while a newer plan than the newest epoch has been
        announced (``newest_plan_epoch``) or heard of."""
        epoch = self.newest_epoch()
        if epoch < 0 or self.iteration_s is None:
            return float("inf")
        if newest_plan_epoch is not None and newest_plan_epoch > epoch:
            return float("inf")  # a newer plan was announced: the job is pausing to reshape, not hung
        if self.heard_epoch > epoch:
            return float("inf")  # heartbeats of a newer epoch than any report: the same pause, seen by the ranks
        return self.top_time_s[epoch] + max(interval_s, stall_iterations * step_every * self.iteration_s)

    def stalled_s(self, ref_s: float, stall_from_s: float) -> float:
        """How long (in the job's progress) the newest epoch has completed nothing at ``ref_s``, or
        0 while the job does not count as hung (before ``stall_from_s``)."""
        if ref_s <= stall_from_s:
            return 0.0
        return ref_s - self.top_time_s[self.newest_epoch()]
