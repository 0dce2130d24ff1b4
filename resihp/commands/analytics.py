"""``resihp analytics``: keep the DuckDB projections of the log, exactly once.

It never exits on a broker outage: the bus client retries with back-off, and fail-stop judgement
is suspended from the outage until this consumer has caught up (analytics/bus_outage.py), each
said in a JSON line on stderr."""

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
    import json
    import sys
    import time

    from analytics.bus_outage import OutageGuard
    from analytics.control_tables import ControlProjection
    from analytics.event_log import EventLogProjection
    from analytics.lease import AnalyticsLeases
    from analytics.projector import Projection, Projector
    from analytics.tables import TelemetryProjection
    from collector import topics
    from collector.auth import Gate

    if args.role != "all":
        return _run_sharded(args)
    with bus_from_args(args) as bus:
        from analytics.goodput_projection import GoodputProjection

        goodput = GoodputProjection()
        projections: list[Projection] = [EventLogProjection(), TelemetryProjection(), ControlProjection(), goodput]
        detector = None
        leases = AnalyticsLeases(db=str(args.db))
        if not args.no_detect:
            from analytics.detector_projection import DetectorProjection

            detector = DetectorProjection(args.detector_config)
            projections += [detector, leases]
        projector = Projector(
            bus, args.db, args.group, [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL],
            projections, rebuild=args.rebuild, instance_id=args.instance_id,
            gate=Gate("analytics"), on_rejected=detector.enqueue if detector is not None else None,
        )
        outage = OutageGuard(bus, projector.stream.consumer, [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL])
        exporter = None
        try:
            if args.metrics_port is not None:
                from analytics.metrics_exporter import AnalyticsExporter

                exporter = AnalyticsExporter(goodput, bus, projector.stream, port=args.metrics_port)
                exporter.announce()
            if detector is not None:
                detector.flush_outbox(projector.conn, bus)  # what a crash left unpublished
            idle_since = time.monotonic()
            while True:
                consumed = projector.step(max_records=args.batch)
                if detector is not None:
                    speaks = leases.tick(bus)
                    outage.after_step(consumed, {job: d.fail_stop for job, d in detector.detectors.items()}, speaks)
                    if speaks:
                        detector.flush_outbox(projector.conn, bus)
                    else:  # a second consumer on this bus: the first one publishes (analytics/lease.py)
                        projector.conn.execute("DELETE FROM detector_outbox")
                if exporter is not None:
                    exporter.refresh(changed=bool(consumed))
                if consumed:
                    idle_since = time.monotonic()
                    if args.log_batches:
                        print(json.dumps({"event": "batch", "records": consumed,
                                          "transactions": projector.transactions}), file=sys.stderr, flush=True)
                elif not projector.stream.consumer.positions():
                    idle_since = time.monotonic()  # not assigned any partition yet (a Kafka rebalance): not idle
                elif args.exit_when_idle is not None and time.monotonic() - idle_since >= args.exit_when_idle:
                    break
        finally:
            if detector is not None:
                try:
                    leases.release(bus)
                except Exception as exc:  # noqa: BLE001 - the bus may be gone; the lease then expires
                    print(json.dumps({"event": "analytics_lease_not_released", "why": repr(exc)[:200]}),
                          file=sys.stderr, flush=True)
            if exporter is not None:
                exporter.close()
            projector.close()
    return 0


def _run_sharded(args: argparse.Namespace) -> int:
    """One shard or the merge of sharded analytics (no DuckDB tables: the all-in-one role keeps them)."""
    import time

    from analytics.detector_config import DetectorConfig
    from analytics.merge import MergeWorker
    from analytics.shards import ShardWorker

    if args.role == "shard" and not args.job:
        raise SystemExit("--role shard needs --job JOB: a shard folds one job's replicas")
    config = DetectorConfig.load(args.detector_config)
    with bus_from_args(args) as bus:
        worker: ShardWorker | MergeWorker
        if args.role == "shard":
            worker = ShardWorker(bus, args.job, args.group, name=args.instance_id or "", instance_id=args.instance_id,
                                 config=config)
        else:
            worker = MergeWorker(bus, args.group, config)
        idle_since = time.monotonic()
        try:
            while True:
                if worker.step(max_records=args.batch):
                    idle_since = time.monotonic()
                elif args.exit_when_idle is not None and time.monotonic() - idle_since >= args.exit_when_idle:
                    break
        finally:
            worker.close()
    return 0
