"""How the global batch's micro-batches are split over pipelines, each running its best candidate.

The planner (remediation/planner.py) builds candidates per pipeline; :class:`MicrobatchSplit` picks
one per pipeline and the micro-batches each runs, jointly: for a target iteration time T each
candidate absorbs m(T) micro-batches, the most whose makespan under the schedule model is ≤ T, and
bisection finds the smallest T at which the pipelines absorb the whole global batch; the surplus
is taken from the pipelines that finish last. With DP adaptation off the surviving pipelines split
the batch evenly instead. Under an interleaved schedule counts are multiples of the stage count.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from collector.plan import PipelinePlan
from remediation.candidates import PipelineCandidate, dropped
from remediation.cluster import ClusterState
from remediation.costs import PipelineScorer, dp_allreduce_s
from remediation.model import PlannerModel
from remediation.throughput import expected_iteration_s

_T_BISECTION_STEPS = 60

Chosen = list[tuple[PipelinePlan, PipelineCandidate, int]]  # per pipeline: (pipeline, its candidate, micro-batches)


@dataclass
class Slot:
    """One pipeline, or a class of identical healthy pipelines sharing a template."""

    members: list[PipelinePlan]
    candidates: list[PipelineCandidate]


@dataclass
class MicrobatchSplit:
    """The split search on one cluster, with one model and scorer; ``interleaved``: counts are
    multiples of a candidate's stage count."""

    model: PlannerModel
    scorer: PipelineScorer
    cluster: ClusterState
    interleaved: bool = False

    def max_mb(self, cand: PipelineCandidate, span_bound_s: float, M: int) -> int:
        """The most micro-batches ``cand`` runs with its pipeline makespan ≤ ``span_bound_s``."""
        if cand.dropped or cand.times is None:
            return 0
        step = self.granule(cand)
        if step > M or self.scorer.makespan_s(cand.running_times, step) > span_bound_s:
            return 0
        lo, hi = 1, M // step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.scorer.makespan_s(cand.running_times, mid * step) <= span_bound_s:
                lo = mid
            else:
                hi = mid - 1
        return lo * step

    def granule(self, cand: PipelineCandidate) -> int:
        """Micro-batch counts must be multiples of this: the stage count under interleaving
        (Megatron's interleaved order runs groups of S micro-batches), else 1."""
        return len(cand.stages) if self.interleaved and cand.stages else 1

    def solve(self, slots: list[Slot], M: int, allow_dp: bool) -> Chosen | None:
        """Per current pipeline: (pipeline, chosen candidate, micro-batches); None if infeasible.

        The iteration is the slowest pipeline plus the gradient all-reduce, whose time is set by the
        device holding the most gradient bytes anywhere in the job. So for each possible all-reduce
        time D (the distinct ones the candidates have) the search allows only candidates with
        all-reduce ≤ D and bounds the pipelines by T − D. The best D is the one whose solution the
        full score rates fastest (the expected slowest of the pipelines, the stalls' tail, D: what
        the result will predict), not the one with the smallest T: with many replicas the expected
        slowest grows with their number, so dropping one can win on the score and lose on T.
        """
        live = [s for s in slots if any(not c.dropped for c in s.candidates)]
        if not live:
            return None
        if not allow_dp:
            return self._even(slots, M)
        dps = sorted({round(c.dp_s, 9) for s in live for c in s.candidates if not c.dropped})
        best: tuple[float, Chosen] | None = None
        for limit_s in dps:
            allowed = [Slot(s.members, [c for c in s.candidates if c.dropped or c.dp_s <= limit_s + 1e-8]
                             or [dropped(s.members[0])]) for s in slots]
            found = self._solve_bounded(allowed, M)
            if found is None or sum(m for _, _, m in found) != M:
                continue  # infeasible, or interleaved granules could not add up to the global batch
            score = self.iteration_s(found)
            if best is None or score < best[0] * (1 - 1e-9):
                best = (score, found)
        return None if best is None else best[1]

    def _solve_bounded(self, slots: list[Slot], M: int) -> Chosen | None:
        """The smallest pipeline makespan T that absorbs all M micro-batches (bisection), and per
        slot the candidate that absorbs the most within T; None if no slot has a live candidate."""
        live = [s for s in slots if any(not c.dropped for c in s.candidates)]
        if not live:
            return None

        def absorbed(span_s: float) -> int:
            total = 0
            for slot in live:
                total += len(slot.members) * max(self.max_mb(c, span_s, M) for c in slot.candidates)
                if total >= M:
                    return total
            return total

        hi = min(self.scorer.makespan_s(c.running_times, M) for s in live for c in s.candidates if c.times is not None)
        lo = 0.0
        for _ in range(_T_BISECTION_STEPS):
            mid = (lo + hi) / 2
            if absorbed(mid) >= M:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-7 * hi:
                break
        chosen: Chosen = []
        for slot in slots:
            pick = max(slot.candidates, key=lambda c: (self.max_mb(c, hi, M), not c.structural, -c.move_s))
            m = self.max_mb(pick, hi, M)
            for pipe in slot.members:
                chosen.append((pipe, pick, m))
        return self._trim(chosen, M)

    def _trim(self, chosen: Chosen, M: int) -> Chosen:
        """Take the surplus micro-batches (over M) from the pipelines that finish last."""
        surplus = sum(m for _, _, m in chosen) - M
        if surplus <= 0:
            return chosen
        ms = [m for _, _, m in chosen]
        heap = [(-self.scorer.makespan_s(c.running_times, m), i) for i, (_, c, m) in enumerate(chosen) if m > 0]
        heapq.heapify(heap)
        while surplus > 0 and heap:
            _, i = heapq.heappop(heap)
            step = self.granule(chosen[i][1])
            if step > surplus:
                continue  # this pipeline's granule overshoots; try the next-latest one
            ms[i] -= step
            surplus -= step
            if ms[i] > 0:
                heapq.heappush(heap, (-self.scorer.makespan_s(chosen[i][1].running_times, ms[i]), i))
        return [(p, c, m) for (p, c, _), m in zip(chosen, ms)]

    def _even(self, slots: list[Slot], M: int) -> Chosen | None:
        """DP adaptation off: the surviving pipelines split the batch evenly; each picks the
        candidate that is fastest at its share."""
        alive = [(pipe, slot) for slot in slots for pipe in slot.members if any(not c.dropped for c in slot.candidates)]
        if not alive:
            return None
        share, extra = divmod(M, len(alive))
        if share == 0:
            return None
        chosen = []
        for i, (pipe, slot) in enumerate(alive):
            m = share + (1 if i < extra else 0)
            fits = [c for c in slot.candidates if not c.dropped and m % self.granule(c) == 0]
            if not fits:
                return None
            best = min(fits, key=lambda c: (self.scorer.makespan_s(c.running_times, m), c.structural, c.move_s))
            chosen.append((pipe, best, m))
        alive_ids = {id(p) for p, _ in alive}
        for slot in slots:
            for pipe in slot.members:
                if id(pipe) not in alive_ids:
                    chosen.append((pipe, dropped(pipe), 0))
        return chosen

    def iteration_s(self, chosen: Chosen) -> float:
        """The expected iteration of a split: the slowest pipeline (with the stalls' tail) and the all-reduce."""
        spans: dict[float, int] = {}
        for _, c, m in chosen:
            if m > 0 and c.times:
                span = self.scorer.makespan_s(c.running_times, m)
                spans[span] = spans.get(span, 0) + 1
        live = [c for _, c, m in chosen if m > 0]
        return expected_iteration_s(self.model, spans, self._allreduce_s(live))

    def _allreduce_s(self, live: list[PipelineCandidate]) -> float:
        """The DP all-reduce after the slowest pipeline, over the replicas that still run.
        Candidates price it over the current replica count; a plan that drops replicas
        all-reduces over fewer (a ring's 2(n−1)/n and its n−1 latencies), so it is priced again
        here: the prediction is then what the new plan scores on its own."""
        n = len(live)
        if n <= 1:
            return 0.0
        unique = {id(c): c for c in live}.values()  # class members share their candidate
        return max(dp_allreduce_s(self.cluster, self.model, c.stages, n) for c in unique)
