"""What the Security page shows, folded from the bus: refused sign-ins and lockouts, control events
the platform rejected, and jobs whose incidents come from more than one analytics writer.

Kept apart from ui/read_model.py (jobs, incidents, plans) because none of it is about one job's
training; the read model hands it every event it does not fold itself.

``control.rejected`` (published when the engine or the trainer refuses an unsigned or unauthorised
control event) is read through ``field`` so this fold works both with the contract's payload class
and with a plain dict payload of that kind.

Two analytics writers for one job are seen in two ways: incidents from two distinct ``source``
names, or one incident event id carried by two different payloads (two consumers with the same
source name and deterministic ids: one of them would otherwise be dropped without a word).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field as dc_field
from typing import Any

from collector.events import Envelope, SignInFailed

REJECTED_KIND = "control.rejected"
MAX_ROWS = 1000  # newest refused sign-ins and rejected events kept for the page


def field(payload: Any, name: str, default: Any = "") -> Any:
    """``payload.name`` for a model, ``payload[name]`` for a dict."""
    if isinstance(payload, dict):
        return payload.get(name, default)
    return getattr(payload, name, default)


@dataclass(frozen=True)
class RejectedEvent:
    time_s: float
    job: str
    by: str  # who refused it: the payload's ``reader`` if it names one, else the envelope's source
    event_id: str
    kind: str
    source: str  # who the rejected event claimed to come from
    reason: str


@dataclass
class WriterCheck:
    """Per job: which sources wrote incidents, and id reuse with different content."""

    sources: set[str] = dc_field(default_factory=set)
    conflicting_ids: int = 0


@dataclass
class SecurityLog:
    signin_failures: deque[tuple[float, SignInFailed]] = dc_field(default_factory=lambda: deque(maxlen=MAX_ROWS))
    lockouts: deque[tuple[float, SignInFailed]] = dc_field(default_factory=lambda: deque(maxlen=MAX_ROWS))
    rejected: deque[RejectedEvent] = dc_field(default_factory=lambda: deque(maxlen=MAX_ROWS))
    writers: dict[str, WriterCheck] = dc_field(default_factory=dict)
    _incident_digests: dict[str, str] = dc_field(default_factory=dict)

    def apply(self, e: Envelope) -> bool:
        """Fold ``e`` if it is a security event; True when it was one."""
        if isinstance(e.payload, SignInFailed):
            self.signin_failures.append((e.time_s, e.payload))
            if e.payload.locks:
                self.lockouts.append((e.time_s, e.payload))
            return True
        if e.kind == REJECTED_KIND:
            p = e.payload
            self.rejected.append(RejectedEvent(
                e.time_s, e.job, str(field(p, "reader") or e.source), str(field(p, "event_id")), str(field(p, "kind")), str(field(p, "source")),
                str(field(p, "reason"))))
            return True
        return False

    def refused(self, e: Envelope, reason: str, *, by: str) -> None:
        """A control event this process itself would not fold (its signature failed)."""
        self.rejected.append(RejectedEvent(e.time_s, e.job, by, e.id, e.kind, e.source, reason))

    def saw_incident_event(self, e: Envelope, *, duplicate: bool) -> None:
        """Called for every ``incident.*`` event, duplicates (already-seen ids) included."""
        check = self.writers.setdefault(e.job, WriterCheck())
        check.sources.add(e.source)
        digest = hashlib.sha256(e.payload.model_dump_json().encode()).hexdigest()
        if duplicate:
            if self._incident_digests.get(e.id, digest) != digest:
                check.conflicting_ids += 1
        else:
            self._incident_digests[e.id] = digest

    def writer_warnings(self, job: str) -> list[str]:
        """Plain sentences for the page, empty when one writer publishes the job's incidents."""
        check = self.writers.get(job)
        if check is None:
            return []
        out = []
        if len(check.sources) > 1:
            out.append(f"incidents of job {job} come from {len(check.sources)} sources ({', '.join(sorted(check.sources))}): "
                       "more than one analytics consumer is judging this job, so incidents may be doubled. "
                       "Stop all but one, or give each its own job / RESIHP_KAFKA_NAMESPACE.")
        if check.conflicting_ids:
            out.append(f"{check.conflicting_ids} incident events of job {job} reuse another event's id with different "
                       "content: two analytics consumers with the same source name (and different databases) are "
                       "publishing, and the console keeps only the first of each. Stop all but one.")
        return out
