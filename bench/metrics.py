"""Metrics: one /metrics scrape of a 100k-rank job (time, bytes), and goodput against ground truth.

Scrape: a synthetic job of --ranks ranks (a rank-health view of every rank, a few slow and dead,
open fail-slow and fail-stop incidents, a history of iterations whose newest prediction has the
most per-stage rows /metrics serves) is folded by the analytics
consumer's goodput projection; the table gives the time to take the snapshot the consumer takes
after each transaction, and the time and size of one HTTP scrape of /metrics (median of --scrapes)
over loopback. Goals: ≤ 100 ms and ≤ 5 MB.

Goodput: each case of the fault suite runs in the closed loop (resihp/closed_loop.py: simulator,
analytics with the detector, the engine under auto-apply) with the goodput fold reading the bus;
truth is the simulator's own (bench/_goodput_truth.py: the twin engine's healthy durations of the
iterations that ran). Goal: the fold within 1 % (one ratio point) of truth on every case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

SUITE = ("healthy", "slow_x1.5", "slow_x2", "slow_x4", "slow_link_x4", "stop_gpu", "stop_node", "cascading")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=100_000, help="ranks of the synthetic job (default 100,000)")
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes to time (default 20)")
    parser.add_argument("--cases", default=",".join(SUITE), help=f"goodput cases (default: {','.join(SUITE)}; "
                        "'none' skips the goodput part)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="simulated seconds per goodput case (default 20)")


def _synthetic_projection(ranks: int, iterations: int = 2000):
    from analytics.projections.goodput_projection import GoodputProjection
    from collector.auth import Signer
    from collector.events import (
        EventFactory, Evidence, FaultCategory, IncidentOpened, IterationPrediction, IterationSummary, Location,
        RankHealth, RankHealthEntry, RankState, Severity, StageTime,
    )
    from analytics.detection.prediction import MAX_STAGE_ROWS

    job, t = "big-job", 1_700_000_000.0
    proj = GoodputProjection()
    launcher, analytics = EventFactory(job, "launcher"), Signer(EventFactory(job, "analytics"), "analytics")
    # the newest prediction carries the most stage rows /metrics serves (MAX_STAGE_ROWS: 16 stages × 16 replicas)
    stages = [StageTime(replica=r, stage=st, observed_s=0.6, predicted_s=0.59) for r in range(16) for st in range(16)]
    assert len(stages) == MAX_STAGE_ROWS
    for k in range(iterations):
        t += 10.0
        proj.fold.apply(launcher.make(IterationSummary(epoch=0, iteration=k, tokens=4_000_000, wall_s=10.0), time_s=t))
        proj.fold.apply(analytics.make(IterationPrediction(epoch=0, iteration=k, observed_s=10.0, predicted_s=9.9,
                                                           tokens=4_000_000, stages=stages), time_s=t))
    slow = {r: 1.5 + (r % 7) / 10 for r in range(0, 64)}
    dead = set(range(64, 72))
    entries = [RankHealthEntry.model_construct(rank=r, state=RankState.DEAD if r in dead else RankState.SLOW if r in slow else
                               RankState.HEALTHY, factor=1e6 if r in dead else slow.get(r, 1.0 + (r % 13) / 200))
               for r in range(ranks)]
    health = analytics.make(RankHealth.model_construct(epoch=0, iteration=2000, ranks=entries), time_s=t)
    incidents = [analytics.make(IncidentOpened(
        incident_id=f"inc-{i}", category=FaultCategory.FAIL_SLOW if i < 8 else FaultCategory.FAIL_STOP,
        severity=Severity.HIGH, iteration=2000,
        locations=[Location(target="compute", rank=i * 8, tp_group=tuple(range(i * 8, i * 8 + 8)), factor=1.8,
                            confidence=0.9)], evidence=Evidence(), summary="synthetic"), time_s=t) for i in range(9)]
    import duckdb

    from collector.stream import Delivery

    with duckdb.connect() as conn:  # the projection's own table, in memory: only its fold is measured
        proj.create(conn)
        proj.apply(conn, [Delivery("t", 0, i, e) for i, e in enumerate([health, *incidents])])
    return proj


def _scrape_figures(ranks: int, scrapes: int) -> dict:
    from analytics.service.metrics import AnalyticsCollector, AnalyticsSnapshot, MetricsServer

    proj = _synthetic_projection(ranks)
    snaps = []
    for _ in range(scrapes):
        t0 = time.perf_counter()
        snap = AnalyticsSnapshot(jobs=proj.snapshot(), lag={("analytics", "resihp.telemetry"): 0}, dead_letters={})
        snaps.append(time.perf_counter() - t0)
    server = MetricsServer(AnalyticsCollector(lambda: snap)).start()
    times, size, series = [], 0, 0
    try:
        for _ in range(scrapes):
            t0 = time.perf_counter()
            with urllib.request.urlopen(server.url, timeout=10) as r:
                body = r.read()
            times.append(time.perf_counter() - t0)
            size = len(body)
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    finally:
        server.close()
    return {"ranks": ranks, "snapshot_ms": 1e3 * statistics.median(snaps), "scrape_ms": 1e3 * statistics.median(times),
            "scrape_p95_ms": 1e3 * sorted(times)[int(0.95 * (len(times) - 1))], "bytes": size, "series": series}


def _case(name: str, duration_s: float):
    from bench._goodput_truth import GoodputCase
    from trainer.fault_spec import FaultSpec

    at, d = duration_s / 5, 5
    faults = {
        "healthy": [],
        "slow_x1.5": [FaultSpec(kind="slow_compute", device=d, factor=1.5, at_s=at)],
        "slow_x2": [FaultSpec(kind="slow_compute", device=d, factor=2.0, at_s=at)],
        "slow_x4": [FaultSpec(kind="slow_compute", device=d, factor=4.0, at_s=at)],
        "slow_link_x4": [FaultSpec(kind="slow_link", link=(d, d + 2), factor=4.0, at_s=at)],
        "stop_gpu": [FaultSpec(kind="stop_device", device=d, at_s=at)],
        "stop_node": [FaultSpec(kind="stop_node", node=1, at_s=at)],
        "cascading": [FaultSpec(kind="slow_compute", device=d, factor=2.0, at_s=at),
                      FaultSpec(kind="stop_device", device=d + 6, at_s=2 * at)],
    }
    if name not in faults:
        raise SystemExit(f"unknown goodput case {name!r}; choose from {', '.join(SUITE)}")
    return GoodputCase(name, tuple(faults[name]), duration_s)


def _config(name: str):
    from collector.plan import Plan
    from trainer.sim.engine import SimConfig
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec

    model = MODEL_PRESETS["tiny"]
    plan = Plan.uniform(tp=2, pp=2, dp=4, num_layers=model.layers, microbatches_per_replica=4)
    return SimConfig(model=model, cluster=ClusterSpec(gpus=16, gpus_per_node=4), plan=plan, job=name, seed=3,
                     reshape_pause_s=0.5, heartbeat_interval_s=1.0)


def run(args: argparse.Namespace) -> int:
    from bench._goodput_truth import run_case

    scrape = _scrape_figures(args.ranks, args.scrapes)
    print(f"\n/metrics of a {scrape['ranks']:,}-rank job: snapshot {scrape['snapshot_ms']:.2f} ms, scrape "
          f"{scrape['scrape_ms']:.2f} ms (p95 {scrape['scrape_p95_ms']:.2f} ms), {scrape['bytes']:,} bytes, "
          f"{scrape['series']} series  (goals: ≤ 100 ms, ≤ 5,000,000 bytes)")
    rows = []
    cases = [] if args.cases == "none" else [c.strip() for c in args.cases.split(",") if c.strip()]
    if cases:
        print(f"\ngoodput, fold against the simulator's truth ({args.duration_s:g} simulated s per case, closed loop)")
        print(f"{'case':14s} {'truth':>7s} {'fold':>7s} {'error':>7s}  loss by cause (s)")
    for name in cases:
        r = run_case(_config(name), _case(name, args.duration_s))
        losses = ", ".join(f"{c} {v:.2f}" for c, v in r.fold.loss_s.items() if v > 0.005)
        print(f"{name:14s} {r.truth_ratio:7.4f} {r.fold.ratio:7.4f} {r.error:+7.4f}  {losses or '-'}", flush=True)
        rows.append({"case": name, "truth": r.truth_ratio, "fold": r.fold.ratio, "error": r.error,
                     "loss_s": r.fold.loss_s, "wall_s": r.fold.wall_s})
    if rows:
        worst = max(abs(r["error"]) for r in rows)
        print(f"worst |error| {worst:.4f} ({sum(abs(r['error']) <= 0.01 for r in rows)}/{len(rows)} cases within 0.01)")
    if args.json:
        print(json.dumps({"scrape": scrape, "goodput": rows}))
    return 0
