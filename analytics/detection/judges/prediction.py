"""The iteration's prediction: observed against predicted time, published every iteration."""

from __future__ import annotations

from collections import deque

import numpy as np

from analytics.detection.judges.base import FrameView, JobContext
from collector.events import IterationPrediction, Payload, StageTime


class PredictionJudge:
    """The job's time outside the pipeline, learned from iterations with no incident open.

    Outside the pipeline a step also spends time the chunks and the schedule do not hold: the
    optimizer step, data loading, logging, a checkpoint's bookkeeping. It is the job's own (model
    size, optimizer, loader), so it is learned per job: the median, over the last
    ``window_iterations`` iterations with no incident open, of observed minus the pipeline's
    prediction, never below zero. Without it a healthy job read +28 % against its prediction."""

    def __init__(self, window_iterations: int) -> None:
        self.outside_s: deque[float] = deque(maxlen=window_iterations)

    def new_epoch(self, job: JobContext) -> None:
        """The time outside the pipeline is the job's, not the layout's: kept."""

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        """The pipeline's critical path with predicted chunks, plus the job's time outside it."""
        frame, facts = view.frame, view.facts
        pipeline = facts.pipeline_s
        observed = float(frame.wall_s.max())
        if np.isfinite(pipeline) and pipeline > 0 and not job.book.open:
            self.outside_s.append(observed - pipeline)
        outside = max(float(np.median(self.outside_s)), 0.0) if self.outside_s else 0.0
        err = job.model.error()  # the cost model's error goes out with each prediction
        return [IterationPrediction(
            epoch=frame.epoch, iteration=frame.iteration, observed_s=observed,
            predicted_s=float(pipeline + outside) if np.isfinite(pipeline) else 0.0,
            tokens=facts.tokens,
            model_error=float(err) if np.isfinite(err) else None,
            stages=[StageTime(replica=r, stage=st, observed_s=min(max(o, 0.0), 1e6), predicted_s=min(p, 1e6))
                    for r, st, o, p in facts.stages],
        )]
