"""Policy: per job, propose-and-wait or auto-apply (by severity, for incidents the detector is sure
enough are real: p_real). Saving publishes policy.changed."""

from __future__ import annotations

import streamlit as st

from collector.events import PolicyMode, Severity
from ui.actions import change_policy
from ui.auth import Session
from ui.feed import Feed
from ui.views.common import clock, pick_job, plain, run_action

DEFAULT_AUTO_MIN_P_REAL = 0.9  # p_real is calibrated on the detection suite: 9 in 10 incidents this sure are real
MODE_LABELS = {PolicyMode.PROPOSE: "propose and wait for an operator", PolicyMode.AUTO: "auto-apply (by severity)"}


def render(feed: Feed, session: Session) -> None:
    st.header("Policy")
    job_name = pick_job(feed.model, key="policy_job")
    if job_name is None:
        return
    current = feed.model.jobs[job_name].policy
    if current is None:
        st.markdown("Current: **propose and wait** (the remediation engine's default; no policy.changed seen)")
    else:
        sev = ", ".join(s.value for s in current.auto_severities) or "none"
        st.markdown(f"Current: **{MODE_LABELS[current.mode]}**"
                    + (f" for severities {sev}" if current.mode == PolicyMode.AUTO else "")
                    + (f" when p_real ≥ {current.auto_min_p_real:.2f}"
                       if current.mode == PolicyMode.AUTO and current.auto_min_p_real is not None else "")
                    + f" — set by {plain(current.actor)} at {clock(current.time_s)}")
    modes = list(MODE_LABELS)
    mode = st.radio("Mode", modes, format_func=MODE_LABELS.get, key=f"policy_mode_{job_name}",
                    index=modes.index(current.mode) if current else 0)
    default = current.auto_severities if current and current.auto_severities else [Severity.HIGH, Severity.CRITICAL]
    severities = st.multiselect("Auto-apply these severities", list(Severity), default=default,
                                format_func=lambda s: s.value, key=f"policy_sev_{job_name}",
                                disabled=mode != PolicyMode.AUTO)
    bar = st.slider("Auto-apply only when the detector's p_real (how sure it is the fault is real) is at least",
                    0.0, 1.0, value=current.auto_min_p_real if current and current.auto_min_p_real is not None
                    else DEFAULT_AUTO_MIN_P_REAL, step=0.05, key=f"policy_p_real_{job_name}",
                    disabled=mode != PolicyMode.AUTO)
    if not session.user.can_decide:
        st.caption("You are signed in as a viewer: only operators can change the policy.")
    if st.button("Save policy", key="policy_save", type="primary"):
        run_action(lambda: change_policy(feed, session, job_name, mode=mode,
                                         auto_severities=severities if mode == PolicyMode.AUTO else [],
                                         auto_min_p_real=bar if mode == PolicyMode.AUTO else None),
                   lambda _: f"Policy of {plain(job_name)} set to {MODE_LABELS[mode]} by {plain(session.user.actor)}")
