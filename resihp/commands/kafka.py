"""``resihp kafka up | down | status``: the local single-node KRaft broker from infra/."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kafka", help="fetch, start, stop or inspect the local Apache Kafka broker", description=__doc__)
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--port", type=int, default=None, help="client port (default: $RESIHP_KAFKA_PORT or 19092)")
    p.add_argument("--data-dir", default=None, help="broker data directory (default: .kafka/broker)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from infra import broker

    if args.action == "up":
        print(broker.up(port=args.port, data_dir=args.data_dir))
    elif args.action == "down":
        print("stopped" if broker.down(data_dir=args.data_dir) else "no broker was running")
    else:
        state = broker.status(data_dir=args.data_dir)
        print(json.dumps(state, indent=2, default=str))
        return 0 if state.get("running") else 1
    return 0
