"""``resihp analytics``: keep the DuckDB projections of the log, exactly once.

It never exits on a broker outage: the bus client retries with back-off, and fail-stop judgement
is suspended from the outage until this consumer has caught up (analytics/service/bus_outage.py), each
said in a JSON line on stderr. The loops are the service's (analytics/service/consumer.py); this
command reads the flags and calls them."""

from __future__ import annotations

import argparse

from resihp.options import add_bus_flags, bus_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analytics", help="consume the bus into DuckDB tables (exactly-once) and run the detector",
                       description=__doc__)
    add_bus_flags(p)
    p.add_argument("--db", default=".resihp/analytics.duckdb", help="DuckDB file this process owns")
    p.add_argument("--group", default="analytics", help="consumer group")
    p.add_argument("--instance-id", default=None,
                   help="static group membership on Kafka: a restart with the same id resumes at once")
    p.add_argument("--rebuild", action="store_true", help="drop every table and replay the log from the beginning")
    p.add_argument("--batch", type=int, default=20_000, help="most records per transaction")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="stop after this long with nothing new (default: run until interrupted)")
    p.add_argument("--no-detect", action="store_true",
                   help="only keep the tables; do not run the detector or publish analytics events")
    p.add_argument("--detector-config", default=None, metavar="YAML",
                   help="detector settings (thresholds, heartbeat intervals); see docs/detector.md")
    p.add_argument("--role", choices=("all", "shard", "merge"), default="all",
                   help="all: one process judges every job (default); shard: one member of the --group "
                        "consumer group scores its DP replicas into analytics.replica_summary events; merge: "
                        "judges jobs from those summaries and publishes the fits shards predict with "
                        "(docs/analytics-scaling.md)")
    p.add_argument("--job", default=None, help="with --role shard: the job this shard folds")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics (goodput, incidents, lag) on 127.0.0.1:PORT (0: a free port, printed "
                   "on stderr); see docs/metrics.md")
    p.add_argument("--log-batches", action="store_true",
                   help="print one JSON line per committed transaction to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from analytics.service.consumer import ConsumerOptions, run_consumer, run_role

    opts = ConsumerOptions(
        db=args.db, group=args.group, instance_id=args.instance_id, rebuild=args.rebuild, batch=args.batch,
        exit_when_idle_s=args.exit_when_idle, detect=not args.no_detect, detector_config=args.detector_config,
        metrics_port=args.metrics_port, log_batches=args.log_batches)
    if args.role == "all":
        with bus_from_args(args) as bus:
            return run_consumer(bus, opts)
    from analytics.detection.config import DetectorConfig

    if args.role == "shard" and not args.job:
        raise SystemExit("--role shard needs --job JOB: a shard folds one job's replicas")
    config = DetectorConfig.load(args.detector_config)
    with bus_from_args(args) as bus:
        return run_role(bus, args.role, opts, config, args.job)
