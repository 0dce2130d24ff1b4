"""Page logic of the console, driven by Streamlit's AppTest against an embedded bus.

The bus is pre-filled with a realistic sequence (ui/demo.py: telemetry, predictions, an incident
opened and confirmed, a proposed plan awaiting a decision) built from collector.events only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from collector.goodput import GoodputFold
from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import (
    Evidence, FaultCategory, IncidentOpened, Location, PlanDecision, PlanWithheld, PolicyChanged,
    PolicyMode, Severity,
)
from collector.stream import EventStream
from ui.auth import Session, User, UsersFile
from ui.views.common import plain
from tests.fixtures.console_demo import DemoSpec, demo_events
from tests.fixtures.signing import factory

APP = str(Path(__file__).resolve().parent.parent / "ui" / "app.py")
PLAN_ID = "plan-demo-60"
INCIDENT_ID = "inc-demo-60"


@pytest.fixture
def console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bus_path = tmp_path / "bus.sqlite"
    with EmbeddedBus(bus_path) as bus:
        bus.publish(demo_events(DemoSpec(iterations=90)))
    users = UsersFile(tmp_path / "users.toml")
    users.add_user("alice", "operator", "alice-pw")
    users.add_user("bob", "viewer", "bob-pw")
    monkeypatch.setenv("RESIHP_BUS", "embedded")
    monkeypatch.setenv("RESIHP_EMBEDDED_PATH", str(bus_path))
    monkeypatch.setenv("RESIHP_UI_USERS", str(tmp_path / "users.toml"))
    monkeypatch.setenv("RESIHP_UI_TRACE_DIR", str(tmp_path / "traces"))
    return bus_path


def control_events(bus_path: Path, kind: type) -> list:
    with EmbeddedBus(bus_path) as bus, EventStream(bus, "test-reader", [topics.CONTROL]) as stream:
        return [d.event for d in stream.poll(10_000, 0.1) if isinstance(d.event.payload, kind)]


def sign_in(at: AppTest, name: str, password: str) -> AppTest:
    at.text_input(key="signin_name").input(name)
    at.text_input(key="signin_password").input(password)
    return at.button[0].click().run()


def open_incident(at: AppTest) -> AppTest:
    at.sidebar.radio(key="page").set_value("Incidents").run()
    return at.button(key=f"open-{INCIDENT_ID}").click().run()


def test_ui_sign_in_shows_the_console(console: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert at.text_input(key="signin_name") is not None
    at = sign_in(at, "alice", "alice-pw")
    assert not at.exception, at.exception
    assert at.session_state["session"].user == User("alice", "operator")
    assert any("Signed in as **alice**" in m.value for m in at.sidebar.markdown)
    assert at.header[0].value == "Jobs"


def test_ui_wrong_password_is_refused_with_a_message(console: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=60).run()
    at = sign_in(at, "alice", "not-her-password")
    assert "session" not in at.session_state
    assert any("wrong user name or password" in e.value for e in at.error)
    at = sign_in(at, "mallory", "whatever")
    assert "session" not in at.session_state
    assert any("wrong user name or password" in e.value for e in at.error)


def test_ui_operator_approve_publishes_a_plan_decision_naming_the_user(console: Path) -> None:
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "alice", "alice-pw")
    at = open_incident(at)
    assert not at.exception, at.exception
    assert at.header[0].value == f"Incident {plain(INCIDENT_ID)}"
    at.text_area(key=f"comment-{PLAN_ID}").input("drop the slow GPU")
    at = at.button(key=f"approve-{PLAN_ID}").click().run()
    assert not at.exception, at.exception
    decisions = control_events(console, PlanDecision)
    assert len(decisions) == 1
    d = decisions[0]
    assert (d.payload.plan_id, d.payload.approve, d.payload.actor, d.payload.comment) == (
        PLAN_ID, True, "ui:alice", "drop the slow GPU")
    assert d.source == "ui:alice" and d.job == "demo"
    assert any(f"Approved by {plain('ui:alice')}" in s.value for s in at.success)
    # A second press on a decided plan changes nothing: the buttons are gone and nothing more is published.
    assert not [b for b in at.button if b.key == f"approve-{PLAN_ID}"]


def test_ui_an_incident_without_a_plan_shows_why_the_engine_made_none(console: Path) -> None:
    with EmbeddedBus(console) as bus:
        bus.publish([
            factory("demo", "analytics").make(IncidentOpened(
                incident_id="inc-stuck", category=FaultCategory.FAIL_STOP, severity=Severity.CRITICAL, iteration=80,
                locations=[Location(target="compute", rank=1)], evidence=Evidence(), summary="rank 1 stopped")),
            factory("demo", "remediation").make(PlanWithheld(
                reason="plan refused: no replica has a healthy device for stage 0", base_epoch=0,
                incident_ids=["inc-stuck"]))])
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "bob", "bob-pw")
    at.sidebar.radio(key="page").set_value("Incidents").run()
    at = at.button(key="open-inc-stuck").click().run()
    assert not at.exception, at.exception
    assert any(s.value == "No plan proposed for this incident yet." for s in at.info)
    (warning,) = [w.value for w in at.warning if "not planned" in w.value]
    assert warning.endswith("not planned: " + plain("plan refused: no replica has a healthy device for stage 0"))


def test_ui_viewer_pressing_approve_gets_a_message_and_publishes_nothing(console: Path) -> None:
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "bob", "bob-pw")
    at = open_incident(at)
    at = at.button(key=f"approve-{PLAN_ID}").click().run()
    assert any("bob is a viewer: only operators can approve or reject plans" in e.value for e in at.error)
    assert control_events(console, PlanDecision) == []


def test_ui_expired_session_pressing_reject_changes_nothing(console: Path) -> None:
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "alice", "alice-pw")
    at = open_incident(at)
    s: Session = at.session_state["session"]
    at.session_state["session"] = Session(s.user, s.signed_in_at_s - 10, s.signed_in_at_s - 1)
    at = at.button(key=f"reject-{PLAN_ID}").click().run()
    assert any("expired" in w.value for w in at.warning)
    assert "session" not in at.session_state
    assert control_events(console, PlanDecision) == []


def test_ui_policy_change_by_operator_publishes_policy_changed_and_viewer_cannot(console: Path) -> None:
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "bob", "bob-pw")
    at.sidebar.radio(key="page").set_value("Policy").run()
    at.radio(key="policy_mode_demo").set_value(PolicyMode.AUTO).run()
    at = at.button(key="policy_save").click().run()
    assert any("only operators can change the policy" in e.value for e in at.error)
    assert control_events(console, PolicyChanged) == []

    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "alice", "alice-pw")
    at.sidebar.radio(key="page").set_value("Policy").run()
    at.radio(key="policy_mode_demo").set_value(PolicyMode.AUTO).run()
    at = at.button(key="policy_save").click().run()
    assert not at.exception, at.exception
    (changed,) = control_events(console, PolicyChanged)
    assert changed.job == "demo" and changed.payload.actor == "ui:alice"
    assert changed.payload.mode.value == "auto"
    assert [s.value for s in changed.payload.auto_severities] == ["high", "critical"]
    assert changed.payload.auto_min_p_real == 0.9  # the console's default bar on how sure a fault is real
    assert any(f"set by {plain('ui:alice')}" in m.value for m in at.markdown)


def test_ui_replay_and_jobs_pages_render_the_log(console: Path) -> None:
    """The Jobs page leads with goodput, the one fold's figure (collector/goodput.py, as /metrics
    serves it), then the layout; Replay lists what happened."""
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "alice", "alice-pw")
    assert not at.exception, at.exception
    assert [m.label for m in at.metric][:3] == ["Goodput", "Plan epoch", "Layout"]
    fold = GoodputFold()
    with EmbeddedBus(console) as bus, EventStream(bus, "test-goodput", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL]) as stream:
        fold.apply_all(d.event for d in stream.poll(100_000, 0.1))
    g = fold.breakdown("demo")
    assert g is not None and 0 < g.ratio < 1
    assert at.metric[0].value == f"{g.ratio:.1%}"
    assert at.metric[2].value == "TP2·PP2·DP2"
    at.sidebar.radio(key="page").set_value("Replay").run()
    assert not at.exception, at.exception
    end = at.slider(key="replay_pos").max
    at = at.slider(key="replay_pos").set_value(end).run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert "opened inc-demo-60 (high)" in " ".join(table["what"])
    assert set(table["who"]) >= {"detector", "planner"}


def test_ui_five_wrong_passwords_lock_the_user_and_each_failure_is_an_event(console: Path) -> None:
    from collector.events import SignInFailed
    at = AppTest.from_file(APP, default_timeout=60).run()
    for _ in range(5):
        at = sign_in(at, "bob", "guess-pw-123")
    assert any("sign-in is now locked" in e.value for e in at.error)
    at = sign_in(at, "bob", "bob-pw")  # the right password during the lockout is refused too
    assert "session" not in at.session_state
    assert any("locked until" in e.value for e in at.error)
    failures = [e.payload for e in control_events(console, SignInFailed)]
    assert [(f.user, f.reason, f.user_failures) for f in failures] == [
        ("bob", "wrong_password", n) for n in range(1, 6)]
    assert failures[-1].locks == ["user"] and failures[-1].locked_until_s is not None
    at = sign_in(at, "mallory-pw-in-name-box", "x")
    (unknown,) = [e for e in control_events(console, SignInFailed) if e.payload.reason == "unknown_user"]
    assert unknown.payload.user == ""
    with EmbeddedBus(console) as bus, EventStream(bus, "raw-reader", [topics.CONTROL]) as stream:
        raw = b" ".join(d.event.model_dump_json().encode() for d in stream.poll(10_000, 0.1))
    for secret in (b"guess-pw-123", b"bob-pw", b"mallory-pw-in-name-box"):
        assert secret not in raw

    # The operator sees the failures and the lockout on the Security page; a viewer would not.
    at = sign_in(AppTest.from_file(APP, default_timeout=60).run(), "alice", "alice-pw")
    at.sidebar.radio(key="page").set_value("Security").run()
    assert not at.exception, at.exception
    (table,) = [d.value for d in at.dataframe]  # no rejected control events here: one table
    assert list(table["user"][:2]) == ["(unknown name)", "bob"] and len(table) == 6
    assert any("Locked out at" in w.value and "user bob" in w.value for w in at.warning)


# ---- after the console has run in this process -------------------------------------------------


def test_the_console_runs_as_this_process_main_module(console: Path) -> None:
    """The first half of the next test: AppTest makes ui/app.py this process's ``__main__``."""
    import sys

    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and getattr(sys.modules["__main__"], "__file__", "") == APP


def _exit_quietly() -> None:
    return None


@pytest.mark.processes
def test_a_process_started_after_the_console_ran_in_this_process_starts_clean() -> None:
    """Multiprocessing re-imports the parent's ``__main__`` in every forkserver or spawn child; if
    the console were still ``__main__`` every rank started later in this process would run the
    console and exit 1 (tests/conftest.py ``keep_main_module`` puts the real one back)."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=_exit_quietly)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
