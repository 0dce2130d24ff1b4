"""Every piece of event text is shown as plain text, on every page of the console.

A log whose every text field an event can carry — job names, sources, incident summaries and
notes, plan strategies, diffs and reasons, decision comments and actors, a recovery's failed op, a
bus outage's reason, a refusal's reason, a failed sign-in's client — holds markdown and HTML. Each
page is drawn through Streamlit's AppTest, and no element that Streamlit renders as markdown
(markdown, captions, alerts, headings, metric and expander labels) may hold that text unescaped:
it would become bold text, an image that fetches a URL, or a javascript: link in every operator's
browser.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from collector.embedded import EmbeddedBus
from collector.events import (
    BusOutage, ControlRejected, EventFactory, Evidence, FaultCategory, IncidentOpened, IterationPrediction, Location,
    PlanDecision, PlanProposed, PlanWithheld, RecoveryPhase, Severity, SignInFailed,
)
from collector.plan import Plan
from ui.auth import UsersFile
from ui.read_model import CONSOLE_JOB, CONSOLE_SOURCE
from tests.fixtures.console_demo import DemoSpec, demo_events
from tests.fixtures.signing import signed_all

APP = str(Path(__file__).resolve().parent.parent / "ui" / "app.py")
BAIT = "**x** <img src=x onerror=alert(1)> [a](javascript:alert(1))"
# The bait's active parts where no backslash escapes them (plain() escapes every ASCII punctuation).
RAW = re.compile(r"(?<!\\)\*\*x|(?<!\\)<img|(?<!\\)\]\(javascript")
JOB = f"job {BAIT}"
T0 = 1_700_000_900.0


def bait_events() -> list:
    analytics = EventFactory(JOB, "analytics")
    engine = EventFactory(JOB, "remediation")
    agent = EventFactory(JOB, f"agent {BAIT}")
    loc = Location(target="compute", rank=1, factor=2.0)
    new = Plan.uniform(tp=1, pp=1, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1)
    events = [analytics.make(IterationPrediction(epoch=0, iteration=i, observed_s=1.0, predicted_s=1.0, tokens=4096,
                                                 model_error=0.0), time_s=T0 + i) for i in range(5)]
    events += [agent.make(RecoveryPhase(generation=1, phase=phase, duration_s=0.1, since_detected_s=0.1 * n,
                                        iteration=3, world=[0, 1], lost=[2], failed_op=BAIT), time_s=T0 + 5 + n)
               for n, phase in enumerate(["detected", "rendezvous closed", "new world", "state restored", "first step"])]
    events += [
        analytics.make(BusOutage(outage_id="o-1", started_s=T0 + 10, reason=BAIT, ranks_suspended=4), time_s=T0 + 10),
        analytics.make(IncidentOpened(
            incident_id="inc-bait-1", category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=4,
            locations=[loc], summary=BAIT, evidence=Evidence(iterations=[3, 4], observed_s=[1.0, 2.0],
                                                             predicted_s=[1.0, 1.0], statistic=BAIT, note=BAIT)),
            time_s=T0 + 11),
        analytics.make(IncidentOpened(
            incident_id="inc-bait-2", category=FaultCategory.FAIL_SLOW, severity=Severity.LOW, iteration=4,
            locations=[loc], summary=BAIT, evidence=Evidence()), time_s=T0 + 12),
        engine.make(PlanWithheld(reason=BAIT, base_epoch=0, incident_ids=["inc-bait-2"]), time_s=T0 + 13),
        engine.make(PlanProposed(
            plan_id="plan-bait-1", incident_ids=["inc-bait-1"], strategy=BAIT, base_epoch=0, plan=new,
            current_tokens_per_s=100.0, predicted_tokens_per_s=150.0, reshape_cost_s=1.0, diff=[BAIT],
            severity=Severity.HIGH), time_s=T0 + 14),
        EventFactory(JOB, "ui:mallory").make(PlanDecision(plan_id="plan-bait-1", approve=False, actor="ui:mallory",
                                                          comment=BAIT), time_s=T0 + 15),
        EventFactory(JOB, f"forger {BAIT}").make(ControlRejected(event_id=f"id {BAIT}", kind="plan.decision",
                                                                 source=f"ui:{BAIT}", reason=BAIT, reader=BAIT),
                                                 time_s=T0 + 16),
        EventFactory(CONSOLE_JOB, CONSOLE_SOURCE).make(SignInFailed(
            user="", client=BAIT, reason="unknown_user", user_failures=5, client_failures=5, locks=["user", "client"],
            locked_until_s=T0 + 100), time_s=T0 + 17),
    ]
    return signed_all(events)


@pytest.fixture
def console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bus_path = tmp_path / "bus.sqlite"
    with EmbeddedBus(bus_path) as bus:
        bus.publish(demo_events(DemoSpec(iterations=30)) + bait_events())
    users = UsersFile(tmp_path / "users.toml")
    users.add_user("alice", "operator", "alice-pw")
    monkeypatch.setenv("RESIHP_BUS", "embedded")
    monkeypatch.setenv("RESIHP_EMBEDDED_PATH", str(bus_path))
    monkeypatch.setenv("RESIHP_UI_USERS", str(tmp_path / "users.toml"))
    monkeypatch.setenv("RESIHP_UI_TRACE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("RESIHP_UI_ALERTMANAGER_URL", "")
    return bus_path


def rendered_as_markdown(at: AppTest) -> Iterator[str]:
    """The source text of every element Streamlit draws through its markdown renderer."""
    for kind in ("markdown", "caption", "info", "warning", "error", "success", "title", "header", "subheader"):
        for element in getattr(at, kind):
            yield str(element.value)
    for metric in at.metric:
        yield str(metric.label)
        yield str(metric.value)
    for expander in at.expander:
        yield str(expander.label)
    for tab in at.tabs:
        yield str(tab.label)


def assert_plain(at: AppTest, page: str) -> list[str]:
    assert not at.exception, at.exception
    texts = list(rendered_as_markdown(at))
    leaks = [t for t in texts if RAW.search(t)]
    assert not leaks, f"{page}: event text rendered as markdown: {leaks}"
    return texts


def test_every_page_shows_event_text_as_plain_text(console: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.text_input(key="signin_name").input("alice")
    at.text_input(key="signin_password").input("alice-pw")
    at = at.button[0].click().run()
    assert not at.exception, at.exception

    at = at.selectbox(key="jobs_job").set_value(JOB).run()
    texts = assert_plain(at, "Jobs")
    recovery = [t for t in texts if t.startswith("newest: ranks [2] lost in ")]
    assert recovery and "\\*\\*x\\*\\*" in recovery[0]  # the failed op is there, escaped
    assert any("Bus outage since" in t for t in texts)

    at.sidebar.radio(key="page").set_value("Incidents").run()
    assert_plain(at, "Incidents")
    for incident in ("inc-bait-1", "inc-bait-2"):
        at = at.button(key=f"open-{incident}").click().run()
        texts = assert_plain(at, f"incident {incident}")
        assert any("\\*\\*x\\*\\*" in t for t in texts), texts  # the page did show the bait, as text
        at = at.button(key="back").click().run()

    for page in ("Policy", "Security"):
        at.sidebar.radio(key="page").set_value(page).run()
        assert_plain(at, page)

    at.sidebar.radio(key="page").set_value("Replay").run()
    assert_plain(at, "Replay")
    at = at.slider(key="replay_pos").set_value(at.slider(key="replay_pos").max).run()
    assert_plain(at, "Replay at its end")
