"""The console's sign-in guard (rate limit and lockout) and the plain-text rule, as unit logic."""

from __future__ import annotations

import pytest

from ui.signin_guard import GuardPolicy, LockedOut, SignInGuard
from ui.views.common import WORD_JOINER, plain


def fail(guard: SignInGuard, user: str, client: str, now_s: float, known: bool = True):
    guard.check(user, client, now_s)
    return guard.failed(user, client, known_user=known, now_s=now_s)


def test_fifth_failure_locks_the_user_and_each_next_lockout_doubles() -> None:
    guard = SignInGuard(GuardPolicy(max_user_failures=5, max_client_failures=100, lockout_s=60.0))
    events = [fail(guard, "alice", f"10.0.0.{i}", 1000.0 + i) for i in range(5)]
    assert [e.user_failures for e in events] == [1, 2, 3, 4, 5]
    assert [e.locks for e in events] == [[], [], [], [], ["user"]]
    assert events[-1].locked_until_s == 1004.0 + 60.0
    with pytest.raises(LockedOut, match="locked until"):
        guard.check("alice", "10.0.0.99", 1063.0)  # another client: the user name itself is locked
    guard.check("bob", "10.0.0.1", 1063.0)  # other users are not
    second = [fail(guard, "alice", "10.0.0.1", 1100.0 + i) for i in range(5)]
    assert second[-1].locked_until_s == 1104.0 + 120.0
    with pytest.raises(LockedOut):
        guard.check("alice", "10.0.0.1", 1104.0 + 119.0)
    guard.check("alice", "10.0.0.1", 1104.0 + 120.0)


def test_one_client_guessing_many_names_is_locked_out_by_address() -> None:
    guard = SignInGuard(GuardPolicy(max_user_failures=5, max_client_failures=3, lockout_s=30.0))
    events = [fail(guard, f"guess{i}", "203.0.113.7", 50.0, known=False) for i in range(3)]
    assert events[-1].locks == ["client"] and events[-1].locked_until_s == 80.0
    with pytest.raises(LockedOut):
        guard.check("alice", "203.0.113.7", 79.0)
    guard.check("alice", "198.51.100.1", 79.0)


def test_unknown_names_are_not_repeated_in_the_event() -> None:
    guard = SignInGuard()
    event = fail(guard, "hunter2-typed-in-the-name-box", "127.0.0.1", 1.0, known=False)
    assert event.user == "" and event.reason == "unknown_user"
    assert "hunter2" not in event.model_dump_json()
    assert fail(guard, "alice", "127.0.0.1", 2.0).user == "alice"


def test_success_clears_the_user_record_but_not_the_lockout_history_of_the_client() -> None:
    guard = SignInGuard(GuardPolicy(max_user_failures=3, max_client_failures=3, lockout_s=10.0))
    for i in range(2):
        fail(guard, "alice", "c", float(i))
    guard.succeeded("alice", "c")
    assert fail(guard, "alice", "c", 5.0).user_failures == 1
    assert fail(guard, "alice", "c", 5.0).client_failures == 2


def test_memory_stays_bounded_under_a_flood_of_names() -> None:
    guard = SignInGuard(GuardPolicy(max_keys=100))
    for i in range(1000):
        guard.failed(f"name{i}", f"client{i}", known_user=False, now_s=1.0)
    assert len(guard._records) <= 100


@pytest.mark.parametrize("text", [
    "![x](http://127.0.0.1:9/pixel)", "<img src=http://127.0.0.1:9/p>", ":red[boom] $x^2$ **bold**",
    "# heading\n- item\n1. one", "www.example.com and http://example.com", "`code` ~~gone~~ | a | b |",
])
def test_plain_escapes_every_markdown_punctuation_and_line_break(text: str) -> None:
    out = plain(text)
    assert "\n" not in out
    unescaped = [ch for i, ch in enumerate(out) if not ch.isalnum() and not ch.isspace() and ch.isascii()
                 and (i == 0 or out[i - 1] != "\\") and not (ch == "\\" and i + 1 < len(out))]
    assert unescaped == []
    assert out.replace("\\", "").replace(WORD_JOINER, "") == text.replace("\n", " ").replace("\\", "")


def test_plain_breaks_links_and_emoji_that_are_found_after_parsing() -> None:
    out = plain("http://127.0.0.1:9/p www.evil.example bob@evil.example :smile:")
    assert f"http\\:{WORD_JOINER}\\/\\/" in out and f"www{WORD_JOINER}\\." in out
    assert f"\\@{WORD_JOINER}evil" in out and f"\\:{WORD_JOINER}smile\\:" in out
