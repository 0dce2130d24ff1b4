"""Sign in, sign out, and the session that every page checks before it shows or changes anything."""

from __future__ import annotations

import time

import streamlit as st

from ui.auth import AuthError, Authenticator, Session, SessionExpired, UsersFileError
from ui.settings import Settings


def current_session() -> Session | None:
    """The live session, or None. An expired one is dropped with a message for the sign-in form."""
    session: Session | None = st.session_state.get("session")
    if session is None:
        return None
    try:
        session.check(time.time())
    except SessionExpired as exc:
        del st.session_state["session"]
        st.session_state["signin_notice"] = str(exc)
        return None
    return session


def gate(settings: Settings, authenticator: Authenticator) -> Session:
    """Return the live session, or draw the sign-in form and stop the script."""
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
        try:
            user = authenticator.authenticate(name.strip(), password)
        except AuthError as exc:
            st.error(f"{exc}. Nothing was changed; try again.")
        except UsersFileError as exc:
            st.error(str(exc))
        else:
            now = time.time()
            st.session_state["session"] = Session(user, now, now + settings.session_s)
            st.rerun()
    st.stop()
    raise AssertionError("unreachable: st.stop() ends the script")


def sidebar_account(session: Session) -> None:
    st.sidebar.markdown(f"Signed in as **{session.user.name}** ({session.user.role})")
    if st.sidebar.button("Sign out", key="signout"):
        del st.session_state["session"]
        st.rerun()
