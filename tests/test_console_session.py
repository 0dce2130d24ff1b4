"""A console session acts as its user is now: every page and every action asks the users file, so a
user removed, locked or demoted after signing in cannot go on deciding for the rest of the 8 hours."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import PlanDecision
from collector.stream import EventStream
from tests.test_ui_read_model import _feed_with_pending_plan
from ui.actions import decide_plan
from ui.auth import AuthError, NotAllowed, Session, SessionRevoked, User, UsersFile

APP = str(Path(__file__).resolve().parent.parent / "ui" / "app.py")


def _decisions(bus_path: Path) -> list:
    with EmbeddedBus(bus_path) as bus, EventStream(bus, "test-reader", [topics.CONTROL]) as stream:
        return [d.event for d in stream.poll(10_000, 0.1) if isinstance(d.event.payload, PlanDecision)]


def test_a_demoted_locked_or_removed_operator_can_no_longer_decide(tmp_path: Path) -> None:
    users = UsersFile(tmp_path / "users.toml")
    users.add_user("alice", "operator", "alice-pw")
    users.add_user("carol", "operator", "carol-pw")
    feed = _feed_with_pending_plan(tmp_path)
    plan_id = next(iter(feed.model.plans))
    alice = Session(users.authenticate("alice", "alice-pw"), 0, 8 * 3600, users)
    carol = Session(users.authenticate("carol", "carol-pw"), 0, 8 * 3600, users)
    try:
        users.add_user("alice", "viewer", "alice-pw")  # demoted after signing in
        with pytest.raises(NotAllowed, match="alice is a viewer"):
            decide_plan(feed, alice, plan_id, approve=True, now_s=60)
        users.set_locked("carol", True)
        with pytest.raises(SessionRevoked, match="carol is locked"):
            decide_plan(feed, carol, plan_id, approve=True, now_s=60)
        with pytest.raises(AuthError, match="carol is locked"):
            users.authenticate("carol", "carol-pw")
        users.set_locked("carol", False)
        (tmp_path / "users.toml").write_text((tmp_path / "users.toml").read_text().replace("[users.carol]", "[users.dan]"))
        with pytest.raises(SessionRevoked, match="carol is no longer in the users file"):
            decide_plan(feed, carol, plan_id, approve=True, now_s=60)
        assert feed.model.plans[plan_id].pending and not _decisions(tmp_path / "bus.sqlite")
        users.add_user("carol", "operator", "carol-pw")  # back: the same session may act again
        decide_plan(feed, carol, plan_id, approve=False, now_s=60)
        assert [e.payload.actor for e in _decisions(tmp_path / "bus.sqlite")] == ["ui:carol"]
        assert Session(User("bob", "operator"), 0, 100).check(50) == User("bob", "operator")  # no file: as made
    finally:
        feed.close()


def test_the_console_signs_out_a_user_locked_after_signing_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    feed = _feed_with_pending_plan(tmp_path)
    feed.close()
    users = UsersFile(tmp_path / "users.toml")
    users.add_user("alice", "operator", "alice-pw")
    monkeypatch.setenv("RESIHP_BUS", "embedded")
    monkeypatch.setenv("RESIHP_EMBEDDED_PATH", str(tmp_path / "bus.sqlite"))
    monkeypatch.setenv("RESIHP_UI_USERS", str(users.path))
    monkeypatch.setenv("RESIHP_UI_ALERTMANAGER_URL", "")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.text_input(key="signin_name").input("alice")
    at.text_input(key="signin_password").input("alice-pw")
    at = at.button[0].click().run()
    assert any("(operator)" in m.value for m in at.sidebar.markdown)
    users.add_user("alice", "viewer", "alice-pw")
    at = at.run()
    assert any("(viewer)" in m.value for m in at.sidebar.markdown)
    users.set_locked("alice", True)
    at = at.run()
    assert "session" not in at.session_state
    assert any("alice is locked" in w.value for w in at.warning)
