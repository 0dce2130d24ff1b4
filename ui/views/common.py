"""Small helpers every page uses: time formatting, the current job, severity badges."""

from __future__ import annotations

import datetime as dt

import streamlit as st

from ui.read_model import ReadModel

# Streamlit's coloured-text markdown; no emoji, since a server's browser may have no emoji font.
SEVERITY_BADGE = {"low": ":blue[**low**]", "medium": ":orange[**medium**]", "high": ":red[**high**]",
                  "critical": ":violet[**CRITICAL**]"}


def clock(time_s: float | None) -> str:
    """UTC wall-clock time of an event, or a dash when a step has not happened."""
    if time_s is None:
        return "—"
    return dt.datetime.fromtimestamp(time_s, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def pick_job(model: ReadModel, key: str) -> str | None:
    """A job selector (hidden when there is only one job); None when the log has none yet."""
    jobs = sorted(model.jobs)
    if not jobs:
        st.info("No events on the bus yet. Start a job (or `resihp simulate`) and refresh.")
        return None
    if len(jobs) == 1:
        return jobs[0]
    return st.selectbox("Job", jobs, key=key)
