"""What the remediation engine publishes, and the clock it stamps it with.

:class:`EngineClock` is the engine's sense of time: the newest *signed* event time it read (so a
replay decides as the run did, and a signer whose clock runs ahead cannot skip waits), and the
newest event time of any kind (how long the job has gone without a change; what reactions are
stamped with). :class:`EngineOutput` makes the engine's events (signed, stamped, with ids derived
from what they answer) and keeps why something was not planned (``refusals``), each published once
as ``plan.withheld``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from collector.auth import Signer, needs_signature
from collector.events import (
    Envelope, Payload, PlanDecision, PlanProposed, PlanRolledBack, PlanVerified, PlanWithheld, ReconfigureCommand,
)
from remediation.lifecycle import LifecycleState, reaction_id

log = logging.getLogger("resihp.remediation")


@dataclass
class EngineClock:
    """The engine's two clocks, both clamped at ``skew_s`` past this host's wall clock."""

    skew_s: float
    signed_s: float = float("-inf")  # the newest signed event time read: the engine's clock
    read_s: float = float("-inf")  # the newest event time read, signed or not, never behind ``signed_s``

    def advance(self, event: Envelope) -> None:
        """Move the clock to a verified control event's time, at most ``skew_s`` past this host's
        wall clock. Unsigned events (telemetry, rank health) are anyone's: one stamped a year ahead
        would otherwise end every wait (for a location, for a probe's answer) from then on.

        Every event, signed or not, moves the read clock, clamped the same way and never behind the
        clock: it measures how long the job has gone without a change (the horizon: whether a
        reshape pays) and stamps reactions, so a command issued after a long calm is not born
        expired on the executors' clocks. An unsigned writer moves it at most ``skew_s`` past the
        wall clock."""
        time_s = min(event.time_s, time.time() + self.skew_s)
        if needs_signature(event.kind):  # admitted, so its signature verified
            self.signed_s = max(self.signed_s, time_s)
        self.read_s = max(self.read_s, self.signed_s, time_s)

    @property
    def signed(self) -> float | None:
        """The engine's clock, None before the first signed event."""
        return self.signed_s if self.signed_s != float("-inf") else None

    @property
    def read(self) -> float | None:
        """The read clock, None before the first event."""
        return self.read_s if self.read_s != float("-inf") else None


@dataclass
class EngineOutput:
    """The engine's events: signed by the engine, stamped with the read clock, their ids derived
    from what they answer (so a replaying engine re-derives them and every reader keeps one)."""

    job: str
    signer: Signer
    clock: EngineClock
    state: LifecycleState
    refusals: list[str] = field(default_factory=list)  # why something could not be planned, in order (also logged)
    _reported: set[str] = field(default_factory=set)
    _withheld: list[Envelope] = field(default_factory=list)  # plan.withheld events due with the next reactions

    def make(self, key: str, payload: Payload) -> Envelope:
        """A reaction, stamped with the engine's read clock (the newest event time it read): a reaction
        happens at the time of what caused it, so a replay re-derives the same event, and a job on
        a simulated clock gets reactions on that clock, not the wall's."""
        return self.signer.make(payload, event_id=reaction_id(self.job, key), time_s=self.clock.read)

    def refuse(self, reason: str, key: str | None = None, waiting: bool = False) -> None:
        """Report why something is not planned (once per key): logged, kept in ``refusals``, and
        published as ``plan.withheld`` with the next reactions."""
        key = key or reason
        if key in self._reported:
            return
        self._reported.add(key)
        self.refusals.append(reason)
        log.warning("remediation job=%s epoch=%s: %s", self.job, self.state.running_epoch, reason)
        s = self.state
        self._withheld.append(self.make(f"withheld/{key}", PlanWithheld(
            reason=reason, base_epoch=s.running_epoch, incident_ids=[i.incident_id for i in s.open_incidents()],
            waiting=waiting)))

    def take_withheld(self) -> list[Envelope]:
        """The ``plan.withheld`` events made since the last call."""
        out, self._withheld = self._withheld, []
        return out

    def logged(self, e: Envelope) -> None:
        """Log a reaction the engine published (refusals are logged where they are made)."""
        if not isinstance(e.payload, PlanWithheld):
            log.info("remediation job=%s epoch=%s: %s", self.job, self.state.running_epoch, said(e))


def said(e: Envelope) -> str:
    """One log line for a reaction the engine published: what an operator tailing the engine's
    log needs to follow a plan from proposal to verdict (the full event is on the control topic)."""
    p = e.payload
    if isinstance(p, PlanProposed):
        return (f"proposed {p.plan_id} ({p.strategy}, epoch {p.base_epoch}→{p.plan.epoch}, "
                f"{p.current_tokens_per_s:,.0f} → {p.predicted_tokens_per_s:,.0f} tokens/s): {'; '.join(p.diff)}")
    if isinstance(p, ReconfigureCommand):
        return f"commanded {p.plan_id} as epoch {p.plan.epoch} ({p.command_id})"
    if isinstance(p, PlanDecision):
        return f"{'approved' if p.approve else 'rejected'} {p.plan_id} ({p.actor})"
    if isinstance(p, PlanVerified):
        return (f"verified {p.plan_id}: {p.measured_tokens_per_s:,.0f} tokens/s measured, "
                f"{p.predicted_tokens_per_s:,.0f} predicted")
    if isinstance(p, PlanRolledBack):
        return f"rolled back {p.plan_id}: {p.reason}"
    return e.kind
