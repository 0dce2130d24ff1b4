"""The console in a real browser: Playwright drives Debian's Chromium (/usr/bin/chromium, installed
with `apt-get install -y chromium`; never a browser download) against `resihp ui` serving an
embedded bus pre-filled with an incident and a proposed plan. It signs in, opens the incident,
approves the plan, and checks the plan.decision on the bus.

Set RESIHP_UI_SCREENSHOTS=docs/screenshots to also save a PNG of every page there.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector import topics
from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.events import PlanDecision
from collector.stream import EventStream
from ui.auth import UsersFile
from tests.fixtures.console_demo import DemoSpec, demo_events

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent
JOB_SPEC = DemoSpec(job="gpt-13b", tp=4, pp=2, dp=4, num_layers=16, microbatches_per_replica=8, iterations=240,
                    fault_rank=13, fault_at=150, fault_factor=1.8, seed=1)
OLD_SPEC = DemoSpec(job="gpt-7b", tp=2, pp=2, dp=2, iterations=200, fault_rank=3, fault_at=40,
                    lifecycle="verified", seed=2)
INCIDENT_ID = f"inc-{JOB_SPEC.job}-{JOB_SPEC.fault_at}"
PLAN_ID = f"plan-{JOB_SPEC.job}-{JOB_SPEC.fault_at}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's browser with `apt-get install -y chromium`",
                    pytrace=False)
    bus_path = tmp_path / "bus.sqlite"
    with EmbeddedBus(bus_path) as bus:
        bus.publish(demo_events(OLD_SPEC))
        bus.publish(demo_events(JOB_SPEC))
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
    try:
        for _ in range(240):  # readiness wait for the server, not a timing assertion
            if proc.poll() is not None:
                pytest.fail(f"resihp ui exited with {proc.returncode}: {(tmp_path / 'streamlit.log').read_text()}")
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.25)
        yield url, bus_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _decisions(bus_path: Path) -> list:
    with EmbeddedBus(bus_path) as bus, EventStream(bus, "browser-test-reader", [topics.CONTROL]) as stream:
        return [d.event for d in stream.poll(10_000, 0.1) if isinstance(d.event.payload, PlanDecision)]


def test_ui_browser_sign_in_open_incident_approve_puts_decision_on_bus(served: tuple[str, Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, bus_path = served
    expect.set_options(timeout=60_000)  # a loaded CI machine folds the log slowly; this is a wait, not a bound
    shots = os.environ.get("RESIHP_UI_SCREENSHOTS")
    out = Path(shots) if shots else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def snap(page, name: str) -> None:
        """Save the whole page: Streamlit scrolls inside its main block, so grow the viewport to fit."""
        if not out:
            return
        page.wait_for_timeout(1500)  # let the script finish and Vega draw before the picture
        page.locator('[data-testid="stStatusWidget"]').wait_for(state="detached")
        height = page.evaluate('document.querySelector(\'[data-testid="stMainBlockContainer"]\').scrollHeight')
        page.set_viewport_size({"width": 1440, "height": max(1000, int(height) + 120)})
        page.wait_for_timeout(800)
        page.screenshot(path=str(out / f"{name}.png"))
        page.set_viewport_size({"width": 1440, "height": 1000})

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.get_by_label("User name").fill("alice")
        page.get_by_label("Password", exact=True).fill("alice-pw")
        snap(page, "signin")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_text("Signed in as")).to_be_visible()
        sidebar = page.locator('[data-testid="stSidebar"]')
        if out:
            page.locator(".st-key-jobs_job").get_by_role("combobox").click()
            page.get_by_role("option", name=JOB_SPEC.job).click()
            expect(page.get_by_text("TP4·PP2·DP4")).to_be_visible()
            snap(page, "jobs")

        sidebar.get_by_text("Incidents", exact=True).click()
        expect(page.get_by_role("heading", name="Incidents")).to_be_visible()
        if out:
            page.locator(".st-key-inc_filter").get_by_text("all", exact=True).click()
            expect(page.get_by_text("2 incidents")).to_be_visible()
            snap(page, "incidents")
        page.locator(f".st-key-open-{INCIDENT_ID} button").click()
        expect(page.get_by_role("heading", name=f"Incident {INCIDENT_ID}")).to_be_visible()
        snap(page, "incident")
        if out:
            page.get_by_role("tab", name="per-rank slowdown").click()
            snap(page, "incident-heatmap")
            page.get_by_role("tab", name="sequence lengths").click()
            snap(page, "incident-seqlens")
        page.locator(f".st-key-comment-{PLAN_ID} textarea").fill("drop the slow GPU, shift micro-batches")
        page.locator(f".st-key-comment-{PLAN_ID} textarea").press("Control+Enter")
        page.locator(f".st-key-approve-{PLAN_ID} button").click()
        expect(page.get_by_text("Approved by ui:alice")).to_be_visible()
        snap(page, "incident-approved")

        if out:
            sidebar.get_by_text("Policy", exact=True).click()
            expect(page.get_by_role("heading", name="Policy")).to_be_visible()
            snap(page, "policy")
            sidebar.get_by_text("Replay", exact=True).click()
            expect(page.get_by_role("heading", name="Replay")).to_be_visible()
            page.locator(".st-key-replay_source").get_by_role("combobox").click()
            page.get_by_role("option", name="gpt-7b-fail-slow.jsonl").click()
            expect(page.get_by_text("210 events over")).to_be_visible()
            expect(page.get_by_role("slider")).to_have_count(1)
            slider = page.get_by_role("slider")
            slider.focus()
            for _ in range(10):
                slider.press("PageUp")
            page.wait_for_timeout(1000)
            snap(page, "replay")
        browser.close()

    decisions = [d for d in _decisions(bus_path) if d.payload.plan_id == PLAN_ID]
    assert [(d.payload.plan_id, d.payload.approve, d.payload.actor) for d in decisions] == [(PLAN_ID, True, "ui:alice")]
    assert decisions[0].payload.comment == "drop the slow GPU, shift micro-batches"
    assert decisions[0].source == "ui:alice" and decisions[0].job == JOB_SPEC.job
