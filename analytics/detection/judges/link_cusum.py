"""The link CUSUM: a p2p link that transfers slower than the same stage pair's other links.

Each link's score (log of its lower-quartile send time, centred on its stage pair's links) feeds a
CUSUM whose σ is its stage pair's own window (``LinkCusum.link_sigma``). A timer that holds the
wait for its peer must read slow for ``LINK_SUSTAIN`` iterations in a row. A pipeline with a rank
computing slow is not judged (its compute explains its slow transfers); one pair of TP groups is
named once, whichever TP rank or direction reads it.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from analytics.detection.calibration import LINK_CUSUM
from analytics.detection.judges.base import FrameView, JobContext
from analytics.detection.judges.noise import fast_side_sigma
from analytics.detection.config import DetectorConfig
from analytics.detection.frame import IterationFrame
from analytics.detection.incident_keys import IncidentKey
from analytics.detection.open_incident import Suspect
from analytics.detection.scoring import FrameScore
from collector.events import Payload

LINK_SUSTAIN = 3  # iterations a link whose timers hold waits must read slow before it counts


class LinkCusum:
    """Per link, a CUSUM; per stage pair, its links' recent scores; per waiting link, its last few."""

    def __init__(self) -> None:
        self.cusum: dict[tuple[int, int], float] = {}
        self.zhist: dict[int, deque[np.ndarray]] = {}  # per stage pair, its links' recent scores
        self.recent: dict[tuple[int, int], deque[float]] = {}  # per link whose timers hold waits

    def new_epoch(self, job: JobContext) -> None:
        self.cusum.clear()
        self.recent.clear()

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        frame, score = view.frame, view.score
        if not job.config.links or not len(score.link_z):
            return []
        sigmas = self.link_sigma(score, job.config)
        ks, hs, caps = job.thresholds(sigmas)
        out: list[Payload] = []
        book = job.book
        open_links = book.open_links()
        coord = {int(r): i for i, r in enumerate(frame.rank)}
        explained = self._explained_by_compute(frame, score, float(job.thresholds(view.sigma)[0]), job)
        named = {_tp_group_pair(frame, job, *inc.suspect.link) for inc in book.open.values()
                 if inc.suspect.target == "link" and inc.suspect.link is not None}
        for a, b, z, waits, sigma, k, h, cap in zip(
                score.link_src.tolist(), score.link_dst.tolist(), score.link_z.tolist(), score.link_waits.tolist(),
                sigmas.tolist(), ks.tolist(), hs.tolist(), caps.tolist()):
            if not math.isfinite(z):
                continue  # not judged this iteration (a fused timer without peers to compare with)
            key = (a, b)
            if waits:
                z = self._sustained_z(key, z)
            i = coord.get(a)
            if (link_key := IncidentKey.of_link(a, b)) in open_links:
                out += book.observe(link_key, z, k, frame.iteration, float(np.exp(z)))
                continue
            if i is not None and int(frame.dp[i]) in explained:
                continue  # a slow rank in this pipeline explains slow transfers better than the wire does
            s = max(0.0, self.cusum.get(key, 0.0) + min(z - k, cap))
            if s <= h:
                self.cusum[key] = s
                continue
            self.cusum[key] = 0.0
            pair = _tp_group_pair(frame, job, a, b)
            if pair in named:
                continue  # the same two TP groups' link is already named (another TP rank, or the other way)
            named.add(pair)
            placed = book.place_communication((a, b), float(np.exp(z)), frame.iteration)
            out += placed or book.open_fail_slow(_link_suspect(frame, i, a, b, z, sigma, k, h), frame.iteration)
        return out

    def link_sigma(self, score: FrameScore, config: DetectorConfig) -> np.ndarray:
        """Per link, its noise: from the window of recent iterations of the links of its stage pair
        (fast side only, as for ranks), never less than ``sigma_floor``.

        Why a window: one iteration's spread of a few links is itself noise, and near zero it made
        any wobble cross the threshold (a ×0.98 link opened, confidence 0). Why per stage pair: a
        timer that holds the wait for the peer is as noisy as that wait, and the links out of the
        first stage wait longest; pooled with quiet links their σ was too small. A slowdown only
        adds time, so the half below the median is what healthy noise looks like."""
        lz, cls = score.link_z, score.link_class
        out = np.full(len(lz), config.sigma_floor)
        for c in np.unique(cls).tolist():
            sel = cls == c
            judged = lz[sel & np.isfinite(lz)]
            hist = self.zhist.setdefault(c, deque(maxlen=config.window_iterations))
            if len(judged):
                hist.append(judged)
            if not hist:
                continue
            out[sel] = max(fast_side_sigma(np.concatenate(list(hist))), config.sigma_floor)
        return out

    def _sustained_z(self, key: tuple[int, int], z: float) -> float:
        """For a link whose timers hold waits: the smallest of its last ``LINK_SUSTAIN`` scores.

        Why: such a timer reads the wire plus however long the peer kept it waiting, and whether the
        peer was late flips from one iteration to the next with the stages' jitter (a stall, a
        slower mix downstream), so one link reads ×10-×40 for a single iteration now and then in a
        healthy job. A slower wire slows every message of every iteration: it raises the minimum of
        a few iterations, a late peer does not."""
        recent = self.recent.setdefault(key, deque(maxlen=LINK_SUSTAIN))
        recent.append(z)
        return min(recent) if len(recent) == LINK_SUSTAIN else min(min(recent), 0.0)

    @staticmethod
    def _explained_by_compute(frame: IterationFrame, score: FrameScore, k: float, job: JobContext) -> set[int]:
        """Replicas whose links cannot be judged this iteration: one of their ranks computes slower
        than predicted (z above the drift allowance, alarmed or not yet), has an open compute
        incident, or is dead. In a pipeline every send waits, directly or through the stages after
        it, on the compute of the ranks downstream, so their slowness lengthens the timers of the
        links upstream; only a pipeline whose compute is on time can blame a wire."""
        busy = (np.nan_to_num(score.z, nan=0.0) >= k)
        suspects = job.book.open_compute_ranks() | set(job.dead)
        if suspects:
            busy |= np.isin(frame.rank, np.fromiter(suspects, np.int64, len(suspects)))
        return set(frame.dp[busy].tolist())


