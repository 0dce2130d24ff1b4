"""Sharded analytics against the single process, per dialect: do 1 and N shards raise its incidents?

Each case of the detection suite (bench/detect.py: the same scenarios and faults) is simulated in a
dialect and judged three ways from the same events: by the single process (``Detector``) and by 1
and N shards with the merge, in process (``analytics.sharding.in_process.run_sharded``, wired as the bus
wires them). A case is the same when the merge opened the single process's incidents: same
iterations, targets, ranks and replicas. Probes are not answered (neither side gets answers), so
what is compared is what each opens from telemetry alone.
"""

from __future__ import annotations

import argparse
import json
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dialect", action="append", default=None, metavar="NAME",
                        help="ours, megatron, profiler, sampled or all (default all); repeat for several")
    parser.add_argument("--iterations", type=int, default=80, help="iterations per case")
    parser.add_argument("--shards", type=int, default=3, help="N, the larger shard count (1 is always run)")


def _opened(out: list) -> list[tuple]:
    from collector.events import IncidentOpened

    return [(p.iteration, p.locations[0].target, p.locations[0].rank, p.locations[0].replica)
            for p in out if isinstance(p, IncidentOpened)]


def run(args: argparse.Namespace) -> int:
    from analytics.detection.detector import Detector
    from analytics.detection.config import DetectorConfig
    from analytics.sharding.in_process import run_sharded
    from bench.detect import case_engine, dialects_of, suite

    dialects = dialects_of(args.dialect or ["all"])
    counts = (1, args.shards)
    t0 = time.perf_counter()
    result: dict[str, dict] = {}
    for dialect in dialects:
        same = dict.fromkeys(counts, 0)
        differ: list[tuple[str, int, list, list]] = []
        cases = suite(args.iterations)
        for case in cases:
            engine, target = case_engine(case, dialect)
            events = []
            while engine.iteration < target and not engine.finished:
                events += [e for e in engine.step() if not e.kind.startswith("truth")]
            job = engine.config.job
            det = Detector(job, DetectorConfig())
            single = _opened([p for e in events for p in det.on_event(e)] + det.flush())
            for n in counts:
                merged = _opened(run_sharded(events, n, job=job)[1])
                if merged == single:
                    same[n] += 1
                else:
                    differ.append((case.name, n, single, merged))
        print(f"\n== dialect: {dialect} ==  cases the merge judged as the single process: "
              + ", ".join(f"{n} shard(s) {same[n]} of {len(cases)}" for n in counts))
        for name, n, single, merged in differ:
            print(f"  {name:34} {n} shard(s): single {single}  merged {merged}")
        result[dialect] = {"cases": len(cases), **{f"same_{n}": same[n] for n in counts},
                           "differ": [[name, n] for name, n, _, _ in differ]}
    print(f"\n{len(dialects)} dialect(s) in {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps(result))
    return 0
