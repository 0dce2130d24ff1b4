"""Jobs: observed against predicted over time, marked with incidents and reshapes; the plan grid."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from collector.events import RankState
from ui.charts import downsample, goodput_bar, plan_cells, plan_grid_chart, series_chart
from ui.feed import Feed
from ui.read_model import ConsoleJob
from ui.views.common import clock, pick_job, plain, writer_warnings

WINDOWS = {"last 500 iterations": 500, "last 5,000 iterations": 5000, "all": None}


def render(feed: Feed, refresh_s: float) -> None:
    st.header("Jobs")
    job_name = pick_job(feed.model, key="jobs_job")
    if job_name is None:
        return
    writer_warnings(feed.model, job_name)
    auto = st.toggle("Auto-refresh", value=False, key="jobs_auto", help=f"re-read the bus every {refresh_s:g} s")

    @st.fragment(run_every=refresh_s if auto else None)
    def body() -> None:
        if auto:
            feed.refresh()
        _job_body(feed, feed.model.jobs[job_name])

    body()


def _job_body(feed: Feed, job: ConsoleJob) -> None:
    series = job.predictions.arrays()
    open_incidents = [i for i in feed.model.incidents.values() if i.job == job.job and i.resolved is None]
    shape = job.current_plan.shape() if job.current_plan is not None else _layout_shape(job)
    _goodput_headline(feed, job.job)
    m = st.columns([1, 2, 1, 1.6, 1])
    m[0].metric("Plan epoch", job.running_epoch())
    m[1].metric("Layout", shape)
    m[2].metric("Ranks", len(job.layout) or (len(job.current_plan.devices) if job.current_plan else 0))
    if len(series["iteration"]):
        last = slice(-20, None)
        obs = float(np.mean(series["observed_s"][last]))
        pred = float(np.mean(series["predicted_s"][last]))
        m[3].metric("Iteration time (last 20)", f"{obs:.2f} s", f"{(obs / pred - 1) * 100:+.0f}% vs predicted" if pred else None,
                    delta_color="inverse")
    m[4].metric("Open incidents", len(open_incidents))
    _bus_outages(job)
    _telemetry_notices(job)

    window = st.radio("History", list(WINDOWS), horizontal=True, key="jobs_window", index=0)
    if len(series["iteration"]):
        n = WINDOWS[window]
        if n is not None:
            keep = series["iteration"] >= series["iteration"][-1] - n
            series = {k: v[keep] for k, v in series.items()}
        shown = downsample({k: series[k] for k in ("iteration", "observed_s", "predicted_s", "tokens")})
        st.caption(f"{len(series['iteration']):,} iterations, drawn as {len(shown['iteration']):,} points; "
                   "red rules: incidents opened, blue: reshapes applied, green: fail-stop recoveries, "
                   "grey: bus outages")
        st.altair_chart(series_chart(shown, job.marks, kind="time"), width="stretch")
        st.altair_chart(series_chart(shown, job.marks, kind="throughput"), width="stretch")
    else:
        st.info("No analytics.prediction events for this job yet (is the analytics consumer running?).")

    _recovery_timeline(job)

    st.subheader("Current plan")
    colour_by = st.radio("Colour by", ["TP group", "PP stage", "DP replica", "health"], horizontal=True, key="jobs_colour")
    cells = plan_cells(job.current_plan, job.layout, job.health)
    if cells:
        source = (f"plan epoch {job.current_plan.epoch}" if job.current_plan is not None
                  else "layout from the ranks' telemetry (no reconfiguration applied yet)")
        st.caption(f"{source}; outlined cells are slow (×factor) or dead (✕)")
        st.altair_chart(plan_grid_chart(cells, colour_by), width="content")
    else:
        st.info("No layout yet: neither telemetry nor an applied plan has been seen.")
    unhealthy = [e for e in job.health.values() if e.state != RankState.HEALTHY]
    if unhealthy:
        st.dataframe(pd.DataFrame({"rank": [e.rank for e in unhealthy], "state": [e.state.value for e in unhealthy],
                                   "slowdown": [e.factor for e in unhealthy]}), hide_index=True)


def recovery_rows(job: ConsoleJob) -> list[dict]:
    """One row per phase of every in-job recovery (``telemetry.recovery``), newest recovery first."""
    rows = []
    for rec in sorted(job.recoveries.values(), key=lambda r: -r.generation):
        for phase, (duration_s, since_s) in rec.phases.items():
            rows.append({"world": rec.generation, "lost ranks": ", ".join(map(str, rec.lost)),
                         "ranks now": len(rec.world), "phase": phase, "took s": round(duration_s, 3),
                         "since detected s": round(since_s, 3)})
    return rows


def _recovery_timeline(job: ConsoleJob) -> None:
    """Fail-stop recoveries inside the job (``resihp run --on-failure shrink``), phase by phase."""
    if not job.recoveries:
        return
    st.subheader("Fail-stop recoveries")
    newest = max(job.recoveries.values(), key=lambda r: r.generation)
    total = f"{newest.total_s:.2f} s" if newest.total_s is not None else "in progress"
    st.caption(f"newest: ranks {newest.lost} lost in {plain(newest.failed_op) if newest.failed_op else 'a collective'}; {len(newest.world)} ranks "
               f"went on from step {newest.iteration}; failure → training again: {total} "
               "(each phase on the reporting rank's clock)")
    st.dataframe(pd.DataFrame(recovery_rows(job)), hide_index=True)


def _goodput_headline(feed: Feed, job_name: str) -> None:
    """The job's headline: goodput (ETTR) and where the rest of the wall time went, from the same
    fold as /metrics' ``resihp_goodput_ratio`` and ``resihp_goodput_loss_seconds_total``
    (collector/goodput.py, docs/metrics.md), so the console and a dashboard never disagree."""
    g = feed.model.goodput.breakdown(job_name)
    if g is None:
        return
    left, right = st.columns([1, 4])
    left.metric("Goodput", f"{g.ratio:.1%}", help="share of wall time in productive training (docs/metrics.md)")
    right.altair_chart(goodput_bar(g), width="stretch")
    lost = ", ".join(f"{cause.replace('_', '-')} {s:,.0f} s" for cause, s in g.loss_s.items() if s >= 0.5)
    st.caption(f"{g.productive_s:,.0f} s productive of {g.wall_s:,.0f} s wall time; lost: {lost or 'nothing'}"
               + (f"; {g.pending_s:,.0f} s since the last iteration not yet attributed" if g.pending_s >= 0.5 else ""))


def _layout_shape(job: ConsoleJob) -> str:
    if not job.layout:
        return "—"
    tp = max(s.tp_rank for s in job.layout.values()) + 1
    pp = max(s.stage for s in job.layout.values()) + 1
    dp = max(s.replica for s in job.layout.values()) + 1
    return f"TP{tp}·PP{pp}·DP{dp}"


def _telemetry_notices(job: ConsoleJob) -> None:
    """What the detector found about the job's telemetry that its producer did not declare
    (analytics.telemetry_notice): the fix is on the producer's side, so it is said here, once."""
    for notice in sorted(job.notices.values(), key=lambda n: n.iteration):
        st.info(f"Telemetry, from iteration {notice.iteration}: {plain(notice.message)}. {plain(notice.detail)}")


def _bus_outages(job: ConsoleJob) -> None:
    """Bus outages (analytics.bus_outage): the bus was down, not the ranks, so nobody was judged dead."""
    if not job.outages:
        return
    rows = sorted(job.outages.values(), key=lambda o: o.started_s)
    ongoing = [o for o in rows if o.ended_s is None]
    if ongoing:
        st.warning(f"Bus outage since {clock(ongoing[-1].started_s)}: fail-stop judgement of "
                   f"{ongoing[-1].ranks_suspended} ranks is suspended ({plain(ongoing[-1].reason)})")
    with st.expander(f"Bus outages ({len(rows)})", expanded=bool(ongoing)):
        st.dataframe(pd.DataFrame({
            "what": ["bus outage"] * len(rows), "started": [clock(o.started_s) for o in rows],
            "ended": [clock(o.ended_s) if o.ended_s is not None else "ongoing" for o in rows],
            "duration (s)": [round(o.duration_s, 1) if o.duration_s is not None else None for o in rows],
            "ranks not judged": [o.ranks_suspended for o in rows], "reason": [o.reason for o in rows],
        }), hide_index=True, width="stretch", key=f"outages_{job.job}")
