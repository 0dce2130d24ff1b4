"""Every console page in a real browser: Playwright drives Debian's Chromium (/usr/bin/chromium,
installed with `apt-get install -y chromium`; never a browser download) against one `resihp ui`
server for the whole module, serving an embedded bus pre-filled with jobs, incidents, pending plans
and a forged incident whose text is markdown and HTML pointing at a local counting HTTP server.

Each test checks what the operator sees after the action and, for decisions and policies, that the
event reached the bus. Tests use different jobs and plans, so their order does not matter.

Set RESIHP_UI_SCREENSHOTS=docs/screenshots to also save a PNG of the main pages there.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from collector import topics
from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.events import (
    Envelope, EventFactory, Evidence, FaultCategory, IncidentConfirmed, IncidentOpened, IterationPrediction, Location,
    PlanDecision,
    PlanProposed, PolicyChanged, Severity, SignInFailed,
)
from collector.plan import Plan
from collector.stream import EventStream
from ui.auth import UsersFile
from tests.fixtures.console_demo import DemoSpec, demo_events
from tests.fixtures.signing import signed_all

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.browser  # tests/fixtures/tiers.py

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent
JOB_SPEC = DemoSpec(job="gpt-13b", tp=4, pp=2, dp=4, num_layers=16, microbatches_per_replica=8, iterations=240,
                    fault_rank=13, fault_at=150, fault_factor=1.8, seed=1)
OLD_SPEC = DemoSpec(job="gpt-7b", tp=2, pp=2, dp=2, iterations=200, fault_rank=3, fault_at=40,
                    lifecycle="verified", seed=2)
REJECT_SPEC = DemoSpec(job="gpt-3b", tp=2, pp=2, dp=2, iterations=80, telemetry_iterations=0, fault_rank=5,
                       fault_at=40, seed=3)
INCIDENT_ID = f"inc-{JOB_SPEC.job}-{JOB_SPEC.fault_at}"
PLAN_ID = f"plan-{JOB_SPEC.job}-{JOB_SPEC.fault_at}"
REJECT_INCIDENT_ID = f"inc-{REJECT_SPEC.job}-{REJECT_SPEC.fault_at}"
REJECT_PLAN_ID = f"plan-{REJECT_SPEC.job}-{REJECT_SPEC.fault_at}"
FORGED_INCIDENT_ID = "inc-forged-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PixelServer:
    """A local HTTP server that counts every request by path: what the page made the browser fetch."""

    def __init__(self) -> None:
        hits: list[str] = []
        self.hits = hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the http.server API
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/gif")
                self.end_headers()
                self.wfile.write(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def forged_events(pixel_url: str) -> list[Envelope]:
    """An incident, its confirmation, a plan and a decision whose every text field is markdown and
    HTML that would make a browser fetch from ``pixel_url`` if it were rendered rather than shown.
    Signed with the session's keys: the console shows only control events that verify, and a
    writer holding a key (a buggy producer) can still write any text."""
    def bait(where: str) -> str:
        return (f"![x]({pixel_url}/px/{where}.png) <img src=\"{pixel_url}/px/{where}-html.png\"> "
                f":red[{where}] **bold-{where}**")

    job = f"x-forged {bait('job')}"
    analytics = EventFactory(job, f"analytics {bait('source')}")
    planner = EventFactory(job, "remediation")
    t = 1_700_000_500.0
    loc = Location(target="compute", rank=1, factor=2.0)
    return signed_all([
        analytics.make(IncidentOpened(
            incident_id=FORGED_INCIDENT_ID, category=FaultCategory.FAIL_SLOW, severity=Severity.CRITICAL,
            iteration=7, locations=[loc], summary=bait("summary"),
            evidence=Evidence(iterations=[6, 7], observed_s=[1.0, 2.0], predicted_s=[1.0, 1.0],
                              statistic=bait("statistic"), note=bait("note"))), time_s=t),
        analytics.make(IncidentConfirmed(incident_id=FORGED_INCIDENT_ID, method="persistence",
                                         detail=bait("detail")), time_s=t + 1),
        EventFactory(job, "analytics").make(IncidentOpened(
            incident_id="inc-forged-2", category=FaultCategory.FAIL_SLOW, severity=Severity.LOW, iteration=8,
            locations=[loc], evidence=Evidence(), summary="a second writer for the same job"), time_s=t + 2),
    ] + [analytics.make(IterationPrediction(epoch=0, iteration=i, observed_s=1.0 + i / 8, predicted_s=1.0, tokens=4096,
                                            model_error=0.0), time_s=t - 8 + i) for i in range(8)
         ] + _forged_plan(planner, bait, t + 3))


def _forged_plan(planner: EventFactory, bait: Callable[[str], str], t: float) -> list[Envelope]:
    new = Plan.uniform(tp=1, pp=1, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1)
    return [
        planner.make(PlanProposed(
            plan_id="plan-forged-1", incident_ids=[FORGED_INCIDENT_ID], strategy=bait("strategy"), base_epoch=0,
            plan=new, current_tokens_per_s=100.0, predicted_tokens_per_s=150.0, reshape_cost_s=1.0,
            diff=[bait("diff")], severity=Severity.CRITICAL), time_s=t),
        EventFactory(planner.job, f"ui:{bait('actor')}").make(PlanDecision(
            plan_id="plan-forged-1", approve=False, actor=f"ui:{bait('actor')}", comment=bait("comment")), time_s=t + 1),
    ]


@dataclass
class Served:
    url: str
    bus_path: Path
    pixels: PixelServer
    browser: Browser


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One console server, one pixel server and one browser for every test of the module."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's browser with `apt-get install -y chromium`",
                    pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    tmp_path = tmp_path_factory.mktemp("console")
    pixels = PixelServer()
    bus_path = tmp_path / "bus.sqlite"
    with EmbeddedBus(bus_path) as bus:
        bus.publish(demo_events(OLD_SPEC))
        bus.publish(demo_events(JOB_SPEC))
        bus.publish(demo_events(REJECT_SPEC))
        bus.publish(forged_events(pixels.url))
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "gpt-7b-fail-slow.jsonl").write_bytes(b"\n".join(encode(e) for e in demo_events(OLD_SPEC)))
    UsersFile(tmp_path / "users.toml").add_user("alice", "operator", "alice-pw")
    port = _free_port()
    log = (tmp_path / "streamlit.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "ui", "--port", str(port), "--bus", "embedded", "--bus-path", str(bus_path),
         "--users", str(tmp_path / "users.toml"), "--traces", str(traces)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    pw = sync_playwright().start()
    try:
        for _ in range(240):  # readiness wait for the server, not a timing assertion
            if proc.poll() is not None:
                pytest.fail(f"resihp ui exited with {proc.returncode}: {(tmp_path / 'streamlit.log').read_text()}")
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.25)
        expect.set_options(timeout=60_000)  # a loaded CI machine folds the log slowly; a wait, not a bound
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield Served(url, bus_path, pixels, browser)
        browser.close()
    finally:
        pw.stop()
        pixels.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def page(served: Served):
    """alice, signed in once; each test moves through the sidebar from wherever the last one left off."""
    from playwright.sync_api import expect

    context = served.browser.new_context(viewport={"width": 1440, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(60_000)
    sign_in(p, served.url, "alice", "alice-pw")
    expect(p.get_by_text("Signed in as")).to_be_visible()
    yield p
    context.close()


def sign_in(page, url: str, name: str, password: str) -> None:
    page.goto(url)
    page.get_by_label("User name").fill(name)
    page.get_by_label("Password", exact=True).fill(password)
    page.get_by_role("button", name="Sign in").click()


def go(page, name: str) -> None:
    from playwright.sync_api import expect
    page.locator('[data-testid="stSidebar"]').get_by_text(name, exact=True).click()
    expect(page.get_by_role("heading", name=name, exact=True)).to_be_visible()


def snap(page, name: str) -> None:
    """With RESIHP_UI_SCREENSHOTS set, save the whole page (Streamlit scrolls inside its main block,
    so the viewport grows to fit)."""
    shots = os.environ.get("RESIHP_UI_SCREENSHOTS")
    if not shots:
        return
    Path(shots).mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(1500)  # let the script finish and Vega draw before the picture
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="detached")
    height = page.evaluate('document.querySelector(\'[data-testid="stMainBlockContainer"]\').scrollHeight')
    page.set_viewport_size({"width": 1440, "height": max(1000, int(height) + 120)})
    page.wait_for_timeout(800)
    page.screenshot(path=str(Path(shots) / f"{name}.png"))
    page.set_viewport_size({"width": 1440, "height": 1000})


def control_events(bus_path: Path, kind: type) -> list:
    with EmbeddedBus(bus_path) as bus, EventStream(bus, f"browser-test-{time.monotonic_ns()}", [topics.CONTROL]) as s:
        return [d.event for d in s.poll(100_000, 0.1) if isinstance(d.event.payload, kind)]


def open_incident(page, incident_id: str) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    page.locator(".st-key-inc_filter").get_by_text("all", exact=True).click()
    page.locator(f".st-key-open-{incident_id} button").click()
    expect(page.get_by_role("heading", name=f"Incident {incident_id}")).to_be_visible()


def leave_incident(page) -> None:
    """The Incidents page's list. The console remembers an open incident across pages (the session
    and ``?incident=``), so its page may open on it: then back to the list. A rerun still under way
    (a test's last click) can show neither yet, or an old back button that is about to go: so look
    again until the list is there, clicking a back button only while one is visible."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect
    page.locator('[data-testid="stSidebar"]').get_by_text("Incidents", exact=True).click()
    listed = page.get_by_role("heading", name="Incidents", exact=True)
    back = page.locator(".st-key-back button").filter(visible=True)
    for _ in range(10):
        try:
            expect(listed.or_(back).first).to_be_visible(timeout=10_000)
            if not listed.is_visible():
                back.first.click(timeout=5_000)
            expect(listed).to_be_visible(timeout=10_000)
            return
        except (AssertionError, PlaywrightError):
            continue  # a rerun replaced what was looked at: look again
    expect(listed).to_be_visible()  # the last word, with its message


def test_ui_browser_incident_shows_its_evidence_and_approve_puts_the_decision_on_the_bus(served: Served, page) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    open_incident(page, INCIDENT_ID)
    expect(page.get_by_text("detector statistic: CUSUM on observed/predicted")).to_be_visible()
    expect(page.locator('[data-testid="stVegaLiteChart"]').first).to_be_visible()  # observed vs predicted
    snap(page, "incident")
    page.get_by_role("tab", name="per-rank slowdown").click()
    expect(page.locator('[data-testid="stImage"] img').first).to_be_visible()  # the heatmap
    snap(page, "incident-heatmap")
    page.get_by_role("tab", name="locations").click()
    expect(page.locator('[data-testid="stDataFrame"]').first).to_be_visible()
    page.locator(f".st-key-comment-{PLAN_ID} textarea").fill("drop the slow GPU, shift micro-batches")
    page.locator(f".st-key-comment-{PLAN_ID} textarea").press("Control+Enter")
    page.locator(f".st-key-approve-{PLAN_ID} button").click()
    expect(page.get_by_text("Approved by ui:alice")).to_be_visible()
    expect(page.locator(f".st-key-approve-{PLAN_ID} button")).to_have_count(0)
    snap(page, "incident-approved")
    leave_incident(page)

    decisions = [d for d in control_events(served.bus_path, PlanDecision) if d.payload.plan_id == PLAN_ID]
    assert [(d.payload.approve, d.payload.actor, d.payload.comment, d.source, d.job) for d in decisions] == [
        (True, "ui:alice", "drop the slow GPU, shift micro-batches", "ui:alice", JOB_SPEC.job)]


def test_ui_browser_reject_shows_the_verdict_and_puts_it_on_the_bus(served: Served, page) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    open_incident(page, REJECT_INCIDENT_ID)
    page.locator(f".st-key-reject-{REJECT_PLAN_ID} button").click()
    expect(page.get_by_text("Rejected by ui:alice")).to_be_visible()
    expect(page.get_by_text("rejected", exact=True).first).to_be_visible()  # the timeline's step
    leave_incident(page)
    decisions = [d for d in control_events(served.bus_path, PlanDecision) if d.payload.plan_id == REJECT_PLAN_ID]
    assert [(d.payload.approve, d.payload.actor) for d in decisions] == [(False, "ui:alice")]


def test_ui_browser_auto_apply_policy_is_shown_and_published(served: Served, page) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    go(page, "Policy")
    page.locator(".st-key-policy_job").get_by_role("combobox").click()
    page.get_by_role("option", name=REJECT_SPEC.job, exact=True).click()
    page.locator(f".st-key-policy_mode_{REJECT_SPEC.job}").get_by_text("auto-apply (by severity)").click()
    snap(page, "policy")
    page.locator(".st-key-policy_save button").click()
    expect(page.get_by_text(f"Policy of {REJECT_SPEC.job} set to auto-apply (by severity) by ui:alice")).to_be_visible()
    expect(page.get_by_text("Current: auto-apply (by severity) for severities high, critical when p_real ≥ 0.90 "
                            "— set by ui:alice")).to_be_visible()
    (changed,) = [e for e in control_events(served.bus_path, PolicyChanged) if e.job == REJECT_SPEC.job]
    assert (changed.payload.mode.value, [s.value for s in changed.payload.auto_severities], changed.payload.actor,
            changed.payload.auto_min_p_real) == ("auto", ["high", "critical"], "ui:alice", 0.9)


def test_ui_browser_job_view_shows_the_layout_series_and_plan_grid(page) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    go(page, "Jobs")
    page.locator(".st-key-jobs_job").get_by_role("combobox").click()
    page.get_by_role("option", name=JOB_SPEC.job, exact=True).click()
    expect(page.get_by_text("TP4·PP2·DP4")).to_be_visible()
    expect(page.get_by_text("240 iterations, drawn as")).to_be_visible()
    expect(page.get_by_text("Open incidents")).to_be_visible()
    expect(page.get_by_text("Goodput")).to_be_visible()  # the headline, with its breakdown bar
    # goodput breakdown, time, throughput, plan grid
    expect(page.locator('[data-testid="stVegaLiteChart"]')).to_have_count(4)
    snap(page, "jobs")


def test_ui_browser_replay_plays_a_trace_to_its_end(page) -> None:
    from playwright.sync_api import expect
    leave_incident(page)
    go(page, "Replay")
    page.locator(".st-key-replay_source").get_by_role("combobox").click()
    page.get_by_role("option", name="gpt-7b-fail-slow.jsonl").click()
    shown = sum(e.kind != "telemetry.iteration" for e in demo_events(OLD_SPEC))  # Replay skips per-rank telemetry
    expect(page.get_by_text(f"{shown} events over")).to_be_visible()
    slider = page.get_by_role("slider")
    slider.focus()
    slider.press("End")
    expect(page.get_by_text(f"{shown} of {shown} events")).to_be_visible()
    expect(page.get_by_text("Job gpt-7b — epoch 1")).to_be_visible()  # the replayed reshape
    snap(page, "replay")


def test_ui_browser_failed_sign_in_is_refused_recorded_and_shown_to_operators(served: Served, page) -> None:
    from playwright.sync_api import expect
    context = served.browser.new_context(viewport={"width": 1440, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(60_000)
    sign_in(p, served.url, "alice", "wrong-password-7")
    expect(p.get_by_text("wrong user name or password. Nothing was changed; try again.")).to_be_visible()
    expect(p.get_by_text("Signed in as")).to_have_count(0)
    context.close()
    (failed,) = [e.payload for e in control_events(served.bus_path, SignInFailed) if e.payload.user == "alice"]
    assert (failed.reason, failed.client, failed.user_failures) == ("wrong_password", "localhost", 1)
    leave_incident(page)
    go(page, "Security")  # alice, an operator, in her own session
    page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Refresh").click()
    expect(page.get_by_text("1 failed sign-ins (newest first)")).to_be_visible()
    snap(page, "security")
    raw = b" ".join(e.model_dump_json().encode() for e in control_events(served.bus_path, SignInFailed))
    assert b"wrong-password-7" not in raw and b"alice-pw" not in raw


def test_ui_browser_forged_markdown_and_html_are_shown_as_text_and_fetch_nothing(served: Served, page) -> None:
    """Every page that shows the forged job's text is visited; the counting server must see no request
    for the bait, while an image this test adds itself does reach it (so the count can be non-zero)."""
    from playwright.sync_api import expect
    leave_incident(page)
    open_incident(page, FORGED_INCIDENT_ID)
    expect(page.get_by_text(":red[diff] **bold-diff**").first).to_be_visible()
    literal = f"![x]({served.pixels.url}/px/summary.png) <img src=\"{served.pixels.url}/px/summary-html.png\">"
    shown = page.locator('[data-testid="stMain"]').inner_text().replace("\u2060", "")  # word joiners break autolinks
    assert literal in shown
    expect(page.locator(f'a[href^="{served.pixels.url}"]')).to_have_count(0)  # not even a link to click
    expect(page.get_by_text("note.png) <img src=").first).to_be_visible()
    expect(page.get_by_text("Rejected by ui:![x](").first).to_be_visible()
    leave_incident(page)
    go(page, "Jobs")
    page.locator(".st-key-jobs_job").get_by_role("combobox").click()
    page.get_by_role("option", name="x-forged").click()
    expect(page.get_by_text("come from 2 sources").first).to_be_visible()  # two analytics writers
    go(page, "Security")
    expect(page.get_by_text("come from 2 sources").first).to_be_visible()
    expect(page.locator(f'a[href^="{served.pixels.url}"]')).to_have_count(0)
    go(page, "Replay")
    page.locator(".st-key-replay_source").get_by_role("combobox").click()
    page.get_by_role("option", name="this console's bus (live log)").click()
    slider = page.get_by_role("slider")
    slider.focus()
    slider.press("End")
    expect(page.get_by_text("Job x-forged ![x](").first).to_be_visible()
    page.wait_for_load_state("networkidle")

    assert [h for h in served.pixels.hits if h.startswith("/px/")] == []
    page.evaluate("u => { const i = new Image(); i.src = u; document.body.appendChild(i); }",
                  served.pixels.url + "/control.png")
    expect(page.locator(f'img[src="{served.pixels.url}/control.png"]')).to_have_js_property("complete", True)
    assert "/control.png" in served.pixels.hits
