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
    parser.add_argument("--steps", type=int, default=300, help="steps of the adapter-cost measurement")
    parser.add_argument("--layout", choices=["replicas", "fsdp", "pp"], default="replicas",
                        help="the job's four ranks as DDP-style replicas, FSDP2 shards or two pipelines of two stages")


DEMO_TOKENS_PER_RANK = 256  # the demo's torchtitan story: one sample of 256 tokens per rank and step


def adapter_cost(steps: int, microbatches: int = 1, batch: int = 1, seq_len: int = 256) -> dict[str, float]:
    """What the adapter adds to a rank's training thread per step, in seconds: the documents'
    lengths from ``positions``, the micro-batch's record, two chunks, the step's report queued (the
    publisher thread encodes and writes it off the training thread; its encoding is measured apart,
    ``encode_s``, as CPU it takes from the same host). The torchtitan step's own work is not in it."""
    import time

    import numpy as np
    import torch

    from collector.events import Coords, Envelope
    from trainer.data import MicroBatch
    from trainer.integration import ResiHPReporter
    from trainer.torchtitan.assets import CorpusSpec, documents
    from trainer.torchtitan.data import PackedStream
    from trainer.torchtitan.telemetry import document_lengths

    docs = [[1 + (hash(w) % 500) for w in d.split()] for d in documents(CorpusSpec(documents=200))]
    stream = PackedStream.from_documents(docs)
    rows = [stream.sample(i, seq_len) for i in range(batch)]
    positions = torch.from_numpy(np.stack([r[1] for r in rows]))
    labels = torch.from_numpy(np.stack([r[2] for r in rows]))
    published: list = []

    class _Queue:  # the reporter's publisher, stopped at its queue: what the training thread pays
        epoch = iteration = 0

        def publish(self, payload: object) -> None:
            published.append(payload)

        def close(self, timeout_s: float = 0.0) -> None:
            return None

    reporter = ResiHPReporter.__new__(ResiHPReporter)
    reporter.job, reporter.rank, reporter.node, reporter.epoch = "bench", 0, None, 0
    reporter.coords = Coords(tp=0, pp=0, dp=0)
    reporter.publisher = _Queue()  # type: ignore[assignment]
    started = time.perf_counter()
    for step in range(steps):
        with reporter.iteration(step) as report:
            for m in range(microbatches):
                lens = document_lengths(positions, labels)
                flat = labels.reshape(-1)
                mb = MicroBatch(iteration=step, index=m, tokens=flat, targets=flat, positions=positions.reshape(-1),
                                seq_lens=lens)
                report.chunk("F", mb.index, duration_s=0.1, tokens=len(mb.tokens), seq_lens=mb.seq_lens, start_s=0.0)
                report.chunk("B", mb.index, duration_s=0.2, tokens=len(mb.tokens), seq_lens=mb.seq_lens, start_s=0.1)
            report.summary(tokens=batch * seq_len, loss=1.0)
    in_loop_s = (time.perf_counter() - started) / steps
    from collector.events import EventFactory

    factory = EventFactory("bench", "rank-0")
    started = time.perf_counter()
    for payload in published:
        Envelope.model_validate(factory.make(payload)).model_dump_json()
    encode_s = (time.perf_counter() - started) / steps
    return {"in_loop_s": in_loop_s, "encode_s": encode_s}


def run(args: argparse.Namespace) -> int:
    from collector import topics
    from collector.embedded import EmbeddedBus
    from collector.events import AckStatus, CommandAck, ReshapePhase
    from collector.stream import EventStream
    from resihp.demo.run import DemoOptions, run_demo

    cost = adapter_cost(args.steps)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="resihp-bench-torchtitan-")) / "run"
    code = run_demo(DemoOptions(workload="torch", trainer="torchtitan", headless=True, short=not args.long,
                                workdir=workdir, timeout_s=900, titan_layout=args.layout))
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
    healthy_step_s = DEMO_TOKENS_PER_RANK * summary["gpus"] / before if before else None
    print(f"\nadapter per step (training thread): {1e6 * cost['in_loop_s']:.0f} µs; encoding off the thread "
          f"{1e6 * cost['encode_s']:.0f} µs" + (f"; {100 * (cost['in_loop_s'] + cost['encode_s']) / healthy_step_s:.2f} % "
                                              f"of a healthy {healthy_step_s:.2f} s step" if healthy_step_s else ""))
    if args.json:
        print(json.dumps({"summary": summary, "won_back": won, "adapter": cost,
                          "restarts": [{"epoch": a.epoch, "pause_s": a.pause_s, "detail": a.detail,
                                        "phases_s": {p.phase: p.duration_s for p in phases if p.epoch == a.epoch}}
                                       for a in acks]}))
    return code


def _f(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f} %" if pct else f"{value:,.0f}"
