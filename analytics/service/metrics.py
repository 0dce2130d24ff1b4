"""``/metrics`` in the Prometheus exposition format, rendered at scrape time from folded state.

The analytics consumer serves :class:`AnalyticsCollector` (goodput and its loss by cause, observed
against predicted iteration time, open incidents, rank health, consumer lag, dead letters); the
remediation engine serves :class:`ApprovalCollector` (plans waiting for an operator and for how long).
Both are prometheus-client custom collectors over an immutable snapshot that the owning process
swaps in after each committed transaction, so a scrape never reads half a batch and never blocks
the consumer (the server runs in a daemon thread).

Cardinality is bounded at any scale: series are per job (and cause, category, severity, state,
topic); ranks appear only as a bucketed gauge histogram of slowdown factors, and one series per
rank only for ranks the detector calls slow (at most 256 per job), one per open incident (at most
64 per job, so each alert names its incident) and one per (replica, stage) of the newest iteration
(at most 256 per job). Names and units follow
Prometheus' conventions (``_seconds_total`` counters, ``_ratio`` gauges); docs/metrics.md lists them.

``GET /metrics`` renders every job; ``GET /metrics/job/NAME`` (or ``/metrics?job=NAME``) only that
job's series, and 404 naming the known jobs when there is no such job. Anything else is 404.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collector.goodput import CAUSES
from analytics.projections.goodput_projection import FACTOR_BUCKETS, JobFigures
from collector.bus import Bus, TopicPartition
from collector.events import FaultCategory, Severity

CATEGORIES = tuple(c.value for c in FaultCategory)
SEVERITIES = tuple(s.value for s in Severity)
MAX_INCIDENT_SERIES = 64  # per job: one series per open incident, so an alert can name it; bounded all the same


@dataclass(frozen=True)
class AnalyticsSnapshot:
    """What one scrape of the analytics consumer renders."""

    jobs: Mapping[str, JobFigures] = field(default_factory=dict)
    lag: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (group, topic) -> records behind
    dead_letters: Mapping[str, int] = field(default_factory=dict)  # group -> records dead-lettered


class AnalyticsCollector(Collector):
    """Renders the latest :class:`AnalyticsSnapshot`; ``only_job`` restricts it to one job's series."""

    def __init__(self, snapshot: Callable[[], AnalyticsSnapshot], only_job: str | None = None) -> None:
        self._snapshot = snapshot
        self.only_job = only_job

    def jobs(self) -> list[str]:
        return sorted(self._snapshot().jobs)

    def for_job(self, job: str) -> AnalyticsCollector:
        return AnalyticsCollector(self._snapshot, job)

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        figures = [f for j, f in sorted(snap.jobs.items()) if self.only_job in (None, j)]
        yield from _goodput_families(figures)
        yield from _incident_families(figures)
        yield from _health_families(figures)
        if self.only_job is None:
            lag = GaugeMetricFamily("resihp_consumer_lag_records", "Records published but not yet read by the consumer "
                                    "group, per topic.", labels=["group", "topic"])
            for (group, topic), n in sorted(snap.lag.items()):
                lag.add_metric([group, topic], n)
            yield lag
            dead = CounterMetricFamily("resihp_dead_letters", "Records this consumer could not decode and sent to the "
                                       "dead-letter topic (since the process started).", labels=["group"])
            for group, n in sorted(snap.dead_letters.items()):
                dead.add_metric([group], n)
            yield dead


