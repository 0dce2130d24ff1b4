"""What every judge of an iteration reads, and the one signature the judges share.

The detector (analytics/detection/detector.py) judges each scored iteration with a row of judges, each
owning one statistic and the state it keeps: the rank CUSUM, the link CUSUM, the communication
excess, the sweep of untraced ranks, the prediction and the rank health. Each implements
``FrameJudge``: ``judge(view, job)`` returns the payloads the iteration causes, ``new_epoch(job)``
restarts what a new plan invalidates. ``FrameView`` is the iteration as scored; ``JobContext`` is
the job around it (the config, the cost model, the incident book the judges report to, the liveness that tells
them the dead, the plans that place ranks). Neither is kept by a judge: the detector passes them
on each call, so a judge's pickled state is its statistic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, overload

import numpy as np

from analytics.detection.arrival import FrameAssembler
from analytics.detection.cost_model import CostModel
from analytics.detection.facts import IterationFacts
from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch
from analytics.detection.frame import IterationFrame
from analytics.detection.incidents import IncidentBook
from analytics.detection.scoring import FrameScore
from collector.events import Payload
from collector.plan import Plan


@dataclass(frozen=True)
class FrameView:
    """One scored iteration, as every judge reads it."""

    frame: IterationFrame
    score: FrameScore
    facts: IterationFacts
    sigma: float  # the job's noise σ in this iteration (``JobNoise.measure``)
    hidden: list[int]  # live ranks of TP groups none of whose members is traced (``JobContext.hidden_ranks``)


class JobContext:
    """The job around an iteration: what judges read besides the iteration, and the book they
    report to. The detector holds one and hands it to every judge on every call."""

    def __init__(self, job: str, config: DetectorConfig, model: CostModel, book: IncidentBook,
                 fail_stop: FailStopWatch, arrival: FrameAssembler) -> None:
        self.job, self.config, self.model = job, config, model
        self.book, self.fail_stop, self.arrival = book, fail_stop, arrival

    @overload
    def thresholds(self, sigma: float) -> tuple[float, float, float]: ...
    @overload
    def thresholds(self, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def thresholds(self, sigma: float | np.ndarray) -> tuple[float | np.ndarray, float | np.ndarray,
                                                            float | np.ndarray]:
        """(k, h, cap) of a CUSUM for a σ, or element-wise for an array of them
        (analytics/detection/config.py explains each)."""
        c = self.config
        k = np.maximum(c.k_sigma * sigma, c.log_min_slowdown)
        h = np.maximum(c.h_sigma * sigma, c.log_min_alarm)
        return k, h, c.step_cap * h

    @property
    def dead(self) -> set[int]:
        return self.fail_stop.dead

    def plan(self, epoch: int) -> Plan | None:
        return self.arrival.plans.get(epoch)

    def schedule(self, frame: IterationFrame) -> tuple[str | None, int | None]:
        """The plan's schedule when the plan of this epoch is known, else None (inferred from chunks)."""
        plan = self.plan(frame.epoch)
        return (plan.schedule, plan.virtual_stages) if plan is not None else (None, None)

    def tp_group_of(self, epoch: int, rank: int) -> tuple[int, ...]:
        """The devices of ``rank``'s TP group under the plan of ``epoch`` (empty when unknown)."""
        plan = self.plan(epoch)
        role = plan.roles.get(rank) if plan is not None else None
        if plan is None or role is None:
            return ()
        return tuple(int(d) for d in plan.pipelines[role.replica].stages[role.stage].devices)

    def untraced_tp_peers(self, frame: IterationFrame, rank: int) -> list[int]:
        """The members of ``rank``'s TP group under the running plan that the producer declared
        untraced (one traced rank per TP group, as Megatron-style tracing records). In lock-step
        their slowness shows in the traced member's chunks, so none of them can be cleared. A
        traced peer whose report is merely late (a lagging Kafka partition) is not one of them."""
        untraced = self.arrival.untraced(frame.epoch)
        if not untraced:
            return []
        return [d for d in self.tp_group_of(frame.epoch, rank) if d in untraced and d not in self.dead]

    def with_traced_peers(self, frame: IterationFrame, ranks: set[int]) -> set[int]:
        """``ranks`` plus the reporting members of the TP group of each one that sent no report:
        a suspect nobody traces taints its traced peer's chunks, which wait for it in lock-step."""
        if not ranks:
            return set()  # the common case, every frame: no set of the job's ranks is built
        wanted = np.fromiter(ranks, np.int64, len(ranks))
        out = set(ranks)
        for r in wanted[~np.isin(wanted, frame.rank)].tolist():
            group = np.array(self.tp_group_of(frame.epoch, r), dtype=np.int64)
            out.update(group[np.isin(group, frame.rank)].tolist())
        return out

    def hidden_ranks(self, epoch: int) -> list[int]:
        """The live ranks of TP groups none of whose members is traced (sampled tracing leaves whole
        replicas out). An untraced member of a traced group is not hidden: in lock-step its
        slowness shows in its traced peer's chunks (Megatron-style tracing)."""
        dead = self.dead
        untraced = self.arrival.untraced(epoch) - dead
        plan = self.plan(epoch)
        if not untraced or plan is None:
            return []
        return sorted(d for pipe in plan.pipelines for st in pipe.stages if set(st.devices) <= untraced | dead
                      for d in st.devices if d in untraced)

    def plan_ranks(self, frame: IterationFrame) -> tuple[int, ...]:
        """Every live rank of the running plan (the ranks heard from when the plan is unknown)."""
        plan = self.plan(frame.epoch)
        ranks = set(plan.roles) if plan is not None else set(frame.rank.tolist())
        return tuple(sorted(ranks - self.dead))[:4096]


class FrameJudge(Protocol):
    """One statistic over the job's iterations: it reads each scored iteration and reports what it
    finds (incidents opened, observed or resolved through the book; payloads to publish)."""

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        """The payloads this iteration causes under this judge's statistic."""

    def new_epoch(self, job: JobContext) -> None:
        """A new plan: restart what the old layout's numbers would mislead."""
