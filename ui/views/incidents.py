"""Incidents: a paginated list; one incident's timeline, evidence, proposed plan and the decision."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import streamlit as st

from collector.incident_lifecycle import IncidentRecord
from ui.actions import decide_plan
from ui.alerts import AlertmanagerUnreachable, FiringAlert, by_incident, firing_alerts
from ui.auth import Session
from ui.charts import downsample, plan_cells, plan_grid_chart, seq_len_chart, series_chart, slowdown_figure
from ui.feed import Feed
from ui.read_model import IncidentView, Mark, PlanView
from ui.views.common import SEVERITY_BADGE, clock, plain, run_action, writer_warnings

EVIDENCE_HALF_WINDOW = 60  # iterations either side of the detection drawn in the evidence plots


ALERTS_TTL_S = 5.0  # how long one answer of Alertmanager serves every page drawn


def render(feed: Feed, session: Session, page_size: int, alertmanager_url: str = "") -> None:
    alerts, unreachable = _alerts(alertmanager_url)
    selected = st.session_state.get("incident") or st.query_params.get("incident")
    if selected and selected in feed.model.incidents:
        if st.button("← all incidents", key="back"):
            st.session_state["incident"] = None
            st.query_params.pop("incident", None)
            st.rerun()
        _detail(feed, session, feed.model.incidents[selected], alerts.get(selected, []), unreachable)
    else:
        _firing(feed, alerts, unreachable)
        _list(feed, page_size)


@st.cache_data(ttl=ALERTS_TTL_S, show_spinner=False)
def _alerts_cached(alertmanager_url: str) -> tuple[dict[str, list[FiringAlert]], str]:
    try:
        return by_incident(firing_alerts(alertmanager_url)), ""
    except AlertmanagerUnreachable as exc:
        return {}, str(exc)


def _alerts(alertmanager_url: str) -> tuple[dict[str, list[FiringAlert]], str]:
    """Alertmanager's alerts by incident id, and why there are none if it could not be asked."""
    if not alertmanager_url:
        return {}, ""
    return _alerts_cached(alertmanager_url)


def _firing(feed: Feed, alerts: dict[str, list[FiringAlert]], unreachable: str) -> None:
    """The alerts Alertmanager holds for incidents, each with the way into its incident."""
    if unreachable:
        st.caption(plain(unreachable))
    if not alerts:
        return
    st.subheader("Firing alerts")
    for incident_id, mine in sorted(alerts.items()):
        for a in mine:
            c = st.columns([2, 1, 1, 4, 1])
            c[0].markdown(f"**{plain(a.name)}** ({plain(a.severity)})")
            c[1].text(a.job)
            c[2].text(a.state)
            c[3].text(a.summary)
            if incident_id in feed.model.incidents:
                c[4].button("Incident", key=f"alert-open-{incident_id}-{a.name}", on_click=_open, args=(incident_id,))
            else:
                c[4].caption("not on this bus")


def _alerts_section(mine: list[FiringAlert], unreachable: str) -> None:
    st.subheader("Alerts")
    if unreachable:
        st.caption(plain(unreachable))
    elif not mine:
        st.caption("No alert fires for this incident in Alertmanager.")
    for a in mine:
        st.error(f"**{plain(a.name)}** ({plain(a.severity)}, {plain(a.state)} since {plain(a.starts_at)}) — "
                 f"{plain(a.summary)}  \nrunbook: {plain(a.runbook_url)}")


def _open(incident_id: str) -> None:
    st.session_state["incident"] = incident_id
    st.query_params["incident"] = incident_id


def _list(feed: Feed, page_size: int) -> None:
    st.header("Incidents")
    model = feed.model
    writer_warnings(model)
    for job in model.jobs.values():  # not incidents: the bus was down, so no rank was judged meanwhile
        for o in sorted(job.outages.values(), key=lambda o: o.started_s):
            until = f"until {clock(o.ended_s)} ({o.duration_s or 0:.0f} s)" if o.ended_s is not None else "ongoing"
            st.info(f"bus outage · job {plain(job.job)} · from {clock(o.started_s)} {until}: fail-stop judgement "
                    f"of {o.ranks_suspended} ranks suspended")
    show = st.radio("Show", ["open", "all"], horizontal=True, key="inc_filter")
    items = [i for i in model.incidents_sorted() if show == "all" or i.resolved is None]
    if not items:
        st.info("No incidents" + (" open." if show == "open" else " yet."))
        return
    pages = max(1, math.ceil(len(items) / page_size))
    page = st.number_input(f"Page (of {pages})", min_value=1, max_value=pages, value=1, key="inc_page") if pages > 1 else 1
    rows = items[(page - 1) * page_size: page * page_size]
    st.caption(f"{len(items):,} incidents; showing {len(rows)}")
    widths = [2, 1, 1, 0.9, 1.3, 0.7, 0.7, 3, 1]
    head = st.columns(widths)
    for col, name in zip(head, ["incident", "job", "category", "severity", "state", "iter.", "p real", "summary", ""]):
        col.markdown(f"**{name}**")
    for inc in rows:
        c = st.columns(widths)
        c[0].text(inc.incident_id)
        c[1].text(inc.job)
        c[2].text(inc.opened.category.value)
        c[3].markdown(SEVERITY_BADGE[inc.severity.value])
        c[4].text(model.incident_state(inc))
        c[5].text(str(inc.opened.iteration))
        c[6].text(p_real_label(inc.record))
        c[7].text(inc.opened.summary)
        c[8].button("Open", key=f"open-{inc.incident_id}", on_click=_open, args=(inc.incident_id,))