def _tp_group_pair(frame: IterationFrame, job: JobContext, a: int, b: int) -> frozenset[tuple[int, ...]]:
    """The two TP groups a link joins, whichever way it runs and whichever TP ranks report it:
    in lock-step every TP rank of a stage sends to its peer of the next, so one slow transfer
    between two stages reads on each TP rank's link, and in both directions of a fused timer."""
    return frozenset((job.tp_group_of(frame.epoch, a) or (a,), job.tp_group_of(frame.epoch, b) or (b,)))


def _link_suspect(frame: IterationFrame, i: int | None, a: int, b: int, z: float, sigma: float, k: float,
                  h: float) -> Suspect:
    """A slow link a → b, ``i`` the sender's row in the frame (None: it sent no report)."""
    return Suspect(
        key=IncidentKey.of_link(a, b), target="link", rank=None, link=(a, b), node=None,
        replica=int(frame.dp[i]) if i is not None else None, stage=int(frame.pp[i]) if i is not None else None,
        tp_group=None, factor=float(np.exp(z)),
        place_confidence=1.0, basis=LINK_CUSUM, margin=float((z - k) / max(sigma, 1e-6)),
        iterations=[frame.iteration], observed_s=[], predicted_s=[], rank_factors={},
        statistic=f"CUSUM on log(lower-quartile p2p send time), centred on the same stage pair's links; "
                  f"k={k:.4f} h={h:.4f} sigma={sigma:.4f} (links' own window)",
        note=f"link {a}->{b} (stage {int(frame.pp[i]) if i is not None else '?'} to the next)",
    )
