"""Publish the cost model for the planner: ``analytics.cost_model`` events with one CostFit line
per (pipeline stage, chunk kind) of the running plan.

What the remediation engine reads (remediation/cost_figures.py): for each stage ``s`` of the
plan's first replica and each kind, ``alpha_s_per_token``, ``beta_s_per_token_sq`` and
``gamma_s`` of T = α·N + β·Σlᵢ² + γ, the time of one micro-batch's chunk on one rank of that
stage's TP group. The detector's classes are keyed by layer range and TP degree; here each stage of
the first replica is mapped to its class, and the virtual stages of an interleaved schedule (each a
slice of the stage's layers) are summed, so a line always describes the stage's whole layer range.

Why these figures are durations and not the detector's "own compute": the detector fits what a
rank itself computed (TP all-reduce waits removed, so a TP straggler stands out); the planner
costs a stage as it runs, all-reduces included, and takes its own estimate of them out again.
When the source reports TP waits inside chunks the publisher therefore fits a second line per
class on chunk durations (the median of the TP group's); otherwise the two are the same data.

When: the first time every stage of the plan has an F fit in an epoch, after half a window of its
iterations (so at least once per plan epoch once fitted), and afterwards when some line's prediction at its class's typical chunk moved
by ``cost_publish_change`` (relative), at most every ``cost_publish_min_iterations`` iterations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from analytics.detection.cost_model import ClassFit, CostModel
from analytics.detection.config import DetectorConfig
from analytics.detection.frame import KIND_NAME, IterationFrame
from analytics.detection.scoring import FrameScore, WorkClass, fit_ranks, group_median, unit_ids
from collector.events import ChunkKind, CostFit, CostModelFitted
from collector.plan import Plan


@dataclass
class CostPublisher:
    config: DetectorConfig
    durations: CostModel | None = None  # fits on chunk durations, only when TP waits sit inside chunks
    _epoch: int = -1
    _last_iteration: int = -1
    _frames: tuple[int, int] = (-1, 0)  # (epoch, frames seen in it)
    _published: dict[tuple[int, str], tuple[float, float, float]] = field(default_factory=dict)
    _reference: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)
    _reference_epoch: int = -1

    def after_frame(self, frame: IterationFrame, score: FrameScore, suspects: set[int], model: CostModel,
                    plan: Plan | None) -> CostModelFitted | None:
        """Learn what this frame teaches the published figures; return the event to publish, if any."""
        if plan is None or plan.epoch != frame.epoch:
            return None
        # not suspects' TP peers either: their chunks last as long as the suspect's (they wait for it)
        self.observe_durations(frame, score.c_class, score.class_keys, fit_ranks(frame, suspects))
        if self._reference_epoch != frame.epoch:
            self._reference.clear()
            self.note_reference(frame)
            self._reference_epoch = frame.epoch
        return self.maybe_publish(model, plan, frame)

    def observe_durations(self, frame: IterationFrame, c_class: np.ndarray, keys: list[WorkClass],
                          healthy_rank: np.ndarray) -> None:
        """Teach the duration model this frame's healthy work units (only needed when TP waits were
        subtracted from some chunk; otherwise own time is the duration)."""
        if not np.any(frame.c_own < frame.c_dur - 1e-12):
            return
        if self.durations is None:
            self.durations = CostModel(self.config.window_iterations)
        units = unit_ids(frame)
        n_units = int(units.max()) + 1 if len(units) else 0
        ok = healthy_rank[frame.c_rank]
        u_dur = group_median(units[ok], frame.c_dur[ok], n_units)
        first = np.zeros(n_units, dtype=np.int64)
        first[units[::-1]] = np.arange(len(units))[::-1]
        used = np.zeros(n_units, dtype=bool)
        used[units] = True
        u_class = c_class[first]
        for i, key in enumerate(keys):
            sel = used & (u_class == i) & np.isfinite(u_dur)
            self.durations.observe(key, frame.iteration, frame.c_tokens[first][sel], frame.c_s2[first][sel], u_dur[sel])
        self.durations.refit()

    def maybe_publish(self, model: CostModel, plan: Plan | None, frame: IterationFrame) -> CostModelFitted | None:
        """The event to publish after this frame, or None."""
        if plan is None or plan.epoch != frame.epoch:
            return None
        seen = self._frames[1] + 1 if self._frames[0] == frame.epoch else 1
        self._frames = (frame.epoch, seen)
        if seen < max(1, self.config.window_iterations // 2):
            return None  # a few iterations first: one iteration's rows cannot tell α, β and γ apart
        source = self.durations if self.durations is not None and self.durations.fits else model
        fits = first_replica_cost_fits(source, model, plan)
        if fits is None:
            return None
        first = self._epoch != frame.epoch
        if not first:
            if frame.iteration - self._last_iteration < self.config.cost_publish_min_iterations:
                return None
            if not self._moved(fits):
                return None
        self._epoch, self._last_iteration = frame.epoch, frame.iteration
        for f in fits:
            key = (f.stage, f.kind.value)
            self._published[key] = (f.alpha_s_per_token, f.beta_s_per_token_sq, f.gamma_s)
        return CostModelFitted(epoch=frame.epoch, iteration=frame.iteration, fits=fits)

    def note_reference(self, frame: IterationFrame) -> None:
        """Remember a typical chunk (mean tokens, mean Σl²) per (stage, kind): where changes are measured."""
        for k in range(3):
            sel = frame.c_kind == k
            if not sel.any():
                continue
            stage = frame.pp[frame.c_rank[sel]]
            for s in np.unique(stage).tolist():
                m = stage == s
                s2, n = frame.c_s2[sel][m], frame.c_tokens[sel][m]  # NaN: not reported
                self._reference.setdefault((s, KIND_NAME[k]), (
                    float(np.nanmean(n)) if np.isfinite(n).any() else 0.0,
                    float(np.nanmean(s2)) if np.isfinite(s2).any() else 0.0))

    def _moved(self, fits: list[CostFit]) -> bool:
        for f in fits:
            key = (f.stage, f.kind.value)
            old = self._published.get(key)
            if old is None:
                return True
            n, s2 = self._reference.get(key, (1.0, 0.0))
            before = old[0] * n + old[1] * s2 + old[2]
            now = f.alpha_s_per_token * n + f.beta_s_per_token_sq * s2 + f.gamma_s
            if before <= 0 or abs(now / before - 1.0) > self.config.cost_publish_change:
                return True
        return False


def first_replica_cost_fits(source: CostModel, own: CostModel, plan: Plan) -> list[CostFit] | None:
    """CostFit lines for every (stage, kind) of the plan's first replica, or None until each of its
    stages has a forward fit. Virtual stages of one stage are summed (they are slices of its layers)."""
    pipe = min(plan.pipelines, key=lambda p: p.replica)
    out: list[CostFit] = []
    for s, stage in enumerate(pipe.stages):
        for k, name in enumerate(KIND_NAME):
            parts: list[ClassFit] = []
            for vs in range(plan.virtual_stages):
                key = ("layers", stage.first_layer, stage.end_layer, vs, k, stage.tp)
                fit = source.fits.get(key) or own.fits.get(key)
                if fit is not None and fit.rows > 0:
                    parts.append(fit)
            if len(parts) != plan.virtual_stages:
                if k == 0:
                    return None
                continue
            out.append(cost_fit(s, name, parts))
    return out


def cost_fit(stage: int, kind: str, parts: list[ClassFit]) -> CostFit:
    """The published line of one (stage, kind) from its class fits — one, or one per virtual
    stage, summed (they are slices of the stage's layers); errors, spreads and Σlᵢ² are their
    median and means, left out where a class has none (NaN)."""
    errs = [p.rel_error for p in parts if np.isfinite(p.rel_error)]
    cvs = [p.workload_cv for p in parts if np.isfinite(p.workload_cv)]
    s2s = [p.mean_sum_sq_len for p in parts if np.isfinite(p.mean_sum_sq_len)]
    return CostFit(
        stage=stage, kind=ChunkKind(kind), alpha_s_per_token=float(sum(p.alpha for p in parts)),
        beta_s_per_token_sq=float(sum(p.beta for p in parts)), gamma_s=float(sum(p.gamma for p in parts)),
        samples=int(sum(p.rows for p in parts)), rel_error=float(np.median(errs)) if errs else None,
        workload_cv=float(np.mean(cvs)) if cvs else None, mean_sum_sq_len=float(np.mean(s2s)) if s2s else None)
