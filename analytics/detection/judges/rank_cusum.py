"""The rank CUSUM: a GPU that computes slower than its work predicts, named as a compute incident.

Each rank's score (log own compute over predicted, centred on the job) feeds a one-sided CUSUM
whose thresholds scale with the job's σ, or the rank's own noise when that is larger
(``RankCusum.rank_sigma``). Alarmed ranks of one TP group that read alike are one suspect
(lock-step: a probe tells which member). Every open compute incident is observed again each
iteration, sized on its last iterations' scores (``RankCusum.factor``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from analytics.detection.calibration import COMPUTE_CUSUM
from analytics.detection.judges.base import FrameView, JobContext
from analytics.detection.frame import IterationFrame
from analytics.detection.incident_keys import IncidentKey
from analytics.detection.open_incident import Suspect
from analytics.detection.scoring import FrameScore, chunk_slowdown, fit_ranks, replica_shared_slowdown
from collector.events import Payload

_GROW = 1024
_MEDIAN_STEP_PER_SIGMA = 0.6745 * math.sqrt(2)  # median |z_t − z_{t−1}| for independent normal z of σ 1


def state_index(rank: np.ndarray) -> np.ndarray | slice:
    """Where a frame's ranks sit in per-rank arrays indexed by rank: a slice when they are one run
    of consecutive ranks, as a job's usually are (a frame holds its ranks sorted, each once), so
    that reading and writing 100k ranks' state is a view, not a gather and a scatter."""
    n = len(rank)
    if n and int(rank[-1]) - int(rank[0]) == n - 1 and bool((np.diff(rank) == 1).all()):
        return slice(int(rank[0]), int(rank[0]) + n)
    return rank


@dataclass
class FrameRecord:
    """What the rank CUSUM remembers of a judged iteration: the evidence an incident shows."""

    iteration: int
    rank: np.ndarray
    own_s: np.ndarray
    pred_s: np.ndarray
    z: np.ndarray


