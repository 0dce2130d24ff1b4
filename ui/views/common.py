"""Small helpers every page uses: time formatting, the current job, severity badges, running an
operator's action."""

from __future__ import annotations

import datetime as dt
import re
import string
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from ui.actions import ActionRefused
from ui.auth import NotAllowed, SessionExpired
from ui.read_model import ReadModel

T = TypeVar("T")

# Streamlit's coloured-text markdown; no emoji, since a server's browser may have no emoji font.
SEVERITY_BADGE = {"low": ":blue[**low**]", "medium": ":orange[**medium**]", "high": ":red[**high**]",
                  "critical": ":violet[**CRITICAL**]"}


_MARKDOWN_ACTIVE = re.compile("([" + re.escape(string.punctuation) + "])")
_LINE_BREAKS = re.compile(r"[\r\n\u2028\u2029]+")
WORD_JOINER = "\u2060"  # invisible, zero width, and not a word character
# What the renderer turns into links or emoji after escapes are resolved (it searches the parsed text):
# a scheme's "://", "www.", an e-mail's "@" and ":shortcode:". A word joiner inside each breaks the match.
_AFTER_PARSE = re.compile(r"(?<=:)(?=//)|(?i:(?<=www)(?=\.))|(?<=@)(?=[-\w])|(?<=:)(?=[\w+-]+:)")


def plain(text: object) -> str:
    """``text`` made safe to put inside Streamlit markdown: shown as written, never parsed.

    Event text (summaries, evidence notes, plan reasons and diffs, job names, sources) is written
    by whoever can publish on the bus, so it must not become an image, a link, HTML, a colour or a
    heading: a forged ``![x](http://…)`` would otherwise make every operator's browser fetch that
    URL. CommonMark lets a backslash escape any ASCII punctuation, so every one is escaped (that
    stops images, links, HTML, emphasis, ``:red[…]`` colours and ``$`` maths); line breaks become
    spaces so text cannot start a block of its own. Bare URLs, ``www.`` names, e-mail addresses and
    ``:emoji:`` codes are found in the text after parsing, so escapes cannot stop them: an invisible
    word joiner is put inside each (copied text carries it; what is seen is unchanged).
    """
    text = _AFTER_PARSE.sub(WORD_JOINER, _LINE_BREAKS.sub(" ", str(text)))
    return _MARKDOWN_ACTIVE.sub(r"\\\1", text)


def clock(time_s: float | None) -> str:
    """UTC wall-clock time of an event, or a dash when a step has not happened."""
    if time_s is None:
        return "—"
    return dt.datetime.fromtimestamp(time_s, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def writer_warnings(model: ReadModel, job: str | None = None) -> None:
    """One warning per job whose incidents come from more than one analytics writer."""
    for name in [job] if job is not None else sorted(model.jobs):
        for line in model.security.writer_warnings(name):
            st.warning(plain(line))


def pick_job(model: ReadModel, key: str) -> str | None:
    """A job selector (hidden when there is only one job); None when the log has none yet."""
    jobs = sorted(model.jobs)
    if not jobs:
        st.info("No events on the bus yet. Start a job (or `resihp simulate`) and refresh.")
        return None
    if len(jobs) == 1:
        return jobs[0]
    return st.selectbox("Job", jobs, key=key)


def run_action(publish: Callable[[], T], flash: Callable[[T], str]) -> None:
    """Publish an operator's action and show how it went: a refusal shows its reason, an expired
    session also signs the operator out, and a success comes back as ``flash`` (a message shown
    after the page reruns, so the page already shows the new state)."""
    try:
        result = publish()
    except SessionExpired as exc:
        st.session_state.pop("session", None)
        st.error(str(exc))
    except (NotAllowed, ActionRefused) as exc:
        st.error(str(exc))
    else:
        st.session_state["flash"] = flash(result)
        st.rerun()
