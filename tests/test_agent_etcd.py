"""A multi-node job on etcd (``resihp run --rdzv-backend etcd``) has no single point of failure.

A real three-member etcd cluster on loopback (infra/etcd.py, Debian's etcd-server), started for
this module and bound to it. The store tests run the job's store and the rendezvous state against
it (what torch and gloo need of a store, failover, the signed state, any bytes under a key); the
end-to-end test runs two agents of one rank each and a waiting spare under ``--on-failure shrink``,
SIGKILLs node 0's agent (under the c10d rendezvous it serves the job's stores, and the job would
end), lets the spare take its place, then SIGKILLs the etcd leader, and the job trains to the end
at the reference state with every process gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from collector import topics
from collector.bus import open_bus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import AckStatus, Envelope, NodeCommand, NodeCommandAck, RecoveryPhase
from collector.stream import EventStream
from infra.etcd import EtcdCluster, start_cluster
from tests.fixtures.signing import factory
from tests.fixtures.processes import owned_by_fixture
from tests.test_agent_run import agent_cmd, alive, env, pid_dir, rows_of, wait_until, written_pids
from trainer.agent.etcd_client import EtcdClient, parse_endpoints
from trainer.agent.etcd_store import EtcdRendezvousBackend, EtcdStore
from trainer.agent.sample_job import reference_state
from trainer.agent.signed_store import SignedStore

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

JOB, RUN = "etcd-job", "job-etcd"  # the job on the bus, and its rendezvous id (the run a node command names)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    started = start_cluster(tmp_path_factory.mktemp("etcd"))
    for member in started.members:
        assert member.process is not None
        owned_by_fixture(member.process)
    try:
        yield started
    finally:
        started.stop()


def client_of(cluster: EtcdCluster) -> EtcdClient:
    return EtcdClient(parse_endpoints(cluster.endpoints), timeout_s=20)


def test_the_store_does_what_torch_and_gloo_ask_of_a_store(cluster: EtcdCluster) -> None:
    store = EtcdStore(client_of(cluster), "/t/store-semantics/", timedelta(seconds=5))
    store.set("a", "1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert [store.add("n", 2), store.add("n", 3), store.add("n", 0), store.add("absent", 0)] == [2, 5, 5, 0]
    assert store.compare_set("c", "", "x") == b"x" and store.compare_set("c", "y", "z") == b"x"
    assert store.compare_set("c", "x", "w") == b"w"
    prefixed = dist.PrefixStore("p/", store)  # the C++ side calls this store through the trampoline
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and prefixed.multi_get(["k"]) == [b"v"] and prefixed.add("q", 1) == 1
    assert store.num_keys() == 5 and store.delete_key("a") and not store.delete_key("a")
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], timedelta(seconds=0.2))


def test_a_signed_record_reads_back_and_any_other_bytes_are_refused(cluster: EtcdCluster) -> None:
    store = EtcdStore(client_of(cluster), "/t/records/")
    records = SignedStore(store, "job-x", reader="test")
    records.set("resihp/lost/1", {"exitcode": 9})
    assert records.read("resihp/lost/1") == {"exitcode": 9}
    for raw in (b"\xff\xfe\x00", b'{"body": 1, "signature": "executor:00"}', b"[" * 5000, b""):
        store.set("resihp/lost/2", raw)
        assert records.read("resihp/lost/2") is None  # refused, reported, never raised
    store.client.put(b"/t/records/counter", b"not a number")
    with pytest.raises(RuntimeError, match="not a number"):
        store.add("counter", 1)


def test_the_rendezvous_state_is_swapped_by_revision_and_a_forged_one_is_refused(cluster: EtcdCluster) -> None:
    client = client_of(cluster)
    backend = EtcdRendezvousBackend(client, "job-state")
    assert backend.get_state() is None
    def swap(state: bytes, token: object = None) -> tuple[bytes, object, bool]:
        result = backend.set_state(state, token)
        assert result is not None, "set_state answers with the state it read"
        return result

    state, token, written = swap(b"round 0")
    assert (state, written) == (b"round 0", True)
    assert swap(b"stale")[1:] == (token, False)  # created by another: not written
    assert swap(b"round 1", token)[0::2] == (b"round 1", True)
    assert swap(b"lost race", token)[0::2] == (b"round 1", False)
    client.put(backend.key, b"\x80\x04pickled by a stranger")
    with pytest.raises(RendezvousStateError, match="refused"):
        backend.get_state()


def test_the_store_fails_over_when_a_member_dies(tmp_path: Path) -> None:
    """Its own cluster: the module's must keep all three members for the job below."""
    own = start_cluster(tmp_path / "etcd")
    try:
        store = EtcdStore(client_of(own), "/t/failover/")
        assert store.add("n", 1) == 1
        own.kill(own.leader())  # an election, then the two left hold the quorum
        assert store.add("n", 1) == 2 and store.get("n") == b"2"
        own.kill(next(i for i, m in enumerate(own.members) if m.alive()))  # two of three gone: no quorum, a clear error within the client's timeout
        quick = EtcdStore(EtcdClient(parse_endpoints(own.endpoints), timeout_s=1.5), "/t/failover/")
        with pytest.raises(dist.DistStoreError, match="no etcd member answered"):
            quick.add("n", 1)
    finally:
        own.stop()


