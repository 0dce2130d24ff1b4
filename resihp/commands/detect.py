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
    """A trace that cannot be read ends in one line naming the file and the problem (exit 2); --out
    is written beside itself and renamed into place when complete, so a failed run keeps the old one."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    from analytics.detection.config import DetectorConfig
    from analytics.service.offline import detect_events
    from collector.codec import encode
    from collector.trace import TraceError, TraceReader

    config = DetectorConfig.load(args.detector_config)
    tmp = None
    if args.out == "-":
        out = sys.stdout.buffer
    else:
        target = Path(args.out)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
        out = os.fdopen(fd, "wb")
    n = 0
    try:
        reader = TraceReader(args.trace)
        for event in detect_events(reader.events(), config, kinds_prefix=("",) if args.all else ("incident.",)):
            out.write(encode(event) + b"\n")
            n += 1
    except (TraceError, OSError) as exc:
        if tmp is not None:
            out.close()
            os.unlink(tmp)
        print(f"resihp detect: error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        if tmp is not None:
            out.close()
            os.unlink(tmp)
        raise
    if tmp is not None:
        out.close()
        os.replace(tmp, args.out)
    print(f"{n} events from {args.trace}", file=sys.stderr)
    return 0
