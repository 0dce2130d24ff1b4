"""The simulator's split publishing (trainer/sim/publishers.py, trainer/sim/wire.py): the records
that several publishers write between them are exactly the records one process publishes, each
replica's from one producer in one engine's order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from collector import topics
from collector.codec import encode
from collector.embedded import EmbeddedBus
from collector.plan import Plan
from collector.replica_drop import drop_replicas
from collector.topics import PartitionKeys, topics_for
from trainer.sim.engine import SimEngine
from trainer.sim.publishers import (
    BusSpec, SplitPublisher, parent_wire, replica_shares, run_split_open_loop, share_of, whole_job_wire,
)
from trainer.sim.runner import run_open_loop
from trainer.sim.scenario import load_scenario
from trainer.sim.wire import RankWire

Key = tuple[str, bytes | None, bytes]


def _event_records(scenario: str, steps: int, **overrides) -> list[Key]:
    """What one process publishes, built as events and encoded by the bus's own path."""
    sc = load_scenario(scenario)
    engine = SimEngine(sc.sim_config(**overrides), sc.all_faults())
    keys = PartitionKeys()
    out: list[Key] = []
    for _ in range(steps):
        for e in engine.step():
            raw, key = encode(e), keys.key(e.job, e.source, e.kind, e.payload)
            out += [(t, key, raw) for t in topics_for(e.kind)]
    return out


def _split_records(scenario: str, steps: int, publishers: int,
                   **overrides) -> tuple[list[Key], list[list[list[Key]]]]:
    """The parent's records and each publisher's per step, from engines stepped in lock-step in
    this process."""
    sc = load_scenario(scenario)
    parent = SimEngine(sc.sim_config(**overrides), sc.all_faults())
    parent.rank_wire = parent_wire(parent)
    engines = []
    for i in range(publishers):
        e = SimEngine(sc.sim_config(**overrides), sc.all_faults())
        e.rank_wire = RankWire(e, share_of(i, publishers), spare_heartbeats=i == 0)
        engines.append(e)
    keys = PartitionKeys()
    mine: list[Key] = []
    theirs: list[list[list[Key]]] = [[] for _ in engines]
    for _ in range(steps):
        for ev in parent.step():
            mine += [(t, keys.key(ev.job, ev.source, ev.kind, ev.payload), encode(ev)) for t in topics_for(ev.kind)]
        assert parent.rank_wire is not None and not parent.rank_wire.take()
        for i, engine in enumerate(engines):
            engine.step()
            assert engine.rank_wire is not None
            theirs[i].append([tuple(m) for m in engine.rank_wire.take()])  # type: ignore[misc]
    return mine, theirs


def _per_key(records: list[Key]) -> dict[tuple[str, bytes | None], list[bytes]]:
    out: dict[tuple[str, bytes | None], list[bytes]] = {}
    for topic, key, value in records:
        out.setdefault((topic, key), []).append(value)
    return out


# ---- which replicas go to which publisher ----------------------------------------------------


@pytest.mark.parametrize("publishers", [1, 2, 3, 5, 8])
def test_every_replica_goes_to_exactly_one_publisher_in_contiguous_balanced_runs(publishers: int) -> None:
    plan = Plan.uniform(tp=2, pp=4, dp=7, num_layers=32, microbatches_per_replica=8)
    shares = replica_shares(plan, publishers)
    assert len(shares) == publishers
    assert [r for share in shares for r in share] == list(range(7))  # each once, in plan order
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1  # equal replicas: shares differ by one replica at most
    assert all(sizes) or publishers > 7


def test_shares_balance_ranks_when_replicas_differ() -> None:
    plan = Plan.uniform(tp=2, pp=4, dp=6, num_layers=32, microbatches_per_replica=8)
    survivors = drop_replicas(plan, {8, 9})  # replica 1 lost a device: its micro-batches move
    uneven = Plan.model_validate(survivors.model_dump())
    shares = replica_shares(uneven, 2)
    ranks = [sum(len(st.devices) for r in s for st in uneven.pipelines[r].stages) for s in shares]
    assert sorted(r for s in shares for r in s) == list(range(len(uneven.pipelines)))
    assert abs(ranks[0] - ranks[1]) <= max(len(p.stages) * 2 for p in uneven.pipelines)


def test_more_publishers_than_replicas_leaves_some_idle_and_none_is_refused() -> None:
    plan = Plan.uniform(tp=2, pp=2, dp=2, num_layers=32, microbatches_per_replica=4)
    shares = replica_shares(plan, 4)
    assert sorted(r for s in shares for r in s) == [0, 1]
    with pytest.raises(ValueError, match="at least 1"):
        replica_shares(plan, 0)


# ---- the records: the same as one process's -----------------------------------------------------


