"""torchtitan remediated by a restart: tokens/s healthy, slowed and after, and the pause's phases.

Runs ``resihp demo --trainer torchtitan`` (torchtitan's own ``torchtitan.train`` on CPU ranks under
``resihp run``, the analytics consumer, the engine with auto-apply; a slow device from a set step)
and reads its log: the job's tokens/s before the fault, while it lasts and after the plan is
applied (the demo's own measure, from ``telemetry.summary``), the share of the loss won back, and
each restart's pause with its phases as the node agent reported them (``telemetry.reshape_phase``:
stop agreed and checkpoint saved, old ranks gone, new world started, loaded and stepped).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long", action="store_true", help="the demo's long story (default: --short)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the run goes (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from collector import topics
    from collector.embedded import EmbeddedBus
    from collector.events import AckStatus, CommandAck, ReshapePhase
    from collector.stream import EventStream
    from resihp.demo.run import DemoOptions, run_demo

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="resihp-bench-torchtitan-")) / "run"
    code = run_demo(DemoOptions(workload="torch", trainer="torchtitan", headless=True, short=not args.long,
                                workdir=workdir, timeout_s=900))
    summary = json.loads((workdir / "summary.json").read_text())
    with EmbeddedBus(workdir / "bus.sqlite") as bus:
        stream = EventStream(bus, "bench", [topics.CONTROL, topics.TELEMETRY], on_assign=lambda ps: {tp: 0 for tp in ps})
        events = []
        while batch := stream.poll(timeout_s=0.2):
            events += [d.event.payload for d in batch]
        stream.close()
    acks = [e for e in events if isinstance(e, CommandAck) and e.status == AckStatus.APPLIED]
    phases = [e for e in events if isinstance(e, ReshapePhase) and e.executor == "torchtitan"]
    tps = summary["tokens_per_s"]
    before, during, after = tps["before"], tps["during"], tps["after"]
    won = (after - during) / (before - during) if None not in (before, during, after) and before > during else None
    print(f"\ntorchtitan under resihp run: {summary['gpus']} CPU ranks ({summary['layout']}), "
          f"{'complete' if summary['complete'] else 'INCOMPLETE'}")
    print(f"{'tokens/s':<24}{'healthy':>10}{'slowed':>10}{'after':>10}{'won back':>10}")
    print(f"{'':<24}{_f(before):>10}{_f(during):>10}{_f(after):>10}{_f(won, pct=True):>10}")
    print(f"\n{'restart (epoch)':<18}{'pause s':>9}  phases (s)")
    for ack in acks:
        mine = [p for p in phases if p.epoch == ack.epoch]
        print(f"{ack.epoch:<18}{ack.pause_s:>9.2f}  " + ", ".join(f"{p.phase} {p.duration_s:.2f}" for p in mine))
    if args.json:
        print(json.dumps({"summary": summary, "won_back": won,
                          "restarts": [{"epoch": a.epoch, "pause_s": a.pause_s, "detail": a.detail,
                                        "phases_s": {p.phase: p.duration_s for p in phases if p.epoch == a.epoch}}
                                       for a in acks]}))
    return code


def _f(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f} %" if pct else f"{value:,.0f}"
