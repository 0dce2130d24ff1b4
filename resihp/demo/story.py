"""The demo's story: one job, a healthy warm-up, a fail-slow, later a fail-stop, a healthy tail.

The story is written as the files the real commands read — a scenario YAML for the simulator
(docs/scenarios.md), a fault list for the torch trainer (trainer/faults.py), the detector's
settings, and the planner's fallback cost figures — so the demo runs the same code paths an
operator would.

Layout by scale: PP2 below 32 GPUs, PP4 from 32, DP fills the rest; TP 2 by default (8 GPUs →
TP2·PP2·DP2, 256 → TP2·PP4·DP32). With TP 2 the fail-slow is first seen on its TP group (the
simulator's TP peers report identical chunk times); a probe names the member, and the remediation
engine waits for it (or plans around the whole group). ``--tp 1`` gives the per-rank layout.

The fail-slow (×3 compute, lasting) hits the last TP rank of replica 1's first stage; the
fail-stop kills the first TP rank of replica 0's last stage, so the two faults sit in different
replicas and each needs its own plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

JOB = "demo"
DEFAULT_TP = 2  # TP groups: the fail-slow is first seen on its group, a probe (or the planner) takes it from there

# The detector's settings for the demo (analytics/detection/config.py): the defaults, plus probes —
# the workload runs a short fixed job on each suspect, so a slow member of a TP group (whose peers
# report identical chunk times) is named, not just its group. (The lags used to be raised here to
# ride out Kafka's per-partition skew; the detector now copes with that at its defaults.)
DETECTOR_SETTINGS = {"probes": True}


@dataclass(frozen=True)
class FaultBeat:
    """One injected fault as the story tells it (what the summary matches detections against)."""

    fault_id: str
    category: str  # fail_slow | fail_stop
    device: int
    at_iteration: int
    factor: float | None = None


@dataclass(frozen=True)
class DemoStory:
    gpus: int
    tp: int
    pp: int
    dp: int
    microbatches_per_replica: int
    model: str  # simulator preset (docs/simulator.md)
    warmup_iterations: int
    slow: FaultBeat
    stop: FaultBeat | None  # None: the native executor's story (it cannot recover a killed rank yet)
    iterations: int
    heartbeat_interval_s: float = 2.0
    reshape_pause_s: float = 5.0
    job: str = JOB
    probes: bool = True  # the detector asks the workload to probe suspects (the native launcher answers none)
    sharded: bool = False  # torchtitan: the replicas are FSDP2 shards (else DDP-style replicas)

    @property
    def faults(self) -> list[FaultBeat]:
        return [self.slow] + ([self.stop] if self.stop is not None else [])

    def told(self) -> str:
        """The story in one line, for the demo's opening."""
        stop = (f", device {self.stop.device} stops at iteration {self.stop.at_iteration}" if self.stop is not None
                else "")
        return (f"healthy warm-up, ×{self.slow.factor:g} fail-slow on device {self.slow.device} at iteration "
                f"{self.slow.at_iteration}{stop}, {self.iterations} iterations")

    @property
    def layout(self) -> str:
        return f"TP{self.tp}·PP{self.pp}·DP{self.dp}"

    def device(self, replica: int, stage: int, tp_rank: int) -> int:
        """Plan.uniform's numbering: device = (replica·pp + stage)·tp + tp_rank."""
        return (replica * self.pp + stage) * self.tp + tp_rank

    # ---- files the commands read ----------------------------------------------------------------

    def scenario(self) -> dict:
        """The simulator scenario (``resihp simulate`` reads the same YAML)."""
        return {
            "name": f"demo_{self.gpus}",
            "description": f"resihp demo: {self.gpus} GPUs {self.layout}: {self.told()}",
            "job": self.job, "seed": 7, "model": self.model,
            "cluster": {"gpus": self.gpus, "gpus_per_node": 8},
            "plan": {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                     "microbatches_per_replica": self.microbatches_per_replica, "schedule": "1f1b"},
            "workload": "pretrain", "iterations": self.iterations,
            "heartbeat_interval_s": self.heartbeat_interval_s, "reshape_pause_s": self.reshape_pause_s,
            "faults": [
                {"id": self.slow.fault_id, "kind": "slow_compute", "device": self.slow.device,
                 "factor": self.slow.factor, "at_iteration": self.slow.at_iteration},
            ] + ([{"id": self.stop.fault_id, "kind": "stop_device", "device": self.stop.device,
                   "at_iteration": self.stop.at_iteration}] if self.stop is not None else []),
        }

    def torch_faults(self) -> dict:
        """The torch trainer's fault list: the scenario's own (trainer/fault_spec.py, one vocabulary)."""
        return {"faults": self.scenario()["faults"]}

    def write(self, workdir: Path) -> dict[str, Path]:
        """Write scenario.yaml, faults.yaml, detector.yaml and planner-model.json into ``workdir``."""
        workdir.mkdir(parents=True, exist_ok=True)
        files = {
            "scenario": workdir / "scenario.yaml",
            "faults": workdir / "faults.yaml",
            "detector": workdir / "detector.yaml",
            "model": workdir / "planner-model.json",
        }
        files["scenario"].write_text(yaml.safe_dump(self.scenario(), sort_keys=False))
        files["faults"].write_text(yaml.safe_dump(self.torch_faults(), sort_keys=False))
        files["detector"].write_text(yaml.safe_dump(DETECTOR_SETTINGS if self.probes else {}))
        files["model"].write_text(json.dumps(planner_model(self), indent=2))
        return files


