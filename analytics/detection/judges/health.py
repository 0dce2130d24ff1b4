"""The rank health view: every rank's state (healthy, slow, dead, not traced), published when it changes."""

from __future__ import annotations

import numpy as np

from analytics.detection.judges.base import FrameView, JobContext
from collector.events import Payload, RankHealth, RankHealthEntry, RankState
from collector.plan import id_ranges


class HealthJudge:
    """The last view published, to publish only a change."""

    def __init__(self) -> None:
        self.published: tuple[np.ndarray, dict[int, tuple[str, float]]] | None = None

    def new_epoch(self, job: JobContext) -> None:
        """A new layout's ranks differ from the last view's: the change publishes it."""

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        """The full rank view, only when some rank's state or factor (to 5%) changed.

        Compared as the frame's ranks (healthy unless named) plus the few ranks in another state:
        at 100k ranks a dict of every rank per iteration cost more than judging the iteration."""
        frame = view.frame
        special: dict[int, tuple[str, float]] = {}
        for r in job.arrival.untraced(frame.epoch):
            special[r] = ("not_traced", 1.0)  # declared untraced: neither healthy nor dead from silence
        for r in job.dead:
            special[r] = ("dead", 1e6)
        for r, f in job.book.slow_factors().items():
            if special.get(r, ("", 0))[0] != "dead":
                special[r] = ("slow", f)
        last = self.published
        changed = last is None or not np.array_equal(last[0], frame.rank) or special.keys() != last[1].keys() or any(
            st != last[1][r][0] or abs(f / last[1][r][1] - 1) > 0.05 for r, (st, f) in special.items())
        if not changed:
            return []
        self.published = (frame.rank.copy(), special)
        named = np.fromiter(special, np.int64, len(special))
        return [RankHealth(
            epoch=frame.epoch, iteration=frame.iteration,
            ranks=[RankHealthEntry(rank=r, state=RankState(st), factor=max(f, 1e-6))
                   for r, (st, f) in sorted(special.items()) if st != "not_traced"],
            healthy=id_ranges(np.setdiff1d(frame.rank, named).tolist()),
            not_traced=id_ranges(sorted(r for r, (st, _) in special.items() if st == "not_traced")))]
