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
    add_bus_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from collector.trace import TraceReader, replay
    from resihp.options import bus_from_args

    total = len(TraceReader(args.trace))
    with bus_from_args(args) as bus:
        sent = replay(args.trace, bus, speed=args.speed)
    print(f"replayed {sent:,} of {total:,} events from {args.trace} onto the {bus.name} bus")
    return 0
