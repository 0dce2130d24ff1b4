"""Publishing a simulated job from several processes: ``resihp simulate --publish --publishers N``.

One process cannot put a 100k-rank step on the bus at a live job's pace (a real job has a
machine per eight ranks). ``SplitPublisher`` starts N publisher processes, each with its own bus
producer and its own engine of the same scenario and seed (the simulator is deterministic, so
every engine computes the same job), and steps them in lock-step with the parent's engine. Each
publisher writes only the telemetry of its share of the replicas (``replica_shares``), through a
``RankWire`` (trainer/sim/wire.py); the parent publishes the job's own events (plans, tracing
declarations, truth, iteration summaries) and paces the run.

Why split by replica: the analytics consumers need a replica's reports, and its ranks'
heartbeats, in one partition and in order (docs/analytics-scaling.md). A publisher owns whole
replicas, keys their records ``job/replica-D`` as a single producer does, and so writes each
replica's records in the order one engine emits them; records of different replicas were never
ordered against each other. Heartbeats of ranks no replica holds (spares, devices a restart left
out) go with publisher 0. Per step the parent publishes what comes before the ranks' records
(a new plan, its tracing declaration, fault truth), lets every publisher write its share, and
publishes the iteration's summary after all of them: an analytics consumer meets the plan before
the reports it explains, as from one producer.

Every record is the one a single process publishes, with the same id, key and bytes
(tests/test_sim_publishers.py reads both back as sets). Open loop only: the closed loop's
commands and probes change the job mid-run, and the publishers could not follow them; a trace
(``--out``) is written from events, in one process.

Children never outlive the parent: each asks the kernel to kill it when the parent dies
(trainer/agent/child.py's ``die_with_parent``), and ``close`` (also on any exception, and from
``with``) stops them, killing one that does not stop within ``stop_timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from collector.bus import Bus, open_bus
from collector.events import Envelope
from collector.plan import Plan
from trainer.sim.engine import SimConfig, SimEngine
from trainer.sim.faults import FaultSpec
from trainer.sim.runner import Pacer, run_finished
from trainer.sim.wire import RankWire


def replica_shares(plan: Plan, publishers: int) -> list[list[int]]:
    """Which replicas each of ``publishers`` publishes: contiguous runs in plan order, balanced
    by rank count (a replica goes to the publisher its middle rank falls to). Every replica is in
    exactly one share; a share is empty only when there are more publishers than replicas."""
    if publishers < 1:
        raise ValueError(f"publishers must be at least 1, not {publishers}")
    sizes = [sum(len(st.devices) for st in pipe.stages) for pipe in plan.pipelines]
    total = sum(sizes)
    shares: list[list[int]] = [[] for _ in range(publishers)]
    before = 0
    for replica, size in enumerate(sizes):
        shares[min(publishers - 1, (2 * before + size) * publishers // (2 * total))].append(replica)
        before += size
    return shares


@dataclass(frozen=True)
class BusSpec:
    """How a publisher process opens its own producer: ``open_bus``'s arguments (None: the
    environment's), and a Kafka topic prefix (None: the environment's)."""

    backend: str | None = None
    path: str | None = None
    bootstrap: str | None = None
    namespace: str | None = None

    def open(self) -> Bus:
        if self.namespace is not None:
            from collector.kafka_bus import KafkaBus

            return KafkaBus(self.bootstrap or "", namespace=self.namespace)
        return open_bus(self.backend, path=self.path, bootstrap=self.bootstrap)


def share_of(index: int, publishers: int) -> Callable[[Plan], list[int]]:
    """The replicas publisher ``index`` of ``publishers`` owns under a plan."""
    return lambda plan: replica_shares(plan, publishers)[index]


def _publisher(config: SimConfig, faults: list[FaultSpec], bus_spec: BusSpec, index: int, publishers: int,
               flush_records: int, conn: Connection, parent: int) -> None:
    """A publisher process: its engine steps when the parent says so and writes its share."""
    from collector.gc_policy import tune_for_streaming
    from trainer.agent.child import die_with_parent

    die_with_parent(parent)
    tune_for_streaming()
    try:
        bus = bus_spec.open()
        engine = SimEngine(config, faults)
        engine.rank_wire = RankWire(engine, share_of(index, publishers), spare_heartbeats=index == 0,
                                    sink=bus.publish_raw, flush_records=flush_records)
        conn.send(("ready", 0))
        while conn.recv() == "step":
            written = 0

            def sink(records: list) -> None:
                nonlocal written
                bus.publish_raw(records)
                written += len(records)

            engine.rank_wire.sink = sink
            engine.step()  # the job's own events are the parent's to publish
            sink(engine.rank_wire.take())
            conn.send(("done", written))
        bus.close()
    except Exception:  # noqa: BLE001 - the parent names the publisher and raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class SplitPublisher:
    """``publishers`` processes publishing the rank telemetry of one simulated job between them,
    stepped by :meth:`step`; the caller's engine (with a wire owning no replica, ``parent_wire``)
    publishes the rest. Use as a context manager, or call :meth:`close`."""

    def __init__(self, config: SimConfig, faults: list[FaultSpec], bus_spec: BusSpec, publishers: int, *,
                 flush_records: int = 10_000, start_timeout_s: float = 300.0, stop_timeout_s: float = 10.0) -> None:
        if publishers < 1:
            raise ValueError(f"publishers must be at least 1, not {publishers}")
        self.stop_timeout_s = stop_timeout_s
        ctx = mp.get_context("spawn")
        self._procs: list = []
        self._conns: list[Connection] = []
        try:
            for i in range(publishers):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_publisher, name=f"resihp-publisher-{i}", daemon=True,
                                args=(config, faults, bus_spec, i, publishers, flush_records, theirs, os.getpid()))
                p.start()
                theirs.close()
                self._procs.append(p)
                self._conns.append(mine)
            self._collect(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout_s: float | None = None) -> int:
        """Every publisher's answer to the last order: the records they wrote."""
        total = 0
        for i, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise TimeoutError(f"publisher {i} did not answer in {timeout_s:g} s")
            try:
                what, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"publisher {i} exited (code {self._procs[i].exitcode}) without answering") from None
            if what == "error":
                raise RuntimeError(f"publisher {i} failed:\n{value}")
            total += int(value)
        return total

    def step(self) -> int:
        """Every publisher steps its engine once and writes its share; returns the records written."""
        for conn in self._conns:
            conn.send("step")
        return self._collect()

    def close(self) -> None:
        """Stop every publisher; one that does not stop within ``stop_timeout_s`` is killed."""
        for conn in self._conns:
            try:
                conn.send("stop")
            except OSError:
                pass  # it has gone already
        for p in self._procs:
            p.join(self.stop_timeout_s)
            if p.exitcode is None:
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> SplitPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parent_wire(engine: SimEngine) -> RankWire:
    """The parent's wire: it owns no replica, so its engine's steps are the job's own events."""
    return RankWire(engine, lambda plan: [])


