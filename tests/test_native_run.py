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

from collector.plan import Plan
from tests.test_agent_run import env
from tests.test_native_reshape import CFG, SETTINGS, ReplicaSpec, _assert_matches_reference, _plan
from trainer.fault_spec import FaultSpec
from trainer.native.job import job_spec, parser
from trainer.native.worker import NativeRunSpec, read_results


def run_native_job(tmp_path: Path, spec: NativeRunSpec, ranks: int, *flags: str) -> subprocess.CompletedProcess:
    """``resihp run --on-failure shrink`` of ``spec`` on ``ranks`` ranks of one node, to its end."""
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    cmd = [sys.executable, "-m", "resihp.cli", "run", "--no-telemetry", "--standalone", "--nproc-per-node", str(ranks),
           "--monitor-interval", "0.05", "--on-failure", "shrink", "--work-dir", str(tmp_path / "agent"), *flags,
           "-m", "trainer.native.job", "--spec", str(tmp_path / "spec.json")]
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
