"""``resihp analytics``: keep the DuckDB projections of the log, exactly once."""

from __future__ import annotations

import argparse

from resihp.options import add_bus_flags, bus_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analytics", help="consume the bus into DuckDB tables (exactly-once) and run the detector",
                       description=__doc__)
    add_bus_flags(p)
    p.add_argument("--db", default=".resihp/analytics.duckdb", help="DuckDB file this process owns")
    p.add_argument("--group", default="analytics", help="consumer group")
    p.add_argument("--rebuild", action="store_true", help="drop every table and replay the log from the beginning")
    p.add_argument("--batch", type=int, default=20_000, help="most records per transaction")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="stop after this long with nothing new (default: run until interrupted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from analytics.event_log import EventLogProjection
    from analytics.projector import Projector
    from collector import topics

    with bus_from_args(args) as bus:
        projector = Projector(
            bus, args.db, args.group, [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
            [EventLogProjection()], rebuild=args.rebuild,
        )
        try:
            projector.run(idle_exit_s=args.exit_when_idle, max_records=args.batch)
        finally:
            projector.close()
    return 0