def whole_job_wire(engine: SimEngine) -> RankWire:
    """One process's wire: every replica and every rank's heartbeats."""
    return RankWire(engine, lambda plan: list(range(len(plan.pipelines))), spare_heartbeats=True)


def run_split_open_loop(engine: SimEngine, bus: Bus, publishers: SplitPublisher | None, *,
                        iterations: int | None = None, duration_s: float | None = None,
                        progress: Callable[[int], None] | None = None, max_hang_s: float = 3600.0,
                        pacer: Pacer | None = None) -> int:
    """``run_open_loop`` with the ranks' records written by a wire: ``engine.rank_wire`` (owning
    every replica, publishers None: one process) or ``publishers`` (the engine's wire owning none,
    ``parent_wire``). Per step: the job's events before the iteration's records, the records,
    then the iteration's summary. Returns the number of records published."""
    if iterations is None and duration_s is None:
        raise ValueError("give iterations or duration_s, or the simulation never ends")
    wire = engine.rank_wire
    if wire is None:
        raise ValueError("install a RankWire on the engine (engine.rank_wire) first")
    start, total = engine.iteration, 0
    while not run_finished(engine, start, iterations, duration_s, max_hang_s):
        before_it = engine.iteration
        events = engine.step()
        first: list[Envelope] = [e for e in events if e.kind != "telemetry.summary"]
        after = [e for e in events if e.kind == "telemetry.summary"]  # the engine's last event of a step
        if first:
            total += bus.publish(first)
        if publishers is not None:
            total += publishers.step()
        else:
            records = wire.take()
            if records:
                bus.publish_raw(records)
                total += len(records)
        if after:
            total += bus.publish(after)
        if progress is not None and engine.iteration != before_it:
            progress(engine.iteration - before_it)
        if pacer is not None:
            pacer.wait()
    return total
