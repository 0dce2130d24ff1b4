"""``resihp detect TRACE [--out FILE]``: run the detector offline over a trace and write the
incidents it would raise (opened / confirmed / updated / resolved events) as JSON lines."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detect", help="run the detector over a trace; write its incidents as JSON lines",
                       description=__doc__)
    p.add_argument("trace", help="a trace file or directory (resihp simulate --out, or recorded)")
    p.add_argument("--out", default="-", help="JSON-lines output file (default: stdout)")
    p.add_argument("--detector-config", default=None, metavar="YAML", help="detector settings (docs/detector.md)")
    p.add_argument("--all", action="store_true",
                   help="also write predictions and rank health, not only incident events")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from analytics.detector_config import DetectorConfig
    from analytics.offline import detect_events
    from collector.codec import encode
    from collector.trace import TraceReader

    config = DetectorConfig.load(args.detector_config)
    reader = TraceReader(args.trace)
    out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")  # noqa: SIM115
    n = 0
    try:
        for event in detect_events(reader.events(), config, kinds_prefix=("",) if args.all else ("incident.",)):
            out.write(encode(event) + b"\n")
            n += 1
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    print(f"{n} events from {args.trace}", file=sys.stderr)
    return 0