def _detail(feed: Feed, session: Session, inc: IncidentView, alerts: list[FiringAlert], unreachable: str) -> None:
    model = feed.model
    st.header(f"Incident {plain(inc.incident_id)}")
    st.markdown(f"{SEVERITY_BADGE[inc.severity.value]} · **{plain(model.incident_state(inc))}** · job {plain(inc.job)} · "
                f"{inc.opened.category.value} · detected at iteration {inc.opened.iteration} — {plain(inc.opened.summary)}")
    st.caption(f"p real {p_real_label(inc.record)}: how sure the detector is that the fault is real (calibrated on "
               f"the detection suite) · place confidence {inc.record.place_confidence:.2f}: how sure it is of the place")

    _alerts_section(alerts, unreachable)

    st.subheader("Timeline")
    steps = model.timeline(inc)
    cols = st.columns(len(steps))
    for col, step in zip(cols, steps):
        done = step.time_s is not None
        col.markdown(f"{':green[●]' if done else ':gray[○]'} **{step.label}**  \n{clock(step.time_s) if done else 'not yet'}")
        if step.detail:
            col.caption(plain(step.detail))

    st.subheader("Evidence")
    _evidence(feed, inc)

    plan = model.plans.get(inc.plan_ids[-1]) if inc.plan_ids else None
    st.subheader("Plan")
    if plan is None:
        st.info("No plan proposed for this incident yet.")
        if inc.withheld:  # the engine said why (plan.withheld)
            at, why = inc.withheld[-1]
            say = st.info if why.waiting else st.warning
            say(f"Remediation engine at {clock(at)} (epoch {why.base_epoch}) — "
                f"{'waiting' if why.waiting else 'not planned'}: {plain(why.reason)}")
        return
    _plan(feed, plan)
    _decision(feed, session, plan)


def p_real_label(record: IncidentRecord) -> str:
    """An incident's p_real as the console shows it: uncalibrated says so rather than showing 0.50."""
    return f"{record.p_real:.2f}" if record.calibrated else "uncalibrated"


def _evidence(feed: Feed, inc: IncidentView) -> None:
    job = feed.model.jobs.get(inc.job)
    ev = inc.latest_evidence
    first, last = inc.opened.iteration - EVIDENCE_HALF_WINDOW, inc.opened.iteration + EVIDENCE_HALF_WINDOW
    tabs = st.tabs(["observed vs predicted", "per-rank slowdown", "sequence lengths", "locations"])
    with tabs[0]:
        series = job.predictions.arrays() if job is not None else {}
        if job is not None and len(series["iteration"]):
            keep = (series["iteration"] >= first) & (series["iteration"] <= last)
            cols = {k: series[k][keep] for k in ("iteration", "observed_s", "predicted_s", "tokens")}
        else:
            cols = {"iteration": np.asarray(ev.iterations), "observed_s": np.asarray(ev.observed_s),
                    "predicted_s": np.asarray(ev.predicted_s), "tokens": np.zeros(len(ev.iterations))}
        if len(cols["iteration"]):
            marks = [m for m in (job.marks if job else []) if m.kind == "reshape"]
            marks.append(Mark("incident", inc.opened.iteration, inc.opened_time_s, inc.opened.summary))
            st.altair_chart(series_chart(downsample(cols), marks, kind="time"), width="stretch")
        st.caption(f"detector statistic: {plain(ev.statistic or '—')}; {plain(ev.note)}")
    with tabs[1]:
        suspects = {loc.rank: loc.factor for loc in inc.latest_locations if loc.rank is not None}
        if job is not None and len(job.factors):
            iterations, ranks, matrix = job.slowdown(first, last)
            fig = slowdown_figure(iterations, ranks, matrix, suspects=suspects)
            st.pyplot(fig, clear_figure=True)
        elif ev.rank_factors:
            st.caption("no rank health from the detector in the console's window; the incident's evidence:")
            st.bar_chart(pd.DataFrame({"rank": list(ev.rank_factors), "slowdown": list(ev.rank_factors.values())}),
                         x="rank", y="slowdown")
        else:
            st.info("no per-rank data for this incident")
    with tabs[2]:
        q = job.ranks.seq_len_quantiles(first, last) if job is not None else {"iteration": np.zeros(0)}
        if len(q["iteration"]):
            st.altair_chart(seq_len_chart(q), width="stretch")
            st.caption("band: 5th–95th percentile of packed sequence lengths; line: median; dashed: longest")
        else:
            st.info("no sequence lengths reported around this incident")
    with tabs[3]:
        st.dataframe(pd.DataFrame([loc.model_dump(exclude_none=True) for loc in inc.latest_locations]), hide_index=True)


