"""Console responsiveness: fold a 1,024-rank job's log and render its pages (Jobs, incident).

Builds a realistic log with the console's test fixture, tests/fixtures/console_demo.py
(TP8·PP8·DP16 by default: 1,024 ranks, hours of predictions,
per-rank telemetry for the last iterations, one incident with a proposed plan), publishes it to a
throw-away embedded bus, then times: the console's fold of the whole log from the beginning, the
incremental fold of one more iteration, building the figures, and a full script run of each page
under Streamlit's AppTest (server-side render; the browser's drawing is not included).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

CONSOLE_DEMO = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "console_demo.py"


def console_demo() -> ModuleType:
    """The console's fake-data generator. It lives with the tests, not in the product, so it is
    loaded from the checkout by path (benchmarks run from a checkout; the installed package has no
    tests/)."""
    if "tests.fixtures.console_demo" in sys.modules:
        return sys.modules["tests.fixtures.console_demo"]
    if not CONSOLE_DEMO.is_file():
        raise SystemExit(f"{CONSOLE_DEMO} not found: run `resihp bench ui` from a checkout of the repository")
    spec = importlib.util.spec_from_file_location("tests.fixtures.console_demo", CONSOLE_DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=3600, help="iterations of predictions (1.5 s each)")
    parser.add_argument("--telemetry-iterations", type=int, default=30, help="last iterations with per-rank telemetry")


def run(args: argparse.Namespace) -> int:
    from collector.embedded import EmbeddedBus
    from collector.events import IterationPrediction
    from ui.auth import Session, User, UsersFile
    from ui.charts import downsample, plan_cells, plan_grid_chart, series_chart, slowdown_figure
    demo = console_demo()
    DemoSpec, demo_events = demo.DemoSpec, demo.demo_events
    from ui.feed import Feed

    rows: list[tuple[str, float, str]] = []
    spec = DemoSpec(job="big", tp=args.tp, pp=args.pp, dp=args.dp, num_layers=4 * args.pp, microbatches_per_replica=4,
                    iterations=args.iterations, telemetry_iterations=args.telemetry_iterations,
                    fault_rank=5, fault_at=args.iterations - args.telemetry_iterations // 2 - 12)
    ranks = args.tp * args.pp * args.dp
    with tempfile.TemporaryDirectory() as tmp:
        bus_path = Path(tmp) / "bus.sqlite"
        t = time.perf_counter()
        events = demo_events(spec)
        rows.append(("generate events", time.perf_counter() - t, f"{len(events):,} events"))
        telemetry = sum(e.kind == "telemetry.iteration" for e in events)
        with EmbeddedBus(bus_path) as bus:
            t = time.perf_counter()
            for i in range(0, len(events), 5000):
                bus.publish(events[i:i + 5000])
            rows.append(("publish to embedded bus", time.perf_counter() - t, ""))
        feed = Feed(lambda: EmbeddedBus(bus_path))
        t = time.perf_counter()
        feed.refresh(budget_s=3600)
        fold_s = time.perf_counter() - t
        rows.append(("fold whole log (cold start)", fold_s,
                     f"{len(events) / fold_s:,.0f} events/s; {telemetry:,} telemetry of {ranks} ranks"))
        job = feed.model.jobs["big"]
        with EmbeddedBus(bus_path) as bus:
            extra = [e for e in events if e.kind == "telemetry.iteration" and e.payload.iteration == spec.iterations - 1]
            from collector.auth import Signer
            from collector.events import EventFactory
            f = Signer(EventFactory("big", "analytics", first_seq=10**6), "analytics")
            bus.publish([e.model_copy(update={"id": e.id[:-4] + "next"}) for e in extra]
                        + [f.make(IterationPrediction(epoch=0, iteration=spec.iterations, observed_s=1.5, predicted_s=1.5, tokens=1))])
        t = time.perf_counter()
        feed.refresh()
        rows.append(("incremental refresh (1 iteration)", time.perf_counter() - t, f"{len(extra) + 1:,} new events"))
        t = time.perf_counter()
        cols = job.predictions.arrays()
        shown = downsample({k: cols[k] for k in ("iteration", "observed_s", "predicted_s", "tokens")})
        series_chart(shown, job.marks, kind="time").to_dict()
        rows.append(("iteration-time chart", time.perf_counter() - t, f"{len(cols['iteration']):,} → {len(shown['iteration'])} points"))
        t = time.perf_counter()
        plan_grid_chart(plan_cells(None, job.layout, job.health), "TP group").to_dict()
        rows.append(("plan grid chart", time.perf_counter() - t, f"{len(job.layout)} cells"))
        t = time.perf_counter()
        its, rank_ids, matrix = job.slowdown(spec.fault_at - 60, spec.fault_at + 60)
        fig = slowdown_figure(its, rank_ids, matrix, suspects={5: spec.fault_factor})
        fig.savefig(os.devnull, format="png")
        rows.append(("slowdown heatmap", time.perf_counter() - t, f"{matrix.shape[0]}×{matrix.shape[1]} cells"))
        feed.close()

        from streamlit.testing.v1 import AppTest

        UsersFile(Path(tmp) / "users.toml").add_user("bench", "operator", "x")
        os.environ.update(RESIHP_EMBEDDED_PATH=str(bus_path), RESIHP_BUS="embedded",
                          RESIHP_UI_USERS=str(Path(tmp) / "users.toml"))
        app = str(Path(__file__).resolve().parent.parent / "ui" / "app.py")
        at = AppTest.from_file(app, default_timeout=600)
        at.session_state["session"] = Session(User("bench", "operator"), 0, 1e12)
        t = time.perf_counter()
        at.run()
        rows.append(("Jobs page, first run (incl. cold fold)", time.perf_counter() - t, ""))
        t = time.perf_counter()
        at.run()
        rows.append(("Jobs page, rerun", time.perf_counter() - t, ""))
        at.sidebar.radio(key="page").set_value("Incidents")
        t = time.perf_counter()
        at.run()
        rows.append(("Incidents list", time.perf_counter() - t, ""))
        at.session_state["incident"] = f"inc-big-{spec.fault_at}"
        t = time.perf_counter()
        at.run()
        rows.append(("incident page (evidence, 2 grids)", time.perf_counter() - t,
                     "ok" if not at.exception else f"exception: {at.exception}"))

    print(f"console responsiveness, {ranks} ranks ({args.tp}·{args.pp}·{args.dp}), {args.iterations:,} iterations")
    print(f"{'step':42s} {'seconds':>9s}  note")
    for name, seconds, note in rows:
        print(f"{name:42s} {seconds:9.3f}  {note}")
    if getattr(args, "json", False):
        print(json.dumps({"ranks": ranks, "iterations": args.iterations, "events": len(events),
                          "steps": {name: round(seconds, 4) for name, seconds, _ in rows}}))
    return 0
