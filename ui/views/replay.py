"""Replay: choose a trace, then play, pause, scrub and change speed; decisions appear where they happened.

The replayed events are folded into a ReadModel of their own (never the live one). Moving forward
applies only the new events; scrubbing backwards refolds from the start, which is cheap because
per-rank telemetry is left out of replays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import streamlit as st

from collector.events import (
    CommandAck, Envelope, FaultInjected, IncidentConfirmed, IncidentOpened, IncidentResolved, IncidentUpdated,
    PlanCurrent, PlanDecision, PlanProposed, PlanRolledBack, PlanVerified, PlanWithheld, PolicyChanged, RankHealth,
    ReconfigureCommand,
)
from ui.charts import downsample, series_chart
from ui.read_model import Mark, ReadModel
from ui.settings import Settings
from ui.trace_source import LoadedTrace, list_traces, load_bus, load_trace
from ui.views.common import clock, plain

SPEEDS = [1, 10, 60, 600, 3600]
TICK_S = 1.0
BUS_SOURCE = "this console's bus (live log)"


@dataclass
class ReplayState:
    trace: LoadedTrace
    model: ReadModel = field(default_factory=ReadModel)
    applied: int = 0  # events of trace.events folded into model

    @property
    def start_s(self) -> float:
        return self.trace.events[0].time_s if self.trace.events else 0.0

    @property
    def duration_s(self) -> float:
        return (self.trace.events[-1].time_s - self.start_s) if self.trace.events else 0.0

    def seek(self, offset_s: float) -> None:
        """Fold exactly the events up to ``start + offset_s``."""
        target = self.start_s + offset_s
        events = self.trace.events
        n = int(np.searchsorted([e.time_s for e in events], target, side="right")) if events else 0
        if n < self.applied:
            self.model, self.applied = ReadModel(), 0
        for e in events[self.applied:n]:
            self.model.apply(e)
        self.applied = n


def describe(e: Envelope) -> tuple[str, str]:
    """(who decided: detector / planner / operator / trainer / truth, one line of what); ("", "")
    for events that are no decision (telemetry, predictions)."""
    p = e.payload
    k = e.kind
    if isinstance(p, IncidentOpened):
        return "detector", f"opened {p.incident_id} ({p.severity.value}): {p.summary}"
    if isinstance(p, (IncidentConfirmed, IncidentUpdated, IncidentResolved)):
        return "detector", f"{k.split('.')[1]} {p.incident_id}"
    if isinstance(p, RankHealth):
        bad = [f"{r.rank}:{r.state.value}×{r.factor:.1f}" for r in p.entries() if r.state.value != "healthy"]
        return "detector", "rank health " + (", ".join(bad[:8]) or "all healthy")
    if isinstance(p, PlanProposed):
        return "planner", f"proposed {p.plan_id} ({p.plan.shape()}, {p.predicted_tokens_per_s / max(p.current_tokens_per_s, 1e-9) - 1:+.0%})"
    if isinstance(p, PlanDecision):
        who = "planner" if p.actor.startswith("policy:") else "operator"
        return who, f"{'approved' if p.approve else 'rejected'} {p.plan_id} by {p.actor}"
    if isinstance(p, ReconfigureCommand):
        return "planner", f"command {p.command_id}: epoch {p.plan.epoch}"
    if isinstance(p, CommandAck):
        return "trainer", f"ack {p.status.value} epoch {p.epoch} (pause {p.pause_s:.1f} s)"
    if isinstance(p, (PlanVerified, PlanRolledBack)):
        return "planner", f"{k.split('.')[1]} {p.plan_id}"
    if isinstance(p, PlanWithheld):
        return "planner", f"withheld: {p.reason}"
    if isinstance(p, PlanCurrent):
        return "trainer", f"runs epoch {p.plan.epoch} ({p.plan.shape()}, {p.reason})"
    if isinstance(p, PolicyChanged):
        return "operator", f"policy {p.mode.value} by {p.actor}"
    if isinstance(p, FaultInjected):
        return "truth", f"fault injected: {p.category.value} at {p.location.target} {p.location.rank}"
    return "", ""


@st.cache_resource(max_entries=4, show_spinner="loading trace…")
def _load_file(path: str, mtime: float) -> LoadedTrace:
    return load_trace(path)


def render(settings: Settings, bus_factory) -> None:
    st.header("Replay")
    files = list_traces(settings.trace_dir)
    options = [BUS_SOURCE] + [str(p) for p in files]
    st.caption(f"traces are read from {plain(settings.trace_dir)} (RESIHP_UI_TRACE_DIR)")
    choice = st.selectbox("Trace", options, key="replay_source",
                          format_func=lambda o: o if o == BUS_SOURCE else os.path.relpath(o, settings.trace_dir))
    if st.button("Load", key="replay_load") or st.session_state.get("replay_loaded") != choice:
        trace = load_bus(bus_factory) if choice == BUS_SOURCE else _load_file(choice, os.path.getmtime(choice))
        st.session_state["replay"] = ReplayState(trace)
        st.session_state["replay_loaded"] = choice
        st.session_state["replay_pos"] = 0.0
        st.session_state["replay_playing"] = False
    rs: ReplayState = st.session_state["replay"]
    if not rs.trace.events:
        st.info("This trace holds no events to replay.")
        return
    if rs.trace.skipped:
        st.warning(f"{rs.trace.skipped:,} lines of the trace were not events and were skipped")
    playing = st.session_state.get("replay_playing", False)
    c = st.columns([1, 1, 2, 4])
    if c[0].button("Pause" if playing else "Play", key="replay_play"):
        st.session_state["replay_playing"] = playing = not playing
        st.rerun()
    if c[1].button("Restart", key="replay_start"):
        st.session_state["replay_pos"] = 0.0
    speed = c[2].selectbox("Speed", SPEEDS, index=2, format_func=lambda s: f"{s}×", key="replay_speed")
    c[3].caption(f"{len(rs.trace.events):,} events over {rs.duration_s / 60:.1f} min from {plain(rs.trace.source)}")

    @st.fragment(run_every=TICK_S if playing else None)
    def player() -> None:
        if st.session_state.get("replay_playing"):
            pos = min(rs.duration_s, float(st.session_state.get("replay_pos", 0.0)) + speed * TICK_S)
            st.session_state["replay_pos"] = pos
            if pos >= rs.duration_s:
                st.session_state["replay_playing"] = False
        pos_s = st.slider("Position (s from start)", 0.0, max(rs.duration_s, 1.0), key="replay_pos", step=1.0)
        rs.seek(pos_s)
        _frame(rs, pos_s)

    player()


def _frame(rs: ReplayState, pos_s: float) -> None:
    model = rs.model
    st.markdown(f"**{clock(rs.start_s + pos_s)}** · {rs.applied:,} of {len(rs.trace.events):,} events")
    decisions = []
    for e in rs.trace.events[: rs.applied]:
        who, what = describe(e)
        if who:
            decisions.append((e, who, what))
    for name, job in model.jobs.items():
        if not len(job.predictions):
            continue
        marks = [Mark("detector" if who == "detector" else ("planner" if who in ("planner", "operator") else "reshape"),
                      job.predictions.iteration_at(e.time_s), e.time_s, what)
                 for e, who, what in decisions if e.job == name and who in ("detector", "planner", "operator")
                 and e.kind in ("incident.opened", "plan.proposed", "plan.decision")]
        marks += [m for m in job.marks if m.kind == "reshape"]
        cols = job.predictions.arrays()
        st.markdown(f"Job {plain(name)} — epoch {job.running_epoch()}")
        st.altair_chart(series_chart(downsample({k: cols[k] for k in ("iteration", "observed_s", "predicted_s", "tokens")}),
                                     marks, kind="time"), width="stretch")
    if decisions:
        recent = decisions[-200:][::-1]
        st.dataframe(pd.DataFrame({
            "t (s)": [round(e.time_s - rs.start_s, 1) for e, _, _ in recent],
            "job": [e.job for e, _, _ in recent], "who": [w for _, w, _ in recent], "what": [x for _, _, x in recent],
        }), hide_index=True, width="stretch")
    else:
        st.caption("no detector or planner decisions yet at this point")
