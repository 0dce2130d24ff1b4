"""The analytics consumer's loops: what ``resihp analytics`` runs once its flags are read.

``run_consumer`` (``--role all``) keeps the DuckDB projections of the log exactly once and runs the
detector inside the same transactions. Around each step: the leases say whether this consumer
publishes (a second one on the bus defers, analytics/service/lease.py, and its outbox is discarded), the
outage guard suspends fail-stop judgement through a broker outage (analytics/service/bus_outage.py), the
outbox is flushed, and ``/metrics`` refreshed. It never exits on a broker outage: the bus client
retries with back-off, each said in a JSON line on stderr.

``run_role`` (``--role shard`` or ``merge``) runs one shard or the merge of sharded analytics; they
keep no DuckDB tables (docs/analytics-scaling.md).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from analytics.service.bus_outage import OutageGuard
from analytics.projections.control_tables import ControlProjection
from analytics.detection.config import DetectorConfig
from analytics.projections.detector_projection import DetectorProjection
from analytics.projections.event_log import EventLogProjection
from analytics.projections.goodput_projection import GoodputProjection
from analytics.service.lease import AnalyticsLeases
from analytics.service.stopping import StopRequest
from analytics.projections.projector import Projection, Projector
from analytics.projections.tables import TelemetryProjection
from collector import topics
from collector.auth import Gate
from collector.bus import Bus

TOPICS = [topics.TELEMETRY, topics.ANALYTICS, topics.CONTROL]


@dataclass(frozen=True)
class ConsumerOptions:
    """How the consumer runs (``resihp analytics --help`` words each)."""

    db: str
    group: str = "analytics"
    instance_id: str | None = None
    rebuild: bool = False
    batch: int = 20_000
    exit_when_idle_s: float | None = None  # None: run until interrupted
    detect: bool = True
    detector_config: str | None = None  # a YAML file (docs/detector.md)
    metrics_port: int | None = None
    log_batches: bool = False


def run_consumer(bus: Bus, opts: ConsumerOptions) -> int:
    """Project the log into DuckDB and run the detector until idle for ``exit_when_idle_s``."""
    goodput = GoodputProjection()
    projections: list[Projection] = [EventLogProjection(), TelemetryProjection(), ControlProjection(), goodput]
    detector = None
    leases = AnalyticsLeases(db=str(opts.db))
    if opts.detect:
        detector = DetectorProjection(opts.detector_config)
        projections += [detector, leases]
    projector = Projector(
        bus, opts.db, opts.group, TOPICS, projections, rebuild=opts.rebuild, instance_id=opts.instance_id,
        gate=Gate("analytics"), on_rejected=detector.enqueue if detector is not None else None,
    )
    outage = OutageGuard(bus, projector.stream.consumer, TOPICS)
    exporter = None
    stop = StopRequest().install()  # SIGINT: stop at the next step, everything read committed
    try:
        if opts.metrics_port is not None:
            from analytics.service.metrics_exporter import AnalyticsExporter

            exporter = AnalyticsExporter(goodput, bus, projector.stream, port=opts.metrics_port)
            exporter.announce()
        if detector is not None:
            detector.flush_outbox(projector.conn, bus)  # what a crash left unpublished
        idle_since = time.monotonic()
        while not stop.requested:
            consumed = projector.step(max_records=opts.batch)
            if detector is not None:
                _publish(detector, leases, outage, projector, bus, consumed)
            if exporter is not None:
                exporter.refresh(changed=bool(consumed))
            if consumed:
                idle_since = time.monotonic()
                if opts.log_batches:
                    print(json.dumps({"event": "batch", "records": consumed,
                                      "transactions": projector.transactions}), file=sys.stderr, flush=True)
            elif not projector.stream.consumer.positions():
                idle_since = time.monotonic()  # not assigned any partition yet (a Kafka rebalance): not idle
            elif opts.exit_when_idle_s is not None and time.monotonic() - idle_since >= opts.exit_when_idle_s:
                break
    finally:
        stop.restore()
        if detector is not None:
            _release(leases, bus)
        if exporter is not None:
            exporter.close()
        projector.close()
    return stop.exit_code()


def _publish(detector: DetectorProjection, leases: AnalyticsLeases, outage: OutageGuard, projector: Projector,
             bus: Bus, consumed: int) -> None:
    """After a step: renew the lease, let the outage guard judge the bus, and publish the outbox
    if this consumer holds the bus (a second consumer on it discards its own: the first publishes)."""
    speaks = leases.tick(bus)
    outage.after_step(consumed, {job: d.fail_stop for job, d in detector.detectors.items()}, speaks)
    if speaks:
        detector.flush_outbox(projector.conn, bus)
    else:
        detector.discard_outbox(projector.conn)


def _release(leases: AnalyticsLeases, bus: Bus) -> None:
    try:
        leases.release(bus)
    except Exception as exc:  # noqa: BLE001 - the bus may be gone; the lease then expires
        print(json.dumps({"event": "analytics_lease_not_released", "why": repr(exc)[:200]}),
              file=sys.stderr, flush=True)


def run_role(bus: Bus, role: str, opts: ConsumerOptions, config: DetectorConfig, job: str | None = None) -> int:
    """One shard (``role`` "shard", folding ``job``'s replicas) or the merge ("merge") until idle."""
    from analytics.sharding.merge import MergeWorker
    from analytics.sharding.shards import ShardWorker

    worker: ShardWorker | MergeWorker
    if role == "shard":
        assert job is not None, "a shard folds one job's replicas"
        worker = ShardWorker(bus, job, opts.group, name=opts.instance_id or "", instance_id=opts.instance_id,
                             config=config)
    else:
        worker = MergeWorker(bus, opts.group, config)
    idle_since = time.monotonic()
    try:
        with StopRequest() as stop:
            while not stop.requested:
                if worker.step(max_records=opts.batch):
                    idle_since = time.monotonic()
                elif opts.exit_when_idle_s is not None and time.monotonic() - idle_since >= opts.exit_when_idle_s:
                    break
    finally:
        worker.close()
    return stop.exit_code()