def _goodput_families(figures: list[JobFigures]) -> Iterator[Metric]:
    ratio = GaugeMetricFamily("resihp_goodput_ratio", "Share of the job's wall time spent on productive training "
                              "(ETTR).", labels=["job"])
    wall = CounterMetricFamily("resihp_goodput_wall_seconds", "Wall time of the job on its own clock.", labels=["job"])
    productive = GaugeMetricFamily("resihp_goodput_productive_seconds", "Productive training time: iteration time "
                                   "less the drag charged to fail-slow incidents.", labels=["job"])
    loss = CounterMetricFamily("resihp_goodput_loss_seconds", "Wall time lost, by cause.", labels=["job", "cause"])
    pending = GaugeMetricFamily("resihp_goodput_pending_seconds", "Time since the last iteration not yet charged to a "
                                "cause.", labels=["job"])
    observed = GaugeMetricFamily("resihp_iteration_observed_seconds", "The newest iteration's observed time.",
                                 labels=["job"])
    predicted = GaugeMetricFamily("resihp_iteration_predicted_seconds", "The detector's prediction of the newest "
                                  "iteration's time.", labels=["job"])
    stage_observed = GaugeMetricFamily("resihp_stage_observed_seconds", "The newest iteration's compute time of one "
                                       "pipeline stage of one replica.", labels=["job", "stage", "replica"])
    stage_predicted = GaugeMetricFamily("resihp_stage_predicted_seconds", "The cost model's prediction of that stage's "
                                        "compute time.", labels=["job", "stage", "replica"])
    iterations = CounterMetricFamily("resihp_iterations", "Iterations completed.", labels=["job"])
    tokens = CounterMetricFamily("resihp_tokens", "Tokens trained.", labels=["job"])
    for f in figures:
        g = f.goodput
        if g is not None:
            ratio.add_metric([f.job], g.ratio)
            wall.add_metric([f.job], g.wall_s)
            productive.add_metric([f.job], g.productive_s)
            pending.add_metric([f.job], g.pending_s)
            for cause in CAUSES:
                loss.add_metric([f.job, cause], g.loss_s.get(cause, 0.0))
        if f.observed_s is not None and f.predicted_s is not None:
            observed.add_metric([f.job], f.observed_s)
            predicted.add_metric([f.job], f.predicted_s)
        for replica, stage, obs, pred in f.stages:
            stage_observed.add_metric([f.job, str(stage), str(replica)], obs)
            stage_predicted.add_metric([f.job, str(stage), str(replica)], pred)
        iterations.add_metric([f.job], f.iterations)
        tokens.add_metric([f.job], f.tokens)
    yield from (ratio, wall, productive, loss, pending, observed, predicted, stage_observed, stage_predicted, iterations,
                tokens)


def _incident_families(figures: list[JobFigures]) -> Iterator[Metric]:
    open_ = GaugeMetricFamily("resihp_open_incidents", "Open incidents by category and severity.",
                              labels=["job", "category", "severity"])
    factor = GaugeMetricFamily("resihp_incident_slowdown_factor", "Largest estimated slowdown among the open "
                               "incidents of a category (1 when none is open).", labels=["job", "category"])
    p_real = GaugeMetricFamily("resihp_incident_p_real", "How sure the detector is that a fault is real (calibrated "
                               "on the detection suite; 0.5 uncalibrated): the highest among the open incidents of a "
                               "category (0 when none is open).", labels=["job", "category"])
    each_p_real = GaugeMetricFamily("resihp_open_incident_p_real", "Each open incident of "
                                    "resihp_open_incident_slowdown_factor: how sure the detector is that its fault is "
                                    "real, for alerts to page on real faults only.",
                                    labels=["job", "incident_id", "category", "severity"])
    each = GaugeMetricFamily("resihp_open_incident_slowdown_factor", "Each open incident (at most "
                             f"{MAX_INCIDENT_SERIES} per job, fail-stop first, then the largest): its estimated "
                             "slowdown, and its id for the alert to link to.",
                             labels=["job", "incident_id", "category", "severity"])
    for f in figures:
        ranked = sorted(f.incidents.items(), key=lambda kv: (kv[1].category != "fail_stop", -kv[1].factor, kv[0]))
        for iid, inc in ranked[:MAX_INCIDENT_SERIES]:
            each.add_metric([f.job, iid, inc.category, inc.severity], min(inc.factor, 1e6))
            each_p_real.add_metric([f.job, iid, inc.category, inc.severity], inc.p_real)
        for cat in CATEGORIES:
            mine = [i for i in f.incidents.values() if i.category == cat]
            for sev in SEVERITIES:
                open_.add_metric([f.job, cat, sev], sum(i.severity == sev for i in mine))
            factor.add_metric([f.job, cat], max((min(i.factor, 1e6) for i in mine), default=1.0))
            p_real.add_metric([f.job, cat], max((i.p_real for i in mine), default=0.0))
    yield from (open_, factor, p_real, each, each_p_real)