def etcd_agent(tmp_path: Path, endpoints: str, node: int, steps: int, *flags: str, log: Path) -> subprocess.Popen:
    """One agent of a 2-agent × 1-rank job on etcd under --on-failure shrink, its output in ``log``."""
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--max-restarts", "0",
              "--rdzv-endpoint", endpoints, "--rdzv-id", RUN, "--rdzv-conf", "join_timeout=300",
              "--monitor-interval", "0.05", "--on-failure", "shrink")
    job = ("--steps", str(steps), "--step-s", "0.05", "--progress-file", str(tmp_path / "progress.jsonl"),
           "--pid-dir", str(pid_dir(tmp_path)), "--final-state", str(tmp_path / "final.pt"),
           "--stop-file", str(tmp_path / "stop"))
    argv = agent_cmd(*common, "--node-rank", str(node), "--work-dir", str(tmp_path / f"w{node}-{len(flags)}"), *flags,
                     job_args=job)
    at = argv.index("--no-telemetry")  # node commands come from the bus
    argv[at:at + 1] = ["--job", JOB, "--bus", "embedded", "--bus-path", str(tmp_path / "bus.sqlite")]
    return subprocess.Popen(argv, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def stop_order(node: int, round_: int) -> Envelope:
    """The engine's signed order to stop ``node`` of the job's round ``round_``."""
    return factory(JOB, "remediation").make(NodeCommand(
        command_id=f"stop-{node}", node=node, action="stop", round=round_, run=RUN,
        expires_at_s=time.time() + COMMAND_TTL_S))


def bus_events(tmp_path: Path, topic: str) -> list:
    bus = open_bus("embedded", path=str(tmp_path / "bus.sqlite"))
    stream = EventStream(bus, "test", [topic], job=JOB)
    payloads = [d.event.payload for d in stream.poll(timeout_s=1.0)]
    stream.close()
    bus.close()
    return payloads


def test_node_0_and_then_an_etcd_member_die_and_the_job_trains_on_and_a_spare_joins(
        cluster: EtcdCluster, tmp_path: Path) -> None:
    """SIGKILL of node 0's agent: node 1's rank trains on alone, the spare takes node 0's place
    and its rank joins; SIGKILL of the etcd leader: the job trains on; then a stop order for node
    0 (refused under c10d, where node 0 serves the job's stores) drains it: its rank finishes its
    step and leaves, and node 1's goes on from there. The job ends at the reference state; every
    agent and rank is gone. The job runs until the test has seen all this (--stop-file), so a slow
    start of the spare's rank cannot end it first."""
    steps = 100_000
    progress = tmp_path / "progress.jsonl"
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)] + [tmp_path / "spare.log"]
    agents = [etcd_agent(tmp_path, cluster.endpoints, n, steps, log=logs[n]) for n in (0, 1)]
    spare = etcd_agent(tmp_path, cluster.endpoints, 0, steps, "--join-running", log=logs[2])
    try:
        wait_until(lambda: len(rows_of(progress)) >= 4)
        first = set(written_pids(tmp_path))
        os.kill(agents[0].pid, signal.SIGKILL)
        wait_until(lambda: any(r["world"] == 1 for r in rows_of(progress)))
        wait_until(lambda: rows_of(progress)[-1]["world"] == 2 and len(set(written_pids(tmp_path))) == 3)
        leader = cluster.leader()
        cluster.kill(leader)
        killed_at = len(rows_of(progress))
        wait_until(lambda: len(rows_of(progress)) > killed_at + 5)
        place = re.findall(r"node 0 of 2 with ranks \[0\] in rendezvous round (\d+)", logs[2].read_text())
        bus = open_bus("embedded", path=str(tmp_path / "bus.sqlite"))
        bus.publish([stop_order(0, int(place[0]))])
        bus.close()
        assert spare.wait(timeout=300) == 0, logs[2].read_text()
        drained_at = len(rows_of(progress))
        wait_until(lambda: len(rows_of(progress)) > drained_at + 3)
        (tmp_path / "stop").touch()
        for proc in (agents[1], spare):
            proc.wait(timeout=300)
    finally:
        for proc in (*agents, spare):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outs = [log.read_text() for log in logs]
    assert [agents[1].returncode, spare.returncode] == [0, 0], outs
    rows = rows_of(progress)
    worlds = [r["world"] for r in rows]
    alone = worlds.index(1)
    back = worlds.index(2, alone)
    assert set(worlds[:alone]) == {2} and set(worlds[alone:back]) == {1} and worlds[-1] == 1  # 2 → 1 → 2 → 1
    assert set(worlds[drained_at:]) == {1}
    # Every step once: steps only rise (nothing redone) one at a time, except that the row of the step
    # node 0's rank finished just before its SIGKILL may be missing (that rank wrote the rows; its
    # peer, which writes them next, goes on from the step both committed).
    done = [r["step"] for r in rows]
    gaps = [(i, b - a) for i, (a, b) in enumerate(zip(done, done[1:]), 1) if b != a + 1]
    assert done[0] == 1 and gaps in ([], [(alone, 2)]), (gaps, done[:alone + 3])
    assert "the agent of node 0 is gone with its ranks [0]; ranks [0] marked lost" in outs[1], outs[1]
    assert "rank 0 joined the world" in outs[2], outs[2]
    acks = [p for p in bus_events(tmp_path, topics.CONTROL) if isinstance(p, NodeCommandAck)]
    assert [(a.status, a.detail) for a in acks] == [
        (AckStatus.APPLIED, "node 0 stopped its ranks [0]; [0] left the world at a step boundary")], outs[2]
    changes = {p.generation: (p.failed_op, tuple(p.lost)) for p in bus_events(tmp_path, topics.TELEMETRY)
               if isinstance(p, RecoveryPhase)}
    assert sorted(changes) == [1, 2, 3] and changes[1][1] == (0,), changes  # the death: a failed collective
    assert (changes[2], changes[3]) == (("join of a replacement", ()), ("drain of ranks [0]", (0,)))
    # the drain interrupted no collective: node 1's rank went on from the step both had finished
    pids = written_pids(tmp_path)
    assert len(set(pids) - first) == 1 and alive(pids) == []  # one new rank, and nothing left running
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, tensor in reference_state(rows[-1]["step"]).items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
