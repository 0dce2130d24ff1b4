"""What the demo says at the end: which faults were found where, what was applied, and throughput
before, during and after each fault — from the log alone (the LogState the watcher folded).

Throughput over a window is tokens of the iterations that ended in it (``telemetry.summary``)
divided by the window's length, so a reshape pause or a hang on a dead rank counts as time with
no tokens. All times are the launcher's own clock (one host): no two hosts' clocks are compared.

The windows' edges are drawn on the trainer's own iteration stream, not at the times other
records were stamped: a fault begins where the last iteration before its first faulty one ended,
and a plan takes over where the first iteration under its epoch began. The fault record and the
plan's acknowledgement are published by other processes at other moments (the faulty rank after
its iteration, the trainer after its first reshaped step), and when the loop closes within two or
three iterations a window drawn at those stamps holds a healthy or reshaped iteration more or
less, and reads tens of percent off. The reshape pause falls in "during": the job ran faulty
until the new layout's first iteration began.
"""

from __future__ import annotations

from dataclasses import dataclass

from collector.events import Location
from collector.incident_lifecycle import IncidentRecord
from resihp.demo.watch import Injected, LogState, PlanRow
from resihp.referee import grade, in_window

WARMUP_SKIP_ITERATIONS = 3  # the first iterations carry start-up effects, not the healthy rate
MATCH_SLACK_ITERATIONS = 3


@dataclass
class FaultStory:
    fault: Injected
    incident: IncidentRecord | None
    localisation: str  # "rank", "tp_group", "node", "wrong", "missed"
    plan: PlanRow | None
    before_tokens_per_s: float | None
    during_tokens_per_s: float | None
    after_tokens_per_s: float | None
    onset_s: float  # where the "during" window begins (see the module's docstring)
    fixed_s: float | None  # where the "after" window begins; None when no plan fixed the fault

    @property
    def detected(self) -> bool:
        return self.incident is not None and self.localisation in ("rank", "tp_group", "node")


def tokens_per_s(state: LogState, t0: float, t1: float) -> float | None:
    """Tokens of iterations that ended in (t0, t1] per second of that window; None if it is empty.
    (An iteration that ended at a fault's onset ran before it.)"""
    if t1 <= t0:
        return None
    tokens = sum(s.tokens for s in state.summaries if t0 < s.time_s <= t1)
    return tokens / (t1 - t0)


def onset_s(state: LogState, fault: Injected) -> float:
    """Where the fault's window begins: the end of the last iteration before its first faulty one
    that was recorded by the time the fault was (the fault's own stamp when there is none)."""
    ends = [s.time_s for s in state.summaries if s.iteration < fault.start_iteration and s.time_s <= fault.time_s]
    return max(ends) if ends else fault.time_s


def fixed_s(state: LogState, plan: PlanRow, after_s: float) -> float | None:
    """Where the plan's layout took over: the start of the first iteration recorded under its epoch
    after ``after_s``; the plan's acknowledgement time when the stream carries no epochs; None when
    the plan was never applied."""
    if plan.applied_time_s is None:
        return None
    under = [s for s in state.summaries if s.epoch >= plan.epoch and s.time_s > after_s]
    if not under:
        return plan.applied_time_s
    first = min(under, key=lambda s: s.time_s)
    return max(after_s, first.time_s - first.wall_s)


def measured_start_s(state: LogState) -> float:
    """Where throughput windows start: the end of the first few iterations (start-up is not the rate)."""
    first = min(s.iteration for s in state.summaries)
    skipped = [s.time_s for s in state.summaries if s.iteration < first + WARMUP_SKIP_ITERATIONS]
    return max(skipped) if skipped else min(s.time_s for s in state.summaries)


def match_incident(state: LogState, fault: Injected) -> tuple[IncidentRecord | None, str]:
    """The first incident of the fault's category opened from its onset on (less a few iterations'
    slack) that names its device, graded by the referee (resihp/referee.py: ``grade``): one naming
    the rank wins over an earlier one naming only its TP group or node; "wrong" when the first
    incident of the category names another place, "missed" when there is none."""
    best: tuple[IncidentRecord | None, str] = (None, "missed")
    for inc in sorted(state.incidents.values(), key=lambda i: i.opened_at_s):
        # A dead rank's incident names the last iteration the detector saw, which may precede the
        # iteration the launcher counts the death at: allow a few iterations of slack.
        if inc.category != fault.category or not in_window(inc.opened_iteration, fault.start_iteration, None,
                                                           before=MATCH_SLACK_ITERATIONS, after=0):
            continue
        for loc in inc.locations:
            where = grade(loc, fault.location)
            if where == "rank" or (where and best[0] is None):
                best = (inc, where)
            if where == "rank":
                return best
        if best[0] is None:
            best = (inc, "wrong")
    return best


def _fixing_plan(state: LogState, fault: Injected, incident: IncidentRecord | None) -> PlanRow | None:
    applied = [p for p in state.plans.values() if p.applied_time_s is not None and p.applied_time_s >= fault.time_s]
    applied.sort(key=lambda p: p.applied_time_s or 0.0)
    if incident is not None:
        for p in applied:
            if incident.incident_id in p.incident_ids:
                return p
    return applied[0] if applied else None