def _health_families(figures: list[JobFigures]) -> Iterator[Metric]:
    states = GaugeMetricFamily("resihp_ranks", "Ranks by the detector's state.", labels=["job", "state"])
    hist = GaugeHistogramMetricFamily("resihp_rank_slowdown_factor", "Live ranks by estimated slowdown factor "
                                      "(1 is healthy).", labels=["job"])
    slow = GaugeMetricFamily("resihp_slow_rank_factor", "Estimated slowdown of each rank the detector calls slow "
                             "(at most 256 per job).", labels=["job", "rank"])
    for f in figures:
        for state, n in sorted(f.ranks_by_state.items()):
            states.add_metric([f.job, state], n)
        if f.ranks_by_state:
            buckets = [(_le(b), float(n)) for b, n in zip(FACTOR_BUCKETS, f.factor_buckets)]
            hist.add_metric([f.job], buckets, f.factor_sum)
        for rank, factor in sorted(f.slow_ranks.items()):
            slow.add_metric([f.job, str(rank)], factor)
    yield from (states, hist, slow)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class ApprovalCollector(Collector):
    """The engine's figures: plans waiting for an operator's decision, and the oldest one's age.
    ``waiting()`` returns ``(job, [age in seconds of each waiting plan])``."""

    def __init__(self, waiting: Callable[[], tuple[str, list[float]]]) -> None:
        self._waiting = waiting

    def jobs(self) -> list[str]:
        return [self._waiting()[0]]

    def for_job(self, job: str) -> ApprovalCollector:
        return self

    def collect(self) -> Iterator[Metric]:
        job, ages = self._waiting()
        count = GaugeMetricFamily("resihp_plans_awaiting_approval", "Proposed plans waiting for an operator's "
                                  "decision.", labels=["job"])
        count.add_metric([job], len(ages))
        age = GaugeMetricFamily("resihp_plan_approval_wait_seconds", "How long the oldest waiting plan has waited "
                                "(0 when none waits).", labels=["job"])
        age.add_metric([job], max(ages, default=0.0))
        yield from (count, age)


def consumer_lag(bus: Bus, group: str, positions: Mapping[TopicPartition, int]) -> dict[tuple[str, str], int]:
    """Records behind the end of each topic the consumer reads (summed over its partitions)."""
    ends = bus.end_offsets(sorted({tp.topic for tp in positions}))
    lag: dict[tuple[str, str], int] = {}
    for tp, pos in positions.items():
        lag[(group, tp.topic)] = lag.get((group, tp.topic), 0) + max(ends.get(tp, pos) - pos, 0)
    return lag


class MetricsServer:
    """A loopback HTTP server for one collector, in a daemon thread. ``port=0`` picks a free port."""

    def __init__(self, collector: AnalyticsCollector | ApprovalCollector, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.collector = collector
        self.host = host
        handler = _handler(collector)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise OSError(f"cannot serve /metrics on {host}:{port} ({exc.strerror}): another process holds the port; "
                          "pass another --metrics-port (0 picks a free one)") from exc
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(collector: AnalyticsCollector | ApprovalCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            url = urlsplit(self.path)
            job: str | None = parse_qs(url.query).get("job", [None])[0]
            path = url.path.rstrip("/")
            if path.startswith("/metrics/job/"):
                job = unquote(path[len("/metrics/job/"):])
            elif path != "/metrics":
                return self._reply(404, b"not found: this server serves /metrics and /metrics/job/NAME\n")
            if job is None:
                return self._reply(200, generate_latest(collector), CONTENT_TYPE_LATEST)
            known = collector.jobs()
            if job not in known:
                return self._reply(404, f"unknown job {job!r}; this process knows {', '.join(known) or 'no job yet'}"
                                        "\n".encode())
            return self._reply(200, generate_latest(collector.for_job(job)), CONTENT_TYPE_LATEST)

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # http.server's signature
            return  # one line per scrape would drown the consumer's log

    return Handler
