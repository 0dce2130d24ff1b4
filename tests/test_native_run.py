"""The native executor as an ordinary ``resihp run`` job (trainer/native/job.py).

``resihp run --standalone --nproc-per-node 4 --on-failure shrink -m trainer.native.job``: real rank
processes (gloo, CPU, float64) under the node agent's command line, not the native launcher. One
rank is SIGKILLed inside a forward chunk (a ``stop_device`` fault in the run's spec); the agent
counts and marks it lost in the ranks' store, the survivors wake on the count, close their quorum,
re-form without it through ``NativeExecutor.recover`` and train to the end, with the losses and
final parameters of one process training the same global batches. The flags' parsing is checked
without processes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import ReshapePhase
from collector.plan import Plan
from collector.stream import EventStream
from infra.etcd import start_cluster
from tests.test_agent_run import env, free_port
from tests.test_native_recovery import PHASES
from tests.test_native_reshape import CFG, SETTINGS, ReplicaSpec, _assert_matches_reference, _plan
from trainer.fault_spec import FaultSpec
from trainer.native.job import job_spec, parser
from trainer.native.worker import NativeRunSpec, read_results


def run_native_job(tmp_path: Path, spec: NativeRunSpec, ranks: int, *flags: str) -> subprocess.CompletedProcess:
    """``resihp run --on-failure shrink`` of ``spec`` on ``ranks`` ranks of one node, to its end, its
    agent and ranks publishing to the embedded bus ``bus.sqlite`` as job ``native-job``."""
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    cmd = [sys.executable, "-m", "resihp.cli", "run", "--job", "native-job", "--bus", "embedded", "--bus-path",
           str(tmp_path / "bus.sqlite"), "--standalone", "--nproc-per-node", str(ranks), "--monitor-interval", "0.05",
           "--on-failure", "shrink", "--work-dir", str(tmp_path / "agent"), *flags,
           "-m", "trainer.native.job", "--spec", str(tmp_path / "spec.json"), "--telemetry"]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False)


@pytest.mark.processes  # tests/fixtures/tiers.py
def test_a_sigkilled_native_rank_under_resihp_run_shrink_is_recovered_in_the_job_and_equals_the_reference(tmp_path):
    # TP1·PP1·DP4, whole replicas: device 2 dies in iteration 2; replica 0 takes its micro-batch
    # (1/1/1/1 → 2/1/1) and every piece comes from a live peer; the iteration is redone.
    replicas: list[ReplicaSpec] = [(1, [((d,), 0, 4)]) for d in range(4)]
    start = _plan(0, *replicas)
    out = tmp_path / "out"
    spec = NativeRunSpec(model=asdict(CFG), settings=asdict(replace(SETTINGS, dp_mode="replicate")), plan=start,
                         iterations=4, out_dir=str(out), timeout_s=60, device="cpu",
                         faults=[FaultSpec(kind="stop_device", device=2, at_iteration=2)])
    done = run_native_job(tmp_path, spec, 4, "--preload", "trainer.native.worker")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 2 (local 2" in done.stderr and "SIGKILL; its peers go on without it" in done.stderr, done.stderr
    ranks, params = read_results(out)
    assert sorted(ranks) == [0, 1, 3]  # device 2 was SIGKILLed: it wrote nothing
    _assert_matches_reference(ranks, params, 4)
    for device in (0, 1, 3):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [2] and recovery["source"] == "live" and recovery["iteration"] == 2
        assert ranks[device]["epochs"] == {"0": 0, "1": 0, "2": 1, "3": 1}
    # each survivor published its recovery's phases on the agent's bus, under the agent's job name
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus, EventStream(bus, "test", [topics.TELEMETRY],
                                                                  job="native-job") as stream:
        phases = []
        while batch := stream.poll(timeout_s=0.5):
            phases += [d.event.payload for d in batch if isinstance(d.event.payload, ReshapePhase)]
    assert {(p.rank, p.phase.value) for p in phases} == {(d, phase) for d in (0, 1, 3) for phase in PHASES}
    assert all(p.epoch == 1 and p.iteration == 2 and p.ok for p in phases)


@pytest.mark.processes  # tests/fixtures/tiers.py
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_native_rank_lost_in_a_two_node_resihp_run_job_is_recovered_on_c10d_and_on_etcd(tmp_path, backend):
    # 2 agents × 2 ranks, TP1·PP1·DP4 replicated: device 3 (node 1's second rank) dies in
    # iteration 2; node 1's agent marks it lost in the ranks' store — node 0's bootstrap store under
    # c10d, the round's keys on a three-member etcd cluster (RESIHP_RANKS_STORE) — and the three
    # survivors on both nodes recover and train to the reference state.
    replicas: list[ReplicaSpec] = [(1, [((d,), 0, 4)]) for d in range(4)]
    out = tmp_path / "out"
    spec = NativeRunSpec(model=asdict(CFG), settings=asdict(replace(SETTINGS, dp_mode="replicate")),
                         plan=_plan(0, *replicas), iterations=4, out_dir=str(out), timeout_s=60, device="cpu",
                         faults=[FaultSpec(kind="stop_device", device=3, at_iteration=2)])
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    cluster = start_cluster(tmp_path / "etcd") if backend == "etcd" else None
    try:
        endpoint = cluster.endpoints if cluster is not None else f"127.0.0.1:{free_port()}"
        agents = []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "resihp.cli", "run", "--no-telemetry", "--nnodes", "2", "--nproc-per-node",
                   "2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", f"native-{backend}",
                   "--node-rank", str(node), "--max-restarts", "0", "--monitor-interval", "0.05", "--on-failure",
                   "shrink", "--preload", "trainer.native.worker", "--work-dir", str(tmp_path / f"agent-{node}"),
                   "-m", "trainer.native.job", "--spec", str(tmp_path / "spec.json")]
            agents.append(subprocess.Popen(cmd, env=env(), stdout=open(tmp_path / f"node{node}.log", "w"),
                                           stderr=subprocess.STDOUT, text=True))
        codes = [a.wait() for a in agents]
    finally:
        if cluster is not None:
            cluster.stop()
    logs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert codes == [0, 0], logs
    assert "rank 3 (local 1" in logs[1] and "SIGKILL; its peers go on without it" in logs[1], logs[1]
    ranks, params = read_results(out)
    assert sorted(ranks) == [0, 1, 2]
    _assert_matches_reference(ranks, params, 4)
    for device in (0, 1, 2):
        (recovery,) = ranks[device]["reshapes"]
        assert recovery["lost"] == [3] and recovery["source"] == "live" and recovery["iteration"] == 2


def _args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def test_the_layout_flags_make_a_plan_over_the_world_resihp_run_started():
    spec = job_spec(_args("--tp", "2", "--microbatches", "3", "--layers", "2", "--iterations", "7"), world_size=8)
    assert spec.plan.shape() == Plan.uniform(tp=2, pp=1, dp=4, num_layers=2, microbatches_per_replica=3).shape()
    assert spec.plan.devices == list(range(8)) and spec.iterations == 7 and spec.config.n_layers == 2


def test_a_spec_file_is_read_and_the_flags_override_it(tmp_path):
    start = _plan(0, (2, [((0,), 0, 4)]), (2, [((1,), 0, 4)]))
    (tmp_path / "spec.json").write_text(NativeRunSpec(model=asdict(CFG), plan=start, iterations=3).model_dump_json())
    spec = job_spec(_args("--spec", str(tmp_path / "spec.json"), "--iterations", "9", "--dp-mode", "replicate"), 2)
    assert spec.plan == start and spec.iterations == 9 and spec.train_settings.dp_mode == "replicate"
    assert spec.config == CFG


def test_what_cannot_run_under_resihp_run_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(SystemExit, match=r"names devices \[2, 3\] but resihp run started 2 ranks"):
        job_spec(_args("--dp", "4"), world_size=2)
    start = _plan(0, (2, [((0,), 0, 4)]))
    (tmp_path / "spec.json").write_text(NativeRunSpec(plan=start, commands=True).model_dump_json())
    with pytest.raises(SystemExit, match="need the native launcher's intake"):
        job_spec(_args("--spec", str(tmp_path / "spec.json")), world_size=1)