def fault_stories(state: LogState) -> list[FaultStory]:
    """Each injected fault with its incident, its plan and the three throughput windows."""
    if not state.summaries:
        return []
    start = measured_start_s(state)
    end = max(s.time_s for s in state.summaries)
    faults = sorted(state.injected, key=lambda f: f.time_s)
    out: list[FaultStory] = []
    prev_fixed = start
    onsets = [onset_s(state, f) for f in faults]
    for k, fault in enumerate(faults):
        incident, where = match_incident(state, fault)
        plan = _fixing_plan(state, fault, incident)
        onset = onsets[k]
        next_onset = onsets[k + 1] if k + 1 < len(faults) else end
        fixed = fixed_s(state, plan, onset) if plan is not None else None
        if fixed is not None and fixed > next_onset:
            fixed = None  # not fixed before the next fault began
        out.append(FaultStory(
            fault, incident, where, plan,
            tokens_per_s(state, prev_fixed, onset),
            tokens_per_s(state, onset, fixed if fixed is not None else next_onset),
            tokens_per_s(state, fixed, next_onset) if fixed is not None else None,
            onset, fixed,
        ))
        prev_fixed = fixed if fixed is not None else next_onset
    return out


def overall_tokens_per_s(state: LogState, stories: list[FaultStory]) -> dict[str, float | None]:
    """Before the first fault, during every fault (time-weighted), after the last fix."""
    if not stories:
        return {"before": None, "during": None, "after": None}
    tokens = seconds = 0.0
    for st in stories:
        t0 = st.onset_s
        t1 = st.fixed_s if st.after_tokens_per_s is not None else None
        if t1 is None:
            later = [x.onset_s for x in stories if x.onset_s > t0]
            t1 = min(later) if later else max(s.time_s for s in state.summaries)
        rate = tokens_per_s(state, t0, t1)
        if rate is not None:
            tokens += rate * (t1 - t0)
            seconds += t1 - t0
    return {"before": stories[0].before_tokens_per_s, "during": tokens / seconds if seconds else None,
            "after": stories[-1].after_tokens_per_s}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _loc_text(locs: list[Location]) -> str:
    parts = []
    for loc in locs:
        if loc.rank is not None:
            text = f"rank {loc.rank}"
        elif loc.tp_group:
            text = "TP group " + ",".join(str(d) for d in loc.tp_group)
        elif loc.node is not None:
            text = f"node {loc.node}"
        elif loc.link:
            text = f"link {loc.link[0]}-{loc.link[1]}"
        else:
            text = f"{loc.target} (no place named)"
        if 1.0 < loc.factor < 1e6:
            text += f" ×{loc.factor:.2f}"
        parts.append(text)
    return ", ".join(parts) or "?"


def summary_lines(state: LogState, stories: list[FaultStory]) -> list[str]:
    """The human summary printed at the end of the demo."""
    lines = []
    n_inc = len(state.incidents)
    plans = list(state.plans.values())
    applied = [p for p in plans if p.applied_time_s is not None]
    lines.append(f"incidents: {n_inc} ({sum(1 for i in state.incidents.values() if not i.is_open)} resolved) · "
                 f"probes: {state.probes} · plans: {len(plans)} proposed, {len(applied)} applied, "
                 f"{sum(1 for p in plans if p.status == 'verified')} verified, "
                 f"{sum(1 for p in plans if p.status == 'rolled_back')} rolled back · "
                 f"pauses: {len(applied)} ({sum(p.pause_s for p in applied):.1f} s)")
    for st in stories:
        f = st.fault
        what = f"{f.category} on device {f.location.rank}" + (
            f" ×{f.location.factor:g}" if f.category == "fail_slow" else "") + f" at iteration {f.start_iteration}"
        lines.append(f"• {what}")
        if st.incident is None:
            lines.append("    detected: NO")
        else:
            i = st.incident
            lines.append(f"    detected at iteration {i.opened_iteration} (+{max(0, i.opened_iteration - f.start_iteration)}): "
                         f"{_loc_text(i.locations)} [{st.localisation}], severity {i.severity}"
                         + (f", confirmed by {i.confirmed_by}" if i.confirmed_by else ""))
        if st.plan is None:
            lines.append("    plan: none applied")
        else:
            p = st.plan
            lines.append(f"    plan {p.plan_id} ({p.strategy}, epoch {p.base_epoch}→{p.epoch}) decided by "
                         f"{p.decided_by or '-'}, {p.status}; pause {p.pause_s:.1f} s")
            for d in p.diff[:4]:
                lines.append(f"      {d}")
            if p.verdict:
                lines.append(f"      {p.status.replace('_', ' ')}: {p.verdict}")
        lines.append(f"    tokens/s  before {_fmt(st.before_tokens_per_s)}  during {_fmt(st.during_tokens_per_s)}  "
                     f"after {_fmt(st.after_tokens_per_s)}")
    return lines
