"""When an iteration's telemetry is complete: a low-water mark over the ranks' own streams.

Reports of one iteration reach the detector from every rank's stream, and streams arrive unevenly
(on Kafka each rank's key lands in one partition, and a consumer may be a dozen iterations further
in one partition than in another). An iteration is scored once, so it must wait until it is
*complete*, decided per expected rank from what that rank's own stream showed, never from the
order in which streams interleave:

- the rank reported it; or
- its stream moved past it (a later report, a heartbeat that says it started iteration ≥ i+2, or a
  later epoch): that report is lost, not late; or
- it is judged dead (analytics/detection/fail_stop.py, event time relative to the others' progress); or
- it sent reports but no heartbeat yet (silence cannot be told from lag) and reports
  ``flush_lag_iterations`` later arrived from others — ``unplanned_wait_iterations`` when other
  ranks do heartbeat: then its first heartbeat is late (its partition lags from the job's start),
  not absent.

A planned rank never heard from at all is waited for (its partition may not have been read yet).

Expected ranks are those of the running plan: ``plan.current`` (published by the trainer and the
simulator at start and after every reshape) or a ``command.reconfigure``'s plan. Without a plan
for the epoch (it travels on the control topic, which may arrive later than telemetry) they are
learned from what arrived, and the iteration also waits until reports ``unplanned_wait_iterations``
later arrived (a rank not heard from yet may still exist) or the plan comes. A hard cap,
``max_wait_iterations``, bounds the memory a stream that never comes can hold.

Sampled tracing: a producer's ``TracingDeclared`` (the newest declared at or before an epoch is in
force for it) narrows what is expected to the traced ranks, and only traced steps are assembled.
A report of a step the declaration leaves out is counted and dropped: the other traced ranks do not
report it, and a partial frame would read as missing ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np

from analytics.detection.config import DetectorConfig
from analytics.detection.fail_stop import FailStopWatch, tracing_at
from collector.events import RankIteration, TracingDeclared
from collector.plan import Plan


@dataclass
class FrameAssembler:
    config: DetectorConfig
    plans: dict[int, Plan] = field(default_factory=dict)  # epoch -> plan
    pending: dict[tuple[int, int], dict[int, RankIteration]] = field(default_factory=dict)
    done: tuple[int, int] = (-1, -1)
    learned: dict[int, set[int]] = field(default_factory=dict)  # epoch -> ranks heard from
    late_reports: int = 0

    _expected: dict[int, frozenset[int]] = field(default_factory=dict)
    # Immutable with class-level defaults, so a detector pickled before declarations existed restores.
    tracing: tuple[TracingDeclared, ...] = ()  # every TracingDeclared seen
    untraced_reports: int = 0  # reports of steps the declaration leaves out (dropped)
    _learned_last: tuple[int, np.ndarray] | None = None  # ``learn``'s last (epoch, ranks)

    def add_plan(self, plan: Plan) -> None:
        self.plans[plan.epoch] = plan
        self._expected[plan.epoch] = self._traced_of(plan.epoch, plan.roles)

    def declare(self, tracing: TracingDeclared) -> None:
        """A producer's tracing declaration: from its epoch on, expect only what it traces."""
        self.tracing = tuple(d for d in self.tracing if d.epoch != tracing.epoch) + (tracing,)
        for epoch, plan in self.plans.items():
            self._expected[epoch] = self._traced_of(epoch, plan.roles)
        for epoch, ranks in self.learned.items():
            ranks.intersection_update(self._traced_of(epoch, ranks))

    def _traced_of(self, epoch: int, ranks: Iterable[int]) -> frozenset[int]:
        declared = tracing_at(self.tracing, epoch)
        if declared is None or declared.traced_ranks is None:
            return frozenset(ranks)
        return frozenset(ranks) & frozenset(declared.traced_ranks)

    def expected(self, epoch: int) -> frozenset[int] | None:
        """The traced ranks of the plan of ``epoch``; None when no plan is known for it."""
        return self._expected.get(epoch)

    def untraced(self, epoch: int) -> set[int]:
        """The ranks of the plan of ``epoch`` that the declaration in force leaves untraced."""
        declared = tracing_at(self.tracing, epoch)
        if declared is None or declared.traced_ranks is None:
            return set()
        plan = self.plans.get(epoch)
        ranks = set(plan.roles) if plan is not None else set()
        return ranks - set(declared.traced_ranks)

    def step_traced(self, epoch: int, iteration: int) -> bool:
        declared = tracing_at(self.tracing, epoch)
        return declared is None or declared.step_traced(iteration)

    def heard(self, epoch: int, rank: int) -> None:
        declared = tracing_at(self.tracing, epoch) if self.tracing else None
        if declared is not None and not declared.rank_traced(rank):
            return  # an untraced rank's heartbeats say it lives, not that its reports are due
        self.learned.setdefault(epoch, set()).add(rank)

    def learn(self, epoch: int, ranks: np.ndarray) -> None:
        """``heard`` for many ranks of a job without a tracing declaration (the sharded merge's
        heartbeats). The merge hears the same 100k ranks every iteration, and adding them to the
        set again (a hash per rank) costs a tenth of its liveness work: the same ranks as last time
        are in the set already (nothing takes a rank out without a declaration)."""
        last = self._learned_last
        if last is not None and last[0] == epoch and np.array_equal(last[1], ranks):
            return
        self.learned.setdefault(epoch, set()).update(ranks.tolist())
        self._learned_last = (epoch, ranks.copy())

    def add(self, report: RankIteration) -> bool:
        """Hold a report until its iteration is complete; False if that iteration was already scored.
        A report of an untraced step is dropped (True: it is not late)."""
        key = (report.epoch, report.iteration)
        if key <= self.done:
            self.late_reports += 1
            return False
        if self.tracing and not self.step_traced(*key):
            self.untraced_reports += 1
            return True
        self.heard(report.epoch, report.rank)
        self.pending.setdefault(key, {})[report.rank] = report  # a duplicated report counts once
        return True

    def ready(self, watch: FailStopWatch, check_all: bool = True) -> list[tuple[int, int]]:
        """Keys that are complete now, oldest first (remove each with ``take``).

        ``check_all=False`` is the cheap path for a report from a rank the oldest iteration
        already has: only a full count can complete it then, so ranks are not walked one by one."""
        out = []
        for key in sorted(self.pending):
            if not (self._counted(key, watch) or (check_all and self._complete(key, watch))):
                break
            out.append(key)
        return out

    def oldest_has(self, rank: int) -> bool:
        """Whether the oldest waiting iteration already holds ``rank``'s report."""
        if not self.pending:
            return True
        return rank in self.pending[min(self.pending)]

    def _counted(self, key: tuple[int, int], watch: FailStopWatch) -> bool:
        expected = self.expected(key[0])
        if expected is None:
            return False
        reported = self.pending[key]
        alive = len(expected) - len(watch.dead & expected)
        return len(reported) >= alive and not (expected - reported.keys() - watch.dead)

    def take(self, key: tuple[int, int]) -> list[RankIteration]:
        self.done = max(self.done, key)
        return list(self.pending.pop(key).values())

    def all_keys(self) -> list[tuple[int, int]]:
        return sorted(self.pending)

    def _complete(self, key: tuple[int, int], watch: FailStopWatch) -> bool:
        epoch, iteration = key
        top = watch.top_iteration(epoch)
        later_epoch = any(k[0] > epoch for k in self.pending) or watch.newest_epoch() > epoch
        if top >= iteration + self.config.max_wait_iterations:
            return True
        expected: AbstractSet[int] | None = self.expected(epoch)
        if expected is None:
            if not later_epoch and top < iteration + self.config.unplanned_wait_iterations:
                return False
            expected = self.learned.get(epoch, set())
        reported = self.pending[key]
        waiting = expected - reported.keys() - watch.dead
        # Reports but no heartbeat yet: silence cannot be told from lag, so the wait is bounded. When
        # peers heartbeat the source surely does too and its first heartbeat is late, not absent (a
        # partition that lags from the job's start): the longer bound then.
        lag = self.config.unplanned_wait_iterations if watch.heartbeating else self.config.flush_lag_iterations
        bound = top >= iteration + lag
        for rank in waiting:
            passed = watch.passed(rank, epoch, iteration)  # None: nothing of its stream arrived
            if passed:
                continue
            if bound and passed is not None and not watch.has_heartbeat(rank):
                continue
            return False
        return True
