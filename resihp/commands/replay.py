"""``resihp replay TRACE``: stream a recorded trace onto the bus at its original pace (--speed 1),
accelerated (--speed X) or as fast as possible (--speed 0 or inf). Bytes are replayed as recorded."""

from __future__ import annotations

import argparse

from resihp.options import add_bus_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="publish a recorded trace onto the bus", description=__doc__)
    p.add_argument("trace", help="trace file (.parquet) or directory")
    p.add_argument("--speed", type=float, default=1.0,
                   help="1: original pace; X: X times faster; 0 or inf: as fast as possible (default 1)")
    p.add_argument("--send-invalid", action="store_true",
                   help="publish records that no longer decode as recorded (they reach the consumers' dead-letter "
                        "path) instead of refusing the trace")
    add_bus_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from collector.trace import TraceError, TraceReader, replay
    from resihp.options import bus_from_args

    try:  # check the whole trace before the first record is published
        reader = TraceReader(args.trace)
        total = len(reader)
        for _ in (reader.records() if args.send_invalid else reader.events()):
            pass
    except (TraceError, OSError) as exc:
        print(f"resihp replay: error: {exc}", file=sys.stderr)
        return 2
    with bus_from_args(args) as bus:
        sent = replay(args.trace, bus, speed=args.speed)
    print(f"replayed {sent:,} of {total:,} events from {args.trace} onto the {bus.name} bus")
    return 0