class RankCusum:
    """Per rank, a CUSUM on its centred score, and its own noise (arrays indexed by rank)."""

    def __init__(self) -> None:
        self.cusum = np.zeros(_GROW)
        self.z_last = np.full(_GROW, np.nan)  # each rank's z in its last judged iteration of this epoch
        self.z_noise = np.full(_GROW, np.nan)  # each rank's running median step (rank_noise_iterations)
        self.z_steps = np.zeros(_GROW)  # how many steps that median has seen
        self.history: deque[FrameRecord] = deque(maxlen=8)
        self.mix_held: dict[int, int] = {}  # replica → iterations in a row its shared slowdown was taken for its mix

    def new_epoch(self, job: JobContext) -> None:
        self.cusum[:] = 0.0
        self.z_last[:] = np.nan  # z moves with the layout: no step is measured across a reshape
        self.mix_held = {}

    def mix_explained(self, frame: IterationFrame, score: FrameScore, k: float, hold: int) -> np.ndarray:
        """Per row of the frame, the part of its score its replica's mix explains (0 where none).

        Without sequence lengths, a replica every stage of which reads slower than the drift
        allowance ``k`` in the same iteration is taken to have drawn long documents
        (``replica_shared_slowdown``): that shared part is taken out of its ranks' scores for up to
        ``hold`` iterations in a row (``mix_hold_iterations``). A burst of long documents lasts a
        few iterations; a replica slow on every stage for longer is judged in full, so a whole
        replica (or node) that stays slow still opens, ``hold`` iterations late. With lengths
        reported the cost model sees the mix itself and nothing is taken out."""
        explained = np.zeros(len(frame.rank))
        if not score.inferred or hold <= 0 or not len(frame.rank):
            self.mix_held = {}
            return explained
        shared = replica_shared_slowdown(frame, score.z)
        held: dict[int, int] = {}
        for d in np.flatnonzero(np.nan_to_num(shared, nan=-np.inf) >= k).tolist():
            n = self.mix_held.get(d, 0) + 1
            held[d] = n
            if n <= hold:
                explained[frame.dp == d] = shared[d]
        self.mix_held = held
        return explained

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        frame, score, sigma = view.frame, view.score, view.sigma
        self.history.append(FrameRecord(frame.iteration, frame.rank, view.facts.own_s, view.facts.pred_s, score.z))
        k = job.thresholds(sigma)[0]  # the job's drift allowance: TP-peer merging, open incidents
        self._grow(int(frame.rank.max()) + 1)
        sig_r = self.rank_sigma(frame, score, sigma, job.config.rank_noise_iterations)
        k_r, h_r, cap_r = job.thresholds(sig_r)
        explained = self.mix_explained(frame, score, k, job.config.mix_hold_iterations)
        if explained.any():
            score = replace(score, z=score.z - explained)
        judged = np.isfinite(score.z)  # a rank without predictions keeps its CUSUM as it was
        at = state_index(frame.rank)
        prev = self.cusum[at]
        s = np.where(judged, np.maximum(0.0, prev + np.minimum(np.nan_to_num(score.z) - k_r, cap_r)), prev)
        self.cusum[at] = s
        out: list[Payload] = []
        book = job.book
        # Not alarmed on: a suspect (its incident is open) and its TP peers in this layout — in
        # lock-step their own times are entangled with the suspect's (identical, without TP waits).
        clean = fit_ranks(frame, job.with_traced_peers(frame, book.open_compute_ranks()))
        alarmed = [int(i) for i in np.flatnonzero(s > h_r)
                   if clean[i] and int(frame.rank[i]) not in job.dead]
        self.cusum[frame.rank[s > h_r]] = 0.0
        for members in self._merge_tp_peers(frame, score, alarmed, k):
            i = max(members, key=lambda j: score.z[j])
            out += book.open_fail_slow(
                self._compute_suspect(frame, score, members, float(sig_r[i]), float(k_r[i]), float(h_r[i]), job),
                frame.iteration)
        for key in book.open_rank_keys():
            watched = tuple(sorted(job.with_traced_peers(frame, set(key.ranks))))  # an untraced suspect: its peer
            idx = np.flatnonzero(np.isin(frame.rank, watched) & judged)
            if len(idx):  # no judged member this iteration: no evidence either way (not a healthy one)
                z_now = float(score.z[idx].max())
                # while the 3-iteration window still reaches back to the opening, size it as the
                # opening did (its slow iterations only), or the probe's naming carries a pre-onset one
                young = frame.iteration - book.open[key].opened_iteration < 3
                slowest = int(idx[np.argmax(score.z[idx])])
                out += book.observe(key, z_now, k, frame.iteration, chunk_slowdown(
                    frame, score.c_pred, slowest, self.factor(watched, z_now, k if young else None)),
                    sample=chunk_slowdown(frame, score.c_pred, slowest, math.exp(z_now)))
        return out

    def _grow(self, top: int) -> None:
        """Room for ranks up to ``top`` (exclusive) in the per-rank arrays."""
        if top <= len(self.cusum):
            return
        grow = top - len(self.cusum) + _GROW
        self.cusum = np.concatenate([self.cusum, np.zeros(grow)])
        self.z_last = np.concatenate([self.z_last, np.full(grow, np.nan)])
        self.z_noise = np.concatenate([self.z_noise, np.full(grow, np.nan)])
        self.z_steps = np.concatenate([self.z_steps, np.zeros(grow)])

    def rank_sigma(self, frame: IterationFrame, score: FrameScore, sigma: float, span: int) -> np.ndarray:
        """Per row of the frame, the σ its CUSUM is judged with: the job's ``sigma``, or the rank's
        own noise when that is larger.

        The rank's own noise is the running median of |z_t − z_{t−1}| (steps, not deviations: a
        slowdown is one large step, not a lasting spread), tracked by a sign rule in log space —
        up by 2/``span`` when a step exceeds it, down when not (by more over its first steps) — so
        rare spikes (a preempted chunk on a shared CPU) count as one vote, not by their size. For
        independent normal z the median step is 0.954 σ. It starts at the job's σ and counts only
        after ``span``/2 steps: an estimate from a handful of noisy iterations (the torch trainer's
        first ones) is itself noisy, and taking the larger of two σs would only ever raise the bar.

        Why per rank: σ pooled over the job describes the typical rank. A TP group that alone runs
        its layer range is predicted from its own recent iterations and is ~2.5× noisier; judged
        with the job's σ it raised ×1.04 incidents that resolved within a second. Larger only: a
        quiet rank keeps the job's thresholds."""
        if span <= 0:
            return np.full(len(frame.rank), sigma)
        r, z = state_index(frame.rank), score.z
        med = self.z_noise[r]
        med = np.where(np.isfinite(med), med, _MEDIAN_STEP_PER_SIGMA * sigma)  # a new rank starts at the job's
        step = np.abs(z - self.z_last[r])
        ok = np.isfinite(step)
        vote = np.where(step > med, 1.0, -1.0)
        seen = self.z_steps[r]
        rate = 2.0 / np.minimum(seen + 4.0, span)  # larger moves while young
        self.z_noise[r] = np.where(ok, med * np.exp(vote * rate), self.z_noise[r])
        self.z_steps[r] = seen + ok
        self.z_last[r] = np.where(np.isfinite(z), z, self.z_last[r])
        own = np.where(self.z_steps[r] >= span / 2, self.z_noise[r] / _MEDIAN_STEP_PER_SIGMA, sigma)
        return np.maximum(sigma, np.nan_to_num(own, nan=sigma))

    @staticmethod
    def _merge_tp_peers(frame: IterationFrame, score: FrameScore, alarmed: list[int], k: float) -> list[list[int]]:
        """Alarmed ranks grouped per TP group. TP ranks run in lock-step, and a source that does not
        report TP waits gives them identical telemetry: then the group is one suspect (a probe, if
        enabled, tells which member), not one incident per member."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i in alarmed:
            groups.setdefault((int(frame.dp[i]), int(frame.pp[i])), []).append(int(i))
        out = []
        for members in groups.values():
            zs = score.z[members]
            if len(members) > 1 and float(zs.max() - zs.min()) < k:
                out.append(members)
            else:
                out.extend([i] for i in members)
        return out

    def factor(self, ranks: tuple[int, ...], z_now: float, k: float | None = None) -> float:
        """exp(median z) over the last 3 iterations of these ranks (the slowest rank per iteration);
        with ``k`` (an opening), over those of them that read slow (z ≥ k) when any did.

        Why at an opening: the CUSUM alarms on the second slow iteration, so one of the three is
        often from before the onset, and the median of {healthy, slow, slow} is the lower slow one
        (a ×2 GPU first reported ×1.89 against its ×1.94 chunks; the first report is what a planner
        acting at once reads)."""
        zs = []
        for rec in list(self.history)[-3:]:
            idx = np.flatnonzero(np.isin(rec.rank, ranks) & np.isfinite(rec.z))
            if len(idx):
                zs.append(float(rec.z[idx].max()))
        if k is not None and any(z >= k for z in zs):
            zs = [z for z in zs if z >= k]
        return float(np.exp(np.median(zs))) if zs else float(np.exp(z_now))

    def _compute_suspect(self, frame: IterationFrame, score: FrameScore, members: list[int], sigma: float,
                         k: float, h: float, job: JobContext) -> Suspect:
        """The incident's suspect for alarmed ``members`` (rows of one TP group), with its evidence
        (own against predicted compute over the remembered iterations) and the note an operator reads."""
        i = max(members, key=lambda j: score.z[j])
        ranks = tuple(sorted(int(frame.rank[j]) for j in members))
        group = np.flatnonzero((frame.dp == frame.dp[i]) & (frame.pp == frame.pp[i]))
        tp_group = tuple(int(r) for r in frame.rank[group])
        untraced = job.untraced_tp_peers(frame, int(frame.rank[i]))
        if untraced:  # a member nobody traces may be the slow one: the group is the suspect
            ranks = tuple(sorted(set(ranks) | set(untraced)))
            tp_group = tuple(sorted(set(tp_group) | set(untraced)))
        hist = [(r.iteration, float(r.own_s[j]), float(r.pred_s[j]))
                for r in self.history for j in np.flatnonzero(r.rank == frame.rank[i])]
        factor = chunk_slowdown(frame, score.c_pred, i, self.factor(ranks, score.z[i], k))
        return Suspect(
            key=IncidentKey.of_ranks(ranks), target="compute", rank=ranks[0] if len(ranks) == 1 else None, link=None,
            node=int(frame.node[i]) if frame.node[i] >= 0 else None, replica=int(frame.dp[i]),
            stage=int(frame.pp[i]), tp_group=tp_group, factor=factor,
            place_confidence=round(1.0 / len(ranks), 4), basis=COMPUTE_CUSUM,
            margin=float((score.z[i] - k) / max(sigma, 1e-6)), iterations=[h_[0] for h_ in hist], observed_s=[h_[1] for h_ in hist],
            predicted_s=[h_[2] for h_ in hist],
            rank_factors={int(frame.rank[j]): round(float(np.exp(score.z[j])), 4) for j in group
                          if np.isfinite(score.z[j])},
            statistic=f"CUSUM on log(own compute / predicted), centred on the job median; k={k:.4f} h={h:.4f} "
                      f"sigma={sigma:.4f}",
            note=_compute_note(score, i, ranks, untraced, job.config.probes), ranks=ranks,
        )


def _compute_note(score: FrameScore, i: int, ranks: tuple[int, ...], untraced: list[int], probes: bool) -> str:
    """What an operator reads of a compute suspect: its slowdown per chunk kind and what it is."""
    kinds = {name: float(np.exp(v)) for name, v in zip("FBW", score.z_by_kind[i]) if np.isfinite(v)}
    worst = max(kinds, key=kinds.__getitem__) if kinds else "F"
    note = f"own compute per chunk kind ×{', '.join(f'{n}:{v:.2f}' for n, v in kinds.items())}"
    if worst == "B" and kinds.get("F", 1.0) < 1.0 + 0.5 * (kinds["B"] - 1.0):
        note += "; backward-pass straggler (hidden in wall time by collective synchronisation)"
    if untraced:
        note += (f"; TP ranks {list(untraced)} are not traced and run in lock-step with the traced one: the "
                 "group is the suspect" + ("; a probe will tell which member" if probes else ""))
    elif len(ranks) > 1:
        note += (f"; TP ranks {list(ranks)} report identical timings (lock-step, no TP waits): the group is "
                 "the suspect" + ("; a probe will tell which member" if probes else ""))
    if score.inferred:
        note += "; seq_lens not reported: predictions inferred from the same micro-batch on other stages"
    return note
