"""The demo's observer: reads the whole log as one more consumer group, folds what the progress
line and the summary need, and records every record it reads as a trace.

It is read-only towards the platform (it publishes nothing) and opens no other process's DuckDB
file. Per-rank telemetry is most of the log, so it is counted and traced without being validated
(only its header is parsed); every other event is decoded with the contract's models. A record
that does not decode is counted as a dead letter here and left for the consumers to dead-letter.

The trace is collector/trace.py's format, rows in the order this consumer read them (per topic the
log's order; across topics, poll order), so ``resihp replay`` and the console's Replay page read it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from collector import topics
from collector.bus import Bus
from collector.codec import InvalidEvent, decode
from collector import incident_lifecycle, plan_lifecycle
from collector.auth import load_keyring, needs_signature
from collector.events import (
    CommandAck, Envelope, FaultInjected, IterationSummary, Location, PlanCurrent, PlanDecision, PlanProposed,
    PlanRolledBack, PlanVerified, ProbeRequest, ReconfigureCommand,
)
from collector.incident_lifecycle import IncidentLifecycle, IncidentRecord
from collector.plan_lifecycle import PlanLifecycle, PlanStatus
from collector.trace import EventHeader, TraceWriter


@dataclass
class Injected:
    fault_id: str
    category: str
    location: Location
    start_iteration: int
    time_s: float


@dataclass
class PlanRow:
    """One plan as the progress line and the summary show it: the proposal's figures and where the
    plan lifecycle's fold says it stands (collector/plan_lifecycle.py's ``PlanRecord``)."""

    plan_id: str
    strategy: str
    base_epoch: int
    epoch: int
    incident_ids: list[str]
    diff: list[str]
    predicted_tokens_per_s: float
    current_tokens_per_s: float
    proposed_time_s: float
    status: PlanStatus = PlanStatus.PROPOSED  # the plan lifecycle fold's state
    decided_by: str | None = None
    applied_time_s: float | None = None
    pause_s: float = 0.0
    measured_tokens_per_s: float | None = None
    verdict: str | None = None  # the verified or rolled-back event's reason, or why the fold closed it


@dataclass
class Summary:
    """One ``telemetry.summary``: a whole iteration as the launcher saw it."""

    time_s: float
    epoch: int
    iteration: int
    tokens: int
    wall_s: float


@dataclass
class LogState:
    telemetry_records: int = 0
    records: int = 0
    undecodable: int = 0
    unauthenticated: int = 0  # control events whose signature failed: not folded (docs/security.md)
    by_kind: dict[str, int] = field(default_factory=dict)
    summaries: list[Summary] = field(default_factory=list)
    injected: list[Injected] = field(default_factory=list)
    plans: dict[str, PlanRow] = field(default_factory=dict)
    lifecycle: PlanLifecycle = field(default_factory=PlanLifecycle)  # the plan lifecycle's fold
    incident_fold: IncidentLifecycle = field(default_factory=IncidentLifecycle)  # the incidents' fold
    probes: int = 0
    epoch: int = 0
    plan_shape: str = ""
    iteration: int = -1
    first_time_s: float | None = None
    last_time_s: float | None = None

    @property
    def incidents(self) -> dict[str, IncidentRecord]:
        return self.incident_fold.incidents

    @incidents.setter
    def incidents(self, incidents: dict[str, IncidentRecord]) -> None:
        self.incident_fold.incidents = incidents

    @property
    def open_incidents(self) -> list[IncidentRecord]:
        return self.incident_fold.open_incidents()

    def plans_with(self, *statuses: str) -> list[PlanRow]:
        return [p for p in self.plans.values() if p.status in statuses]


class LogWatch:
    """Folds the log of ``job`` on ``bus`` into a LogState; ``trace_path`` records it (None: do not)."""

    def __init__(self, bus: Bus, job: str, trace_path: Path | None) -> None:
        self.bus = bus
        self.job = job
        self.state = LogState()
        self.consumer = bus.consumer(f"demo-watch-{uuid.uuid4().hex[:8]}", list(topics.RECORD_TOPICS),
                                     on_assign=lambda parts: {tp: 0 for tp in parts})
        self.trace = TraceWriter(trace_path) if trace_path is not None else None
        self._closed = False

    def poll(self, timeout_s: float = 0.2, max_records: int = 20_000) -> int:
        """Read and fold what is new; returns how many records were read."""
        records = self.consumer.poll(max_records=max_records, timeout_s=timeout_s)
        s = self.state
        for r in records:
            s.records += 1
            header = EventHeader.parse(r.value)
            if header is None:
                s.undecodable += 1
                continue
            s.by_kind[header.kind] = s.by_kind.get(header.kind, 0) + 1
            if self.trace is not None:
                try:
                    self.trace.write_encoded(header, r.value)
                except InvalidEvent:  # a binary record whose arrays do not decode: not recordable as JSON
                    s.undecodable += 1
                    continue
            if header.kind.startswith("telemetry."):
                s.telemetry_records += 1
            if header.kind == "telemetry.iteration" or header.job != self.job:
                continue
            try:
                event = decode(r.value)
            except InvalidEvent:
                s.undecodable += 1
                continue
            s.first_time_s = event.time_s if s.first_time_s is None else min(s.first_time_s, event.time_s)
            s.last_time_s = event.time_s if s.last_time_s is None else max(s.last_time_s, event.time_s)
            self._fold(event)
        return len(records)

    def _fold(self, event: Envelope) -> None:
        s, p, time_s = self.state, event.payload, event.time_s
        if needs_signature(event.kind) and load_keyring().verify(event) is not None:
            s.unauthenticated += 1  # a forged incident or plan is no part of the run's story
            return
        if isinstance(p, PlanProposed | PlanDecision | ReconfigureCommand | CommandAck | PlanVerified | PlanRolledBack
                      | PlanCurrent):
            self._fold_plan(event)
        if isinstance(p, IterationSummary):
            s.summaries.append(Summary(time_s, p.epoch, p.iteration, p.tokens, p.wall_s))
            s.iteration = max(s.iteration, p.iteration)
        elif isinstance(p, FaultInjected):
            if not any(f.fault_id == p.fault_id for f in s.injected):  # a fault's end repeats its id
                s.injected.append(Injected(p.fault_id, p.category.value, p.location, p.start_iteration, time_s))
        elif isinstance(p, incident_lifecycle.PAYLOADS):
            incident_lifecycle.transition(s.incident_fold, event)  # its signature verified above
        elif isinstance(p, ProbeRequest):
            s.probes += 1
        if isinstance(p, CommandAck):
            s.epoch = max(s.epoch, p.running_epoch)
        elif isinstance(p, PlanCurrent):
            s.epoch = max(s.epoch, p.plan.epoch)
            s.plan_shape = p.plan.shape()

    def _fold_plan(self, event: Envelope) -> None:
        """The plan lifecycle's fold, then this watcher's rows of it (every plan: an epoch change
        can close plans other than the event's)."""
        s, p = self.state, event.payload
        if isinstance(p, PlanProposed):
            s.plans.setdefault(p.plan_id, PlanRow(
                p.plan_id, p.strategy, p.base_epoch, p.plan.epoch, list(p.incident_ids), list(p.diff),
                p.predicted_tokens_per_s, p.current_tokens_per_s, event.time_s))
        changed = plan_lifecycle.step(s.lifecycle, event)
        for plan_id, record in s.lifecycle.plans.items():
            rec = s.plans.get(plan_id)
            if rec is None:
                continue
            rec.status, rec.decided_by = record.status, record.decided_by
            if record.applied_at_s is not None and record.ack is not None:
                rec.applied_time_s, rec.pause_s = record.applied_at_s, record.ack.pause_s
            rec.measured_tokens_per_s = record.measured_tokens_per_s
            if record is changed and isinstance(p, PlanVerified | PlanRolledBack):
                rec.verdict = p.reason
            elif record.verdict and rec.verdict is None:
                rec.verdict = record.verdict

    def drain(self, idle_polls: int = 3) -> None:
        """Read until ``idle_polls`` polls in a row bring nothing."""
        idle = 0
        while idle < idle_polls:
            idle = 0 if self.poll(timeout_s=0.3) else idle + 1

    def close(self) -> Path | None:
        """Stop reading; close the trace (Parquet writes its footer now) and return its path.
        Calling it again does nothing more."""
        if not self._closed:
            self._closed = True
            self.consumer.close()
            if self.trace is not None:
                self.trace.close()
        return None if self.trace is None else self.trace.path