def _plan(feed: Feed, plan: PlanView) -> None:
    p = plan.proposed
    gain = (p.predicted_tokens_per_s / p.current_tokens_per_s - 1) if p.current_tokens_per_s else float("nan")
    extra_tps = p.predicted_tokens_per_s - p.current_tokens_per_s
    payback_s = p.reshape_cost_s * p.current_tokens_per_s / extra_tps if extra_tps > 0 else float("inf")
    m = st.columns([1.3, 1, 1, 1.3])
    m[0].metric("Predicted gain", f"{gain * 100:+.1f}%", f"{p.current_tokens_per_s:,.0f} → {p.predicted_tokens_per_s:,.0f} tokens/s")
    m[1].metric("Reshape cost", f"{p.reshape_cost_s:.1f} s")
    m[2].metric("Pays back after", f"{payback_s:.0f} s" if math.isfinite(payback_s) else "never")
    m[3].markdown(f"Status  \n**{plain(plan.status)}**")
    st.caption(f"{plain(plan.plan_id)} · strategy {plain(p.strategy)} · proposed by {plain(plan.source)} at "
               f"{clock(plan.proposed_time_s)} · epoch {p.base_epoch} → {p.plan.epoch}")
    st.markdown("**Diff**\n" + "\n".join(f"- {plain(line)}" for line in p.diff) if p.diff else "no differences listed")
    if plan.node_orders:
        st.markdown("**Node orders**\n" + "\n".join(f"- {plain(line)}" for line in plan.node_orders))
    job = feed.model.jobs.get(plan.job)
    base = feed.model.base_plan(plan)
    layout = job.layout if job else {}
    health = job.health if job else {}
    colour_by = st.radio("Colour by", ["TP group", "PP stage", "DP replica", "health"], horizontal=True,
                         key=f"plan_colour_{plan.plan_id}")
    left, right = st.columns(2)
    current_cells = plan_cells(base, layout, health)
    devices = [c.device for c in current_cells]
    with left:
        st.markdown(f"**Current** (epoch {p.base_epoch})")
        if current_cells:
            st.altair_chart(plan_grid_chart(current_cells, colour_by), width="content")
    with right:
        st.markdown(f"**Proposed** (epoch {p.plan.epoch}, {p.plan.shape()})")
        st.altair_chart(plan_grid_chart(plan_cells(p.plan, layout, health, devices=devices), colour_by),
                        width="content")


def _decision(feed: Feed, session: Session, plan: PlanView) -> None:
    st.subheader("Decision")
    if plan.decision is not None:
        t, d = plan.decision
        verdict = "Approved" if d.approve else "Rejected"
        st.success(f"{verdict} by {plain(d.actor)} at {clock(t)}" + (f" — “{plain(d.comment)}”" if d.comment else ""))
        return
    if not session.user.can_decide:
        st.caption("You are signed in as a viewer: only operators can approve or reject.")
    comment = st.text_area("Comment", key=f"comment-{plan.plan_id}", placeholder="why (kept with the decision)")
    a, r, _ = st.columns([1, 1, 6])
    approve = a.button("Approve", key=f"approve-{plan.plan_id}", type="primary")
    reject = r.button("Reject", key=f"reject-{plan.plan_id}")
    if approve or reject:
        run_action(lambda: decide_plan(feed, session, plan.plan_id, approve=approve, comment=comment),
                   lambda event: f"{'Approved' if approve else 'Rejected'} plan {plain(plan.plan_id)} as "
                                 f"{plain(session.user.actor)} (event {event.id[:8]} on the bus)")
