"""The real Prometheus and Alertmanager (Debian's binaries) against a live analytics consumer.

One Prometheus and one Alertmanager are started for the module (scrape and evaluation every second,
group wait one second) by infra/monitoring.py, the same code as ``resihp ops up``. A simulated job
publishes to an embedded bus; ``resihp analytics --metrics-port`` (the real command, a child
process) folds it and serves /metrics. Prometheus scrapes it on loopback; the rules file is the
one shipped (infra/prometheus/rules.yml); the injected fail-stop fires ResihpFailStop, which
Alertmanager delivers to a webhook receiver running in this test, labelled with the incident it is
about; the console reads the same alert from Alertmanager's API and shows it on that incident's
page. Nothing here is a mock.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from streamlit.testing.v1 import AppTest

from collector.goodput import GoodputFold
from collector.codec import decode
from collector.embedded import EmbeddedBus
from collector.events import Envelope, FaultCategory, IncidentOpened
from collector.plan import Plan
from infra import monitoring
from trainer.sim.engine import SimConfig, SimEngine
from trainer.fault_spec import FaultSpec
from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
from trainer.sim.runner import run_open_loop
from ui.alerts import firing_alerts
from tests.fixtures.processes import owned_by_fixture
from ui.auth import UsersFile
from ui.views.common import plain

REPO = Path(__file__).resolve().parent.parent
JOB = "prom-job"
CONSOLE_URL = "http://console.example:8501"

pytestmark = [pytest.mark.slow, pytest.mark.monitoring]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Webhook:
    """Alertmanager's webhook receiver: keeps every notification it is sent."""

    def __init__(self) -> None:
        received = self.received = []  # type: list[dict[str, Any]]

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/alerts"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}")


def _query(prom: monitoring.Server, expr: str) -> list[dict]:
    url = f"{prom.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


def _scalar(prom: monitoring.Server, expr: str) -> float | None:
    result = _query(prom, expr)
    return float(result[0]["value"][1]) if result else None


