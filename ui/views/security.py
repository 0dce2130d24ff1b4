"""Security: refused sign-ins and lockouts (operators only), control events the platform rejected,
and jobs whose incidents come from more than one analytics writer. Every cell is plain text."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ui.auth import Session
from ui.feed import Feed
from ui.views.common import clock, plain, writer_warnings


def render(feed: Feed, session: Session) -> None:
    st.header("Security")
    log = feed.model.security
    writer_warnings(feed.model)

    st.subheader("Rejected control events")
    if log.rejected:
        rows = list(log.rejected)[::-1]
        st.caption(f"{len(rows):,} control events refused (newest first): forged, unsigned or not allowed for their source")
        st.dataframe(pd.DataFrame({
            "time": [clock(r.time_s) for r in rows], "job": [r.job for r in rows], "kind": [r.kind for r in rows],
            "claimed source": [r.source for r in rows], "reason": [r.reason for r in rows],
            "rejected by": [r.by for r in rows], "event id": [r.event_id for r in rows],
        }), hide_index=True, width="stretch", key="security_rejected")
    else:
        st.info("No control events rejected.")

    st.subheader("Failed sign-ins")
    if not session.user.can_decide:
        st.caption("Only operators can see failed sign-ins and lockouts.")
        return
    locks = list(log.lockouts)[::-1]
    for t, p in locks[:5]:
        who = f"user {p.user}" if "user" in p.locks and p.user else ("an unknown user name" if "user" in p.locks else "")
        what = " and ".join(x for x in (who, f"client {p.client}" if "client" in p.locks else "") if x)
        st.warning(f"Locked out at {clock(t)} until {clock(p.locked_until_s)}: {plain(what)}")
    failures = list(log.signin_failures)[::-1]
    if failures:
        st.caption(f"{len(failures):,} failed sign-ins (newest first); passwords are never recorded, "
                   "and names that are not users are not repeated")
        st.dataframe(pd.DataFrame({
            "time": [clock(t) for t, _ in failures], "user": [p.user or "(unknown name)" for _, p in failures],
            "client": [p.client for _, p in failures], "reason": [p.reason for _, p in failures],
            "user failures": [p.user_failures for _, p in failures],
            "client failures": [p.client_failures for _, p in failures],
            "locked": [", ".join(p.locks) + (f" until {clock(p.locked_until_s)}" if p.locks else "") for _, p in failures],
        }), hide_index=True, width="stretch", key="security_signins")
    else:
        st.info("No failed sign-ins.")
