"""Sign in, sign out, and the session that every page checks before it shows or changes anything.

Every sign-in passes the process's SignInGuard (ui/signin_guard.py) first; each refusal for a wrong
name or password is published as a ``ui.signin_failed`` event, which the Security page shows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Callable

import streamlit as st

from collector.events import EventFactory, SignInFailed
from ui.auth import AuthError, Authenticator, Session, SessionExpired, UsersFileError
from ui.feed import Feed
from ui.read_model import CONSOLE_JOB, CONSOLE_SOURCE
from ui.settings import Settings
from ui.signin_guard import LockedOut, SignInGuard
from ui.views.common import plain

_publish_lock = threading.Lock()


def client_address() -> str:
    """The address of the browser's connection as the server saw it: Streamlit gives None for a
    loopback connection ("localhost" here) and "unknown" stands for no connection at all."""
    try:
        address = st.context.ip_address
    except Exception:  # noqa: BLE001 - outside a browser session there is no connection
        return "unknown"
    if address is None:
        return "localhost"
    return address[:200] if isinstance(address, str) else "unknown"  # AppTest has a stand-in object


def record_failure(feed: Feed, payload: SignInFailed) -> None:
    """Publish the refusal on the control topic, numbered after this console's previous ones."""
    with _publish_lock:  # one numbering for every browser session of this process
        feed.refresh()
        factory = EventFactory(CONSOLE_JOB, CONSOLE_SOURCE, first_seq=feed.model.next_seq(CONSOLE_JOB, CONSOLE_SOURCE))
        feed.publish(factory.make(payload))


def current_session() -> Session | None:
    """The live session, or None. An expired one, or one whose user was removed or locked since, is
    dropped with a message for the sign-in form; a changed role is taken at once (every run of the
    page asks the users file, and so does every action: ui/actions.py)."""
    session: Session | None = st.session_state.get("session")
    if session is None:
        return None
    try:
        user = session.check(time.time())
    except SessionExpired as exc:
        del st.session_state["session"]
        st.session_state["signin_notice"] = str(exc)
        return None
    if user != session.user:
        session = st.session_state["session"] = replace(session, user=user)
    return session


def gate(settings: Settings, authenticator: Authenticator, guard: SignInGuard, feed: Callable[[], Feed]) -> Session:
    """Return the live session, or draw the sign-in form and stop the script. ``feed`` is called only
    to record a failure, so an unreachable bus never hides the form."""
    session = current_session()
    if session is not None:
        return session
    st.title("ResiHP console")
    notice = st.session_state.pop("signin_notice", None)
    if notice:
        st.warning(notice)
    with st.form("signin"):
        name = st.text_input("User name", key="signin_name")
        password = st.text_input("Password", type="password", key="signin_password")
        submitted = st.form_submit_button("Sign in")
    if submitted:
        name, client, now = name.strip(), client_address(), time.time()
        try:
            guard.check(name, client, now)
            user = authenticator.authenticate(name, password)
        except LockedOut as exc:
            st.error(str(exc))
        except AuthError as exc:
            event = guard.failed(name, client, known_user=authenticator.knows(name), now_s=now)
            try:
                record_failure(feed(), event)
            except Exception as pub:  # noqa: BLE001 - the refusal stands even if the bus is down
                st.warning(f"the failed sign-in could not be recorded on the bus: {pub}")
            st.error(f"{exc}. Nothing was changed; try again."
                     + (" Too many failures: sign-in is now locked for a while." if event.locks else ""))
        except UsersFileError as exc:
            st.error(str(exc))
        else:
            guard.succeeded(name, client)
            st.session_state["session"] = Session(user, now, now + settings.session_s, authenticator)
            st.rerun()
    st.stop()
    raise AssertionError("unreachable: st.stop() ends the script")


def sidebar_account(session: Session) -> None:
    st.sidebar.markdown(f"Signed in as **{plain(session.user.name)}** ({session.user.role})")
    if st.sidebar.button("Sign out", key="signout"):
        del st.session_state["session"]
        st.rerun()