class _Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bus_path = tmp / "bus.sqlite"
        self.bus = EmbeddedBus(self.bus_path)
        plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=MODEL_PRESETS["tiny"].layers, microbatches_per_replica=4)
        self.sim = SimEngine(SimConfig(model=MODEL_PRESETS["tiny"], cluster=ClusterSpec(gpus=8), plan=plan, job=JOB,
                                       seed=7, heartbeat_interval_s=1.0),
                             [FaultSpec(kind="stop_device", device=3, at_iteration=150)])
        self.metrics_port = _free_port()
        self.webhook = _Webhook()
        self.alertmanager = monitoring.start_alertmanager(tmp / "ops", self.webhook.url, port=_free_port(),
                                                          group_wait="1s", group_interval="1s")
        self.prometheus = monitoring.start_prometheus(
            tmp / "ops", [f"127.0.0.1:{self.metrics_port}"], self.alertmanager.url.removeprefix("http://"),
            port=_free_port(), scrape_interval="1s", evaluation_interval="1s", console_url=CONSOLE_URL)
        self.analytics = self.start_analytics()

    def start_analytics(self) -> subprocess.Popen:
        """The consumer, the stack's (a test that restarts it hands the new one to the stack)."""
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return owned_by_fixture(subprocess.Popen(
            [sys.executable, "-m", "resihp.cli", "analytics", "--bus", "embedded", "--bus-path", str(self.bus_path),
             "--db", str(self.tmp / "analytics.duckdb"), "--metrics-port", str(self.metrics_port)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.tmp / "analytics.log", "ab")))

    def run(self, iterations: int | None = None, duration_s: float | None = None, max_hang_s: float = 30.0) -> None:
        def publish(events: list[Envelope]) -> None:
            self.bus.publish(events)

        run_open_loop(self.sim, publish, iterations=iterations, duration_s=duration_s, max_hang_s=max_hang_s)

    def published(self) -> list[Envelope]:
        """Every event on the bus, in event-time order."""
        from collector import topics

        consumer = self.bus.consumer("test-fold", [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
                                     lambda ps: {tp: 0 for tp in ps})
        events = []
        while batch := consumer.poll(100_000, 0.0):
            events += [decode(r.value) for r in batch]
        consumer.close()
        return sorted(events, key=lambda e: e.time_s)

    def published_fold(self) -> GoodputFold:
        """The goodput fold applied to every event on the bus, in this process: what /metrics must show."""
        fold = GoodputFold()
        fold.apply_all(self.published())
        return fold

    def close(self) -> None:
        self.analytics.terminate()
        self.analytics.wait(20)
        self.prometheus.stop()
        self.alertmanager.stop()
        self.webhook.close()
        self.bus.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    missing = monitoring.missing_binaries()
    if missing:
        pytest.fail(f"{', '.join(missing)} not on PATH: install Debian's prometheus and prometheus-alertmanager "
                    "(`make test` does)")
    s = _Stack(tmp_path_factory.mktemp("prometheus"))
    try:
        yield s
    finally:
        s.close()


def test_promtool_accepts_the_shipped_rules() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(monitoring.RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def test_prometheus_scrapes_the_consumer_and_reads_the_folds_figures(stack: _Stack) -> None:
    stack.run(iterations=100)
    expected = stack.published_fold().breakdown(JOB)
    assert expected is not None and expected.wall_s > 0
    _wait("up == 1", lambda: _scalar(stack.prometheus, 'up{job="resihp"}') == 1.0)
    wall = f'resihp_goodput_wall_seconds_total{{job="{JOB}"}}'
    _wait("the consumer to have folded every iteration",
          lambda: (_scalar(stack.prometheus, wall) or 0) >= expected.wall_s - 1e-9)
    assert _scalar(stack.prometheus, wall) == pytest.approx(expected.wall_s, rel=1e-9)
    assert _scalar(stack.prometheus, f'resihp_goodput_ratio{{job="{JOB}"}}') == pytest.approx(expected.ratio, rel=1e-9)
    assert _scalar(stack.prometheus, f'resihp_iterations_total{{job="{JOB}"}}') == 100
    causes = {r["metric"]["cause"] for r in _query(stack.prometheus, f'resihp_goodput_loss_seconds_total{{job="{JOB}"}}')}
    assert causes == {"fail_stop", "fail_slow", "reshape", "restart", "approval", "other"}
    assert _scalar(stack.prometheus, f'sum(resihp_open_incidents{{job="{JOB}",category="fail_stop"}})') == 0
    lag = _query(stack.prometheus, 'resihp_consumer_lag_records{group="analytics"}')
    assert {r["metric"]["topic"] for r in lag} == {"resihp.telemetry", "resihp.analytics", "resihp.control"}
    # per stage: the newest iteration's (replica, stage) rows of the detector's prediction on the bus
    # (the consumer publishes the prediction and folds it when it reads it back: wait for that)
    def stages_agree() -> bool:
        stages = {(str(st), str(r)): (o, p) for r, st, o, p in stack.published_fold().jobs[JOB].last_stages}
        assert len(stages) == 4  # TP2·PP2·DP2
        return all({(r["metric"]["stage"], r["metric"]["replica"]): float(r["value"][1])
                    for r in _query(stack.prometheus, f'{name}{{job="{JOB}"}}')} == {k: v[at] for k, v in stages.items()}
                   for name, at in (("resihp_stage_observed_seconds", 0), ("resihp_stage_predicted_seconds", 1)))

    _wait("Prometheus to read the newest prediction's per-stage rows", stages_agree)


def test_an_unknown_job_is_a_404_and_a_known_one_only_its_series(stack: _Stack) -> None:
    base = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{base}/job/no-such-job", timeout=5)
    assert err.value.code == 404 and JOB in err.value.read().decode()
    with urllib.request.urlopen(f"{base}/job/{JOB}", timeout=5) as r:
        text = r.read().decode()
    assert f'resihp_goodput_ratio{{job="{JOB}"}}' in text and "resihp_consumer_lag_records" not in text


def test_an_injected_fail_stop_fires_the_alert_and_alertmanager_delivers_it(stack: _Stack) -> None:
    stack.run(duration_s=stack.sim.now_s + 60.0)  # the device stops at iteration 150; the job hangs
    assert stack.sim.hanging_for_s > 0
    firing = _wait("ResihpFailStop to fire in Prometheus", lambda: [
        a for a in json.loads(urllib.request.urlopen(f"{stack.prometheus.url}/api/v1/alerts", timeout=5).read())
        ["data"]["alerts"] if a["labels"]["alertname"] == "ResihpFailStop" and a["state"] == "firing"])
    assert firing[0]["labels"]["job"] == JOB
    notes = _wait("Alertmanager to deliver it to the webhook", lambda: [
        a for n in stack.webhook.received for a in n["alerts"] if a["labels"]["alertname"] == "ResihpFailStop"])
    assert notes[0]["status"] == "firing" and notes[0]["labels"]["severity"] == "page"
    assert notes[0]["annotations"]["runbook_url"] == "docs/runbooks/fail-stop.md"
    assert (REPO / notes[0]["annotations"]["runbook_url"]).exists()
    # the alert names its incident, the one the detector opened on the bus, and links to its page
    dead = [e.payload for e in stack.published() if isinstance(e.payload, IncidentOpened)
            and e.payload.category == FaultCategory.FAIL_STOP]
    assert [notes[0]["labels"]["incident_id"]] == [i.incident_id for i in dead]
    incident_id = dead[0].incident_id
    assert notes[0]["annotations"]["incident_url"] == f"{CONSOLE_URL}/?page=Incidents&incident={incident_id}"
    # the hang is charged to fail-stop as it lasts, and Prometheus reads the same figure as the fold
    expected = stack.published_fold().breakdown(JOB)
    assert expected is not None and expected.loss_s["fail_stop"] > 10.0
    loss = f'resihp_goodput_loss_seconds_total{{job="{JOB}",cause="fail_stop"}}'
    _wait("the fail-stop loss to reach the fold's", lambda: (_scalar(stack.prometheus, loss) or 0) >= expected.loss_s["fail_stop"] - 1e-6)


def test_a_restarted_consumer_goes_on_from_its_counters(stack: _Stack) -> None:
    """Killed outright and started again on the same DuckDB file, the consumer serves the counters it
    had: Prometheus sees no reset of any goodput counter across the gap."""
    wall = f'resihp_goodput_wall_seconds_total{{job="{JOB}"}}'
    before = _scalar(stack.prometheus, wall)
    assert before is not None and before > 0
    stack.analytics.kill()
    stack.analytics.wait(10)
    _wait("Prometheus to see the consumer down", lambda: _scalar(stack.prometheus, 'up{job="resihp"}') == 0.0)
    stack.run(duration_s=stack.sim.now_s + 5.0, max_hang_s=1e9)  # the job goes on (hung) while it is away
    stack.analytics = stack.start_analytics()
    _wait("the consumer back up", lambda: _scalar(stack.prometheus, 'up{job="resihp"}') == 1.0)
    _wait("the wall time past where it was", lambda: (_scalar(stack.prometheus, wall) or 0) > before)
    for series in (wall, f'resihp_goodput_loss_seconds_total{{job="{JOB}"}}'):
        resets = _query(stack.prometheus, f"resets({series}[10m])")
        assert resets and all(float(r["value"][1]) == 0 for r in resets), resets


def test_the_console_shows_the_firing_alert_on_its_incident(stack: _Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console asks the live Alertmanager: the Incidents page lists the fail-stop alert with the
    way into its incident, and that incident's page shows it with its runbook."""
    incident_id = _wait("ResihpFailStop in Alertmanager", lambda: [
        a.incident_id for a in firing_alerts(stack.alertmanager.url) if a.name == "ResihpFailStop"])[0]
    users = UsersFile(stack.tmp / "users.toml")
    users.add_user("carol", "viewer", "carol-pw")
    for var, value in (("RESIHP_BUS", "embedded"), ("RESIHP_EMBEDDED_PATH", str(stack.bus_path)),
                       ("RESIHP_UI_USERS", str(stack.tmp / "users.toml")),
                       ("RESIHP_UI_TRACE_DIR", str(stack.tmp / "traces")),
                       ("RESIHP_UI_ALERTMANAGER_URL", stack.alertmanager.url)):
        monkeypatch.setenv(var, value)
    at = AppTest.from_file(str(REPO / "ui" / "app.py"), default_timeout=120).run()
    at.text_input(key="signin_name").input("carol")
    at.text_input(key="signin_password").input("carol-pw")
    at = at.button[0].click().run()
    at = at.sidebar.radio(key="page").set_value("Incidents").run()
    assert "Firing alerts" in [h.value for h in at.subheader]
    at = at.button(key=f"alert-open-{incident_id}-ResihpFailStop").click().run()
    assert at.header[0].value == f"Incident {plain(incident_id)}"
    shown = " ".join(e.value for e in at.error)
    assert "ResihpFailStop" in shown and plain("docs/runbooks/fail-stop.md") in shown


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """{(sample name, labels): value} of one scrape, None while the server is not up yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_replay_is_scraped_with_counters_that_only_climb_and_add_up(stack: _Stack) -> None:
    """A second consumer replays the whole log from the beginning (``--rebuild --no-detect`` on a
    fresh DuckDB, its own group) while it is scraped as fast as it answers: within the process no
    counter ever goes back, every scrape's wall time is productive + losses + pending, and it ends
    on the fold's figures."""
    expected = stack.published_fold().breakdown(JOB)
    assert expected is not None
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    replay = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "analytics", "--bus", "embedded", "--bus-path", str(stack.bus_path),
         "--db", str(stack.tmp / "replay.duckdb"), "--group", "replay", "--rebuild", "--no-detect", "--batch", "300",
         "--metrics-port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(stack.tmp / "replay.log", "ab"))
    scrapes = []
    try:
        url = f"http://127.0.0.1:{port}/metrics/job/{JOB}"
        wall = ("resihp_goodput_wall_seconds_total", (("job", JOB),))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = _scrape(url)
            if got is not None:
                scrapes.append(got)
                if got[wall] >= expected.wall_s - 1e-9:
                    break
            time.sleep(0.05)
    finally:
        replay.terminate()
        replay.wait(20)
    assert scrapes and scrapes[-1][wall] == pytest.approx(expected.wall_s, rel=1e-9)
    for before, after in zip(scrapes, scrapes[1:]):
        for key, value in after.items():
            if key[0].endswith("_total") and key in before:
                assert value >= before[key], (key, before[key], value)
    for got in scrapes:
        parts = sum(v for (name, _), v in got.items() if name in (
            "resihp_goodput_loss_seconds_total", "resihp_goodput_productive_seconds", "resihp_goodput_pending_seconds"))
        assert parts == pytest.approx(got[wall], abs=1e-6)
