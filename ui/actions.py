"""The only things the console writes: plan decisions and policy changes, each naming its actor.

Every check happens here, not in the page, so a page bug cannot publish an unauthorised decision:
the session must be live, the user an operator, and — for a decision — the plan must exist and
still await a verdict (a second approval of the same plan changes nothing). A decision names the
proposal it answers (its event id and plan digest), so it cannot approve another plan that later
takes the same id. When a check fails,
nothing is published and the exception's message says why, for the page to show as it is.

What passes is signed with the console's key (collector/auth.py), as ``ui:<user>``: the engine
acts on decisions and policies only when they carry it, so these checks are the only way a
decision reaches a job.
"""

from __future__ import annotations

import time

from collector.auth import Signer
from collector.events import Envelope, EventFactory, PolicyChanged, PolicyMode, Severity
from ui.auth import Session
from ui.feed import Feed


class ActionRefused(Exception):
    """The action is not possible in the current state (unknown or already decided plan)."""


def _factory(feed: Feed, job: str, actor: str) -> Signer:
    return Signer(EventFactory(job, actor, first_seq=feed.model.next_seq(job, actor)), "console")


def decide_plan(feed: Feed, session: Session, plan_id: str, *, approve: bool, comment: str = "",
                now_s: float | None = None) -> Envelope:
    """Publish a plan.decision by the session's user. Raises SessionExpired, NotAllowed or ActionRefused."""
    now_s = time.time() if now_s is None else now_s
    user = session.require_operator(now_s, "approve or reject plans")
    feed.refresh()
    plan = feed.model.plans.get(plan_id)
    if plan is None:
        raise ActionRefused(f"no proposed plan {plan_id!r} on the bus; refresh the page")
    if plan.decision is not None:
        _, d = plan.decision
        verdict = "approved" if d.approve else "rejected"
        raise ActionRefused(f"plan {plan_id} was already {verdict} by {d.actor}; nothing was changed")
    if plan.record is None:
        raise ActionRefused(f"plan {plan_id!r} is not the proposal the job's fold keeps under that id; refresh the page")
    # bound to the proposal on screen (its event id and plan digest): it approves that plan and no other
    event = _factory(feed, plan.job, user.actor).make(
        plan.record.decision(approve=approve, actor=user.actor, comment=comment.strip()))
    feed.publish(event)
    return event


def change_policy(feed: Feed, session: Session, job: str, *, mode: PolicyMode, auto_severities: list[Severity],
                  auto_min_p_real: float | None = None, now_s: float | None = None) -> Envelope:
    """Publish a policy.changed for ``job`` by the session's user. ``auto_min_p_real``: in auto mode,
    how sure the detector must be that a plan's incidents are real (None: severity alone). Raises
    SessionExpired or NotAllowed."""
    now_s = time.time() if now_s is None else now_s
    user = session.require_operator(now_s, "change the policy")
    if mode == PolicyMode.AUTO and not auto_severities:
        raise ActionRefused("auto-apply needs at least one severity to apply automatically; pick some or choose propose")
    if auto_min_p_real is not None and not 0.0 <= auto_min_p_real <= 1.0:
        raise ActionRefused(f"the auto-apply bar on p_real must be between 0 and 1, not {auto_min_p_real}")
    event = _factory(feed, job, user.actor).make(
        PolicyChanged(mode=mode, auto_severities=sorted(set(auto_severities), key=list(Severity).index),
                      auto_min_p_real=auto_min_p_real if mode == PolicyMode.AUTO else None, actor=user.actor))
    feed.publish(event)
    return event
