"""The ResiHP operators' console (Streamlit). Run with ``resihp ui``; settings come from the
environment (ui/settings.py). Every page is drawn from the console's own read model of the bus."""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run ui/app.py` puts ui/ (not the repository) on the path; our packages live one level up.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from collector.bus import open_bus  # noqa: E402
from ui.auth import UsersFile  # noqa: E402
from collector import topics  # noqa: E402
from ui.feed import CONSOLE_TOPICS, Feed  # noqa: E402
from ui.settings import Settings  # noqa: E402
from ui.signin_guard import SignInGuard  # noqa: E402
from ui.views import incidents, jobs, policy, replay, security, signin  # noqa: E402

PAGES = ["Jobs", "Incidents", "Policy", "Replay", "Security"]


def _bus_factory(settings: Settings):
    return lambda: open_bus(settings.bus, path=settings.embedded_path, bootstrap=settings.bootstrap)


@st.cache_resource(show_spinner=False)
def _feed(bus_key: tuple[str, str, bool], _settings: Settings) -> Feed:
    """One Feed per log per process, shared by every browser session."""
    read = CONSOLE_TOPICS if _settings.telemetry else tuple(t for t in CONSOLE_TOPICS if t != topics.TELEMETRY)
    return Feed(_bus_factory(_settings), topics_read=read)


@st.cache_resource(show_spinner=False)
def _guard(users_path: str) -> SignInGuard:
    """One sign-in guard per users file per process: every browser session counts against the same limits."""
    return SignInGuard()


def main() -> None:
    st.set_page_config(page_title="ResiHP console", layout="wide")
    settings = Settings.from_env()
    bus_key = (*settings.bus_key(), settings.telemetry)
    session = signin.gate(settings, UsersFile(settings.users_path), _guard(settings.users_path),
                          lambda: _feed(bus_key, settings))
    feed = _feed(bus_key, settings)
    try:
        with st.spinner("reading the bus…"):
            feed.refresh()
    except Exception as exc:  # noqa: BLE001 - an unreachable bus is shown, not a stack trace
        st.error(f"cannot read the bus ({settings.bus}): {exc}. Check --bus / --bus-path / --bootstrap.")
        st.stop()
    st.sidebar.title("ResiHP")
    asked = st.query_params.get("page")  # an alert's incident link opens ?page=Incidents&incident=ID
    page = st.sidebar.radio("Page", PAGES, key="page", index=PAGES.index(asked) if asked in PAGES else 0)
    signin.sidebar_account(session)
    st.sidebar.caption(f"bus: {settings.bus_key()[1]}  \n{feed.model.applied:,} events folded; "
                       f"last refresh took {feed.last_fold_s * 1000:.0f} ms")
    if st.sidebar.button("Refresh", key="refresh"):
        st.rerun()
    flash = st.session_state.pop("flash", None)
    if flash:
        st.success(flash)
    if page == "Jobs":
        jobs.render(feed, settings.refresh_s)
    elif page == "Incidents":
        incidents.render(feed, session, settings.page_size, settings.alertmanager_url)
    elif page == "Policy":
        policy.render(feed, session)
    elif page == "Security":
        security.render(feed, session)
    else:
        replay.render(settings, _bus_factory(settings))


main()
