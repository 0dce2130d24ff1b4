"""What judging an iteration reads of its chunks, whether it holds them or not.

The single process has every chunk of the frame (``ChunkFacts`` computes each fact when first
read); the sharded merge has only the replicas' summaries, which carry the same facts in
(analytics/sharding/replica_summary.py ``SummaryFacts``). Both satisfy ``IterationFacts``, so one judgement
runs on either.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import numpy as np

from analytics.detection.frame import IterationFrame
from analytics.detection.prediction import predicted_iteration_s, predicted_stage_spans
from analytics.detection.scoring import FrameScore
from analytics.detection.untraced import traced_pipeline_s


def job_tokens(frame: IterationFrame) -> int:
    """Tokens the job trained in this iteration: each micro-batch once, from the forward chunks of
    the first stage's TP rank 0 (first model chunk) in every replica. Every other rank reruns the
    same micro-batches, so summing all ranks would count each one TP·PP·v times. Chunks whose
    count the source did not report (NaN) add nothing: 0 when none is known."""
    first = (frame.c_kind == 0) & (frame.c_vs == 0) & (frame.pp[frame.c_rank] == 0) & (frame.tp[frame.c_rank] == 0)
    return int(np.nansum(frame.c_tokens[first]))


class IterationFacts(Protocol):
    """What judging an iteration reads of its chunks (``Detector.judge``). Read-only: the single
    process computes each from the frame when first read (``ChunkFacts``), the sharded merge
    carries them in from the replicas' summaries (analytics/sharding/replica_summary.py ``SummaryFacts``)."""

    @property
    def own_s(self) -> np.ndarray:
        """(R,) each rank's own compute, summed over its chunks."""

    @property
    def pred_s(self) -> np.ndarray:
        """(R,) each rank's predicted own compute, summed."""

    @property
    def explained_s(self) -> float:
        """The critical path of the observed own times, no communication (NaN: cannot lay out)."""

    @property
    def pipeline_s(self) -> float:
        """The critical path of the predicted times, with communication."""

    @property
    def tokens(self) -> int:
        """The tokens the job trained in the iteration (``job_tokens``)."""

    @property
    def stages(self) -> list[tuple[int, int, float, float]]:
        """Per stage (analytics/detection/prediction.py ``predicted_stage_spans``)."""

    @property
    def span_s(self) -> float:
        """When the last traced chunk ended (analytics/detection/untraced.py ``traced_pipeline_s``; NaN: none)."""


class ChunkFacts:
    """IterationFacts from the frame's own chunks, each computed when first read (a detector
    without link judgement never lays out the observed times)."""

    def __init__(self, frame: IterationFrame, score: FrameScore, schedule: tuple[str | None, int | None]) -> None:
        self.frame, self.score, self.schedule = frame, score, schedule

    @cached_property
    def own_s(self) -> np.ndarray:
        return np.bincount(self.frame.c_rank, weights=self.frame.c_own, minlength=self.frame.num_ranks)

    @cached_property
    def pred_s(self) -> np.ndarray:
        return np.bincount(self.frame.c_rank, weights=np.nan_to_num(self.score.c_pred), minlength=self.frame.num_ranks)

    @cached_property
    def explained_s(self) -> float:
        return predicted_iteration_s(self.frame, self.frame.c_own, *self.schedule, include_comm=False)

    @cached_property
    def pipeline_s(self) -> float:
        return predicted_iteration_s(self.frame, self.score.c_pred, *self.schedule)

    @cached_property
    def tokens(self) -> int:
        return job_tokens(self.frame)

    @cached_property
    def stages(self) -> list[tuple[int, int, float, float]]:
        return predicted_stage_spans(self.frame, self.score.c_pred)

    @cached_property
    def span_s(self) -> float:
        return traced_pipeline_s(self.frame)