def planner_model(story: DemoStory) -> dict:
    """The planner's fallback cost figures (``resihp remediate --model``), in a model file's form.

    They are the simulator's healthy per-layer costs (no fault knowledge: faults reach the planner
    only through incidents). The engine replaces them with the analytics consumer's fitted cost
    model as soon as ``analytics.cost_model`` events arrive.
    """
    from resihp.planning_models import exact_model
    from remediation.model import model_file
    from trainer.sim.scenario import Scenario

    config = Scenario.model_validate(story.scenario()).sim_config()
    spec = exact_model(config.model, config.cluster, config.workload)
    return model_file(spec)


def story_for(gpus: int = 8, *, short: bool = False, tp: int | None = None) -> DemoStory:
    """The story at ``gpus`` GPUs (≥ 8). ``short`` trims the warm-up and the phases (tests);
    ``tp`` overrides the TP degree of the layout."""
    if gpus < 8:
        raise ValueError(f"--scale {gpus}: the demo needs at least 8 GPUs")
    if tp is None:
        tp = DEFAULT_TP
    pp = 4 if gpus >= 32 else 2
    dp = gpus // (tp * pp)
    if dp < 2:
        raise ValueError(f"{gpus} GPUs at TP{tp}·PP{pp} make {dp} replica(s); the story needs 2 (the faults sit in "
                         "different replicas): use a smaller --tp or a larger --scale")
    warmup, phase = (20, 36) if short else (30, 60)
    slow_device = (1 * pp + 0) * tp + (tp - 1)
    stop_device = (0 * pp + pp - 1) * tp
    slow = FaultBeat("demo-fail-slow", "fail_slow", slow_device, warmup, factor=3.0)
    stop = FaultBeat("demo-fail-stop", "fail_stop", stop_device, warmup + phase)
    return DemoStory(gpus=gpus, tp=tp, pp=pp, dp=dp, microbatches_per_replica=max(4, 2 * pp), model="7b",
                     warmup_iterations=warmup, slow=slow, stop=stop, iterations=warmup + 2 * phase)


def native_story(*, short: bool = False) -> DemoStory:
    """The story for the PyTorch-native executor (``resihp demo --trainer native``): four CPU ranks,
    TP1·PP1·DP4, a ×3 fail-slow on replica 1's device. The native executor runs DP changes (it
    declares so on the bus), so the planner answers with a micro-batch migration (or a replica
    drop) it applies live. No fail-stop: the native executor cannot yet recover a killed rank
    (docs/native.md). TP1, so every rank is its own TP group and the detector names it without a
    probe; four replicas, because the detector centres each rank on the job's median, which two
    ranks (one of them slow) would split between them."""
    warmup, phase = (20, 20) if short else (30, 60)
    slow = FaultBeat("demo-fail-slow", "fail_slow", 1, warmup, factor=3.0)
    return DemoStory(gpus=4, tp=1, pp=1, dp=4, microbatches_per_replica=2, model="7b", warmup_iterations=warmup,
                     slow=slow, stop=None, iterations=warmup + 2 * phase, probes=False)


TITAN_LAYOUTS = ("replicas", "fsdp", "pp")  # how the torchtitan story's four ranks hold the model


def torchtitan_story(*, short: bool = False, ranks: int = 4, layout: str = "replicas") -> DemoStory:
    """The story for a torchtitan job (``resihp demo --trainer torchtitan``): torchtitan's llama3
    debug model as data-parallel replicas on ``ranks`` CPU ranks under ``resihp run``, a ×3
    fail-slow on device 1. torchtitan runs uniform layouts only (trainer/torchtitan/layout.py), so
    the planner chooses among uniform layouts without the slow device (remediation/uniform.py):
    two replicas of two micro-batches each (the global batch of four kept), which the node agent
    applies by a restart at that
    layout from a checkpoint of the step every rank stopped at (trainer/torchtitan/controller.py).
    Four replicas, because the detector centres each rank on the job's median, which two ranks (one
    of them slow) would split between them.

    ``layout``: ``replicas`` (DDP-style, the default), ``fsdp`` (the same four ranks as FSDP2 shards:
    a slow rank's all-gathers and reductions hold every peer's wait) or ``pp`` (two pipelines of two
    stages, two micro-batches each: device 1 is the first stage of the second pipeline)."""
    if layout not in TITAN_LAYOUTS:
        raise ValueError(f"torchtitan story layout {layout!r}: one of {', '.join(TITAN_LAYOUTS)}")
    warmup, phase = (8, 8) if short else (20, 30)
    slow = FaultBeat("demo-fail-slow", "fail_slow", 1, warmup, factor=3.0)
    pp = 2 if layout == "pp" else 1
    return DemoStory(gpus=ranks, tp=1, pp=pp, dp=ranks // pp, microbatches_per_replica=pp, model="7b",
                     warmup_iterations=warmup, slow=slow, stop=None, iterations=warmup + 2 * phase, probes=False,
                     sharded=layout == "fsdp")
