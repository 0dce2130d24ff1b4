"""One fault vocabulary: a scenario's faults: list runs on the torch trainer and on the simulator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from trainer.fault_spec import FaultList, FaultSpec
from trainer.sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[1]


def test_one_file_runs_on_either_runtime_with_the_same_meaning(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({
        "name": "both", "cluster": {"gpus": 8, "gpus_per_node": 8}, "plan": {"tp": 2, "pp": 2, "dp": 2},
        "iterations": 20,
        "faults": [{"kind": "slow_compute", "device": 5, "factor": 3.0, "at_iteration": 4, "duration_iterations": 6},
                   {"kind": "stop_device", "device": 6, "at_iteration": 12}]}))
    trainer = FaultList.load(path, "trainer").faults
    simulated = Scenario.model_validate(yaml.safe_load(path.read_text())).faults
    assert trainer == simulated
    slow = trainer[0]
    assert (slow.end_iteration, slow.active(3), slow.active(4), slow.active(9), slow.active(10)) == \
           (10, False, True, True, False)


def test_the_trainers_older_spellings_mean_the_same_fault():
    old = FaultSpec.model_validate({"kind": "kill", "rank": 3, "start_iteration": 7})
    assert old == FaultSpec(kind="stop_device", device=3, at_iteration=7)
    ranged = FaultSpec.model_validate({"kind": "slow_compute", "rank": 1, "start_iteration": 2, "end_iteration": 5})
    assert (ranged.at_iteration, ranged.duration_iterations, ranged.end_iteration) == (2, 3, 5)
    assert FaultSpec(kind="slow_send", device=2, delay_s=0.02).at_iteration == 0  # no onset: from the start


@pytest.mark.parametrize(("fault", "runtime", "says"), [
    ({"kind": "slow_link", "link": [0, 4], "at_iteration": 1}, "trainer", "the trainer cannot inject a slow_link"),
    ({"kind": "slow_send", "device": 2, "delay_s": 0.1}, "simulator", "the simulator cannot inject a slow_send"),
    ({"kind": "slow_compute", "device": 2, "at_s": 30.0}, "trainer", "the trainer counts iterations"),
])
def test_a_kind_the_runtime_cannot_inject_is_refused_naming_what_it_can(tmp_path, fault, runtime, says):
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"faults": [fault]}))
    with pytest.raises(ValueError, match=says):
        FaultList.load(path, runtime)


def test_bad_entries_name_the_problem():
    with pytest.raises(ValidationError, match="needs 'device'"):
        FaultSpec(kind="slow_compute", at_iteration=1)
    with pytest.raises(ValidationError, match="exclusive"):
        FaultSpec.model_validate({"kind": "slow_compute", "device": 1, "start_iteration": 5, "end_iteration": 5})
    with pytest.raises(ValidationError, match="not both"):
        FaultSpec(kind="stop_device", device=1, at_iteration=1, at_s=3.0)


def test_every_library_scenario_the_trainer_can_run_loads_as_its_fault_list():
    """The scenarios whose kinds the trainer injects load unchanged as trainer fault lists."""
    loaded = 0
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        kinds = {f["kind"] for f in (yaml.safe_load(path.read_text()).get("faults") or [])}
        if kinds and kinds <= {"slow_compute", "stop_device"}:
            assert FaultList.load(path, "trainer").faults
            loaded += 1
    assert loaded >= 3


@pytest.mark.processes
def test_resihp_train_refuses_a_fault_on_a_device_the_plan_does_not_have(tmp_path):
    scenario = ROOT / "scenarios" / "fail_slow_compute_x2.yaml"  # device 10, on a 32-GPU plan
    run = subprocess.run([sys.executable, "-m", "resihp.cli", "train", "--tp", "2", "--pp", "2", "--dp", "2",
                          "--faults", str(scenario), "--iterations", "2"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    assert "device(s) [10]" in run.stderr and "TP2" in run.stderr