@pytest.mark.parametrize(("scenario", "steps", "overrides"), [
    ("fail_slow_compute_x2", 30, {}),
    ("fail_stop_gpu", 140, {}),  # a dead rank, a hang on heartbeats, an elastic restart at a new epoch
    ("interleaved_fail_slow", 20, {}),
    ("zero_bubble_healthy", 20, {}),
    ("fail_slow_compute_x2", 12, {"dialect": "megatron"}),  # another dialect goes through its events
    ("fail_slow_compute_x2", 12, {"dialect": "sampled"}),
    ("fail_slow_compute_x2", 25, {"telemetry": [0, 1, 5, 17, 30]}),  # a subset of ranks reports
    ("fail_slow_compute_x2", 25, {"telemetry": "none"}),
])
def test_a_wire_writes_the_records_the_events_encode_to(scenario: str, steps: int, overrides: dict) -> None:
    want = _event_records(scenario, steps, **overrides)
    sc = load_scenario(scenario)
    engine = SimEngine(sc.sim_config(**overrides), sc.all_faults())
    engine.rank_wire = whole_job_wire(engine)
    keys = PartitionKeys()
    got: list[Key] = []
    for _ in range(steps):
        for e in engine.step():
            got += [(t, keys.key(e.job, e.source, e.kind, e.payload), encode(e)) for t in topics_for(e.kind)]
        got += [tuple(m) for m in engine.rank_wire.take()]  # type: ignore[misc]
    assert Counter(got) == Counter(want)  # same records, same ids and sequence numbers, same keys
    assert _per_key(got) == _per_key(want)  # and in the same order under every key


@pytest.mark.parametrize("publishers", [1, 2, 3])
def test_publishers_together_write_the_single_process_records_once_each(publishers: int) -> None:
    want = _event_records("fail_stop_gpu", 140)
    mine, theirs = _split_records("fail_stop_gpu", 140, publishers)
    got = mine + [r for share in theirs for step in share for r in step]
    assert Counter(got) == Counter(want)  # nothing lost, nothing doubled
    # In a step, a key (a replica's records) is written by one publisher; steps are a barrier (the
    # parent waits for every publisher), so the publishers' records, step after step, are the
    # single process's in the order of every key.
    for step in range(140):
        owners: dict[tuple[str, bytes | None], set[int]] = {}
        for i, share in enumerate(theirs):
            for topic, key, _ in share[step]:
                owners.setdefault((topic, key), set()).add(i)
        assert all(len(o) == 1 for o in owners.values()), step
    stepped = [r for step in range(140) for share in theirs for r in share[step]]
    assert _per_key(stepped) == {k: v for k, v in _per_key(want).items() if k in _per_key(stepped)}
    assert not any(k[0] == topics.TELEMETRY and k[1] is not None and b"/replica-" in k[1] for k in _per_key(mine))


def test_a_wire_is_installed_before_the_first_step() -> None:
    sc = load_scenario("fail_slow_compute_x2")
    engine = SimEngine(sc.sim_config(), sc.all_faults())
    engine.step()
    with pytest.raises(ValueError, match="before the engine's first step"):
        engine.rank_wire = whole_job_wire(engine)


# ---- real processes --------------------------------------------------------------------------------


def _read_all(bus: EmbeddedBus) -> list[Key]:
    with bus.consumer("check", list(topics.ALL_TOPICS)) as c:
        out: list[Key] = []
        while batch := c.poll(100_000, 0.2):
            out += [(r.topic, r.key, bytes(r.value)) for r in batch]
    return out


@pytest.mark.processes
def test_two_publisher_processes_on_the_embedded_bus_read_back_as_one_process(tmp_path: Path) -> None:
    sc = load_scenario("fail_slow_compute_x2")
    single = EmbeddedBus(tmp_path / "single.sqlite")

    def publish(events: list) -> None:
        single.publish(events)

    run_open_loop(SimEngine(sc.sim_config(), sc.all_faults()), publish, iterations=8)
    split = EmbeddedBus(tmp_path / "split.sqlite")
    engine = SimEngine(sc.sim_config(), sc.all_faults())
    engine.rank_wire = parent_wire(engine)
    with SplitPublisher(engine.config, sc.all_faults(), BusSpec("embedded", path=str(tmp_path / "split.sqlite")),
                        2, flush_records=50) as publishers:
        total = run_split_open_loop(engine, split, publishers, iterations=8)
    want, got = _read_all(single), _read_all(split)
    assert total == len(got)
    assert Counter(got) == Counter(want)
    assert _per_key(got) == _per_key(want)


_ORPHAN = """
import os, sys, time
from trainer.sim.engine import SimEngine
from trainer.sim.publishers import BusSpec, SplitPublisher
from trainer.sim.scenario import load_scenario
sc = load_scenario("fail_slow_compute_x2")
engine = SimEngine(sc.sim_config(), sc.all_faults())
split = SplitPublisher(engine.config, sc.all_faults(), BusSpec("embedded", path=sys.argv[1]), 2)
print(" ".join(str(p.pid) for p in split._procs), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.processes
def test_publishers_die_with_a_killed_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(tmp_path / "bus.sqlite")], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert parent.stdout is not None
        children = [int(p) for p in parent.stdout.readline().split()]
        assert len(children) == 2 and all(_alive(p) for p in children)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        for _ in range(200):  # the kernel's parent-death signal, not a deadline of ours
            if not any(_alive(p) for p in children):
                break
            time.sleep(0.05)
        assert not any(_alive(p) for p in children)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
