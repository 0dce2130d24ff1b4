"""A torchtitan job that loses a device, under ``resihp run``: restarted at the same layout from its
last checkpoint, then — when the same device's rank dies again — restarted past it at a smaller
uniform layout, the losses of the steps it redoes unchanged.

Four CPU ranks (data-parallel replicas, a global batch of four micro-batches), a checkpoint every
3 steps, and device 3 lost at step 6 (``stop_device``: its rank is killed in its forward there, in
every world that reaches it, as a device that is gone would fail every process put on it).

* round 1 trains steps 1–5 and dies in step 6; torch's agent restarts it at the same layout (one
  restart spent) from the checkpoint of step 3;
* round 2 redoes steps 4–5 — with the losses round 1 had, to the bit (the same layout, the same
  reductions) — and dies in step 6 again: device 3 has ended two rounds in a row, it is lost;
* round 3 is the agent's: 2 replicas on devices 0 and 1 (the bubble-free layout on the three left
  that keeps the global batch: 4 micro-batches do not split over 3 replicas), plan epoch 1,
  announced as ``plan.current`` (reason ``restart``) with its phases. It redoes steps 4–5 from the
  same checkpoint with round 1's losses (to 1e-5 relative: fp32, the gradients summed in another
  order) and trains to the end.

The same run answers probes: once the job has announced its plan, the test publishes a compute
``probe.request`` for device 1 and a link probe for device 2, signed as the analytics consumer; the
agent posts them to the ranks, every rank runs them at one step boundary, and devices 1 and 2
answer with ``probe.result``s signed with the ranks' key against the world's median.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from collector import topics
from collector.auth import Gate
from collector.embedded import EmbeddedBus
from collector.events import EventFactory, IterationSummary, PlanCurrent, ProbeRequest, ProbeResult, ReshapePhase
from collector.stream import EventStream
from tests.fixtures.signing import signed
from tests.test_torchtitan_e2e import _events

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def test_a_lost_device_is_restarted_past_at_a_smaller_uniform_layout_and_the_redone_steps_are_exact(
        tmp_path: Path) -> None:
    from trainer.torchtitan.assets import build_assets

    assets = build_assets(tmp_path / "assets")
    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n  - kind: stop_device\n    device: 3\n    at_iteration: 6\n")
    bus = tmp_path / "bus.sqlite"
    argv = [sys.executable, "-m", "resihp.cli", "run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "3",
            "--job", "lost-device", "--bus", "embedded", "--bus-path", str(bus),
            "--preload", "torchtitan.trainer,trainer.torchtitan.config_registry",
            "-m", "torchtitan.train", "--module", "trainer.torchtitan", "--config", "llama3_debugmodel",
            "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(assets),
            "--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1",
            "--training.local_batch_size", "1", "--training.global_batch_size", "4",
            "--training.steps", str(STEPS), "--checkpoint.interval", "3", "--checkpoint.async_mode", "async",
            "--dump_folder", str(tmp_path / "run"), "--resihp.faults", str(faults)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not any(isinstance(e, PlanCurrent) for e in (_events(bus, [topics.CONTROL]) if bus.exists() else [])):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never announced its plan"
            time.sleep(0.2)
        with EmbeddedBus(bus) as writer:
            probes = [ProbeRequest(probe_id="p-device-1", ranks=[1], target="compute", repeats=3),
                      ProbeRequest(probe_id="p-link-2", ranks=[2], target="link", repeats=3)]
            writer.publish([signed(EventFactory("lost-device", "analytics").make(probe)) for probe in probes])
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    why = f"\nexit {proc.returncode}\n{stderr[-5000:]}"
    assert proc.returncode == 0, why
    assert "lost device(s) [3]" in stderr, why

    control = _events(bus, [topics.CONTROL])
    telemetry = _events(bus, [topics.TELEMETRY])
    with EmbeddedBus(bus) as reader:
        stream = EventStream(reader, "test-probe", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
        answers = [d.event for d in stream.poll(timeout_s=0.5) if isinstance(d.event.payload, ProbeResult)]
        stream.close()
    assert all(Gate("test").admit(envelope) for envelope in answers), "a probe result carries the ranks' signature"
    by_probe = {e.payload.probe_id: e.payload for e in answers if isinstance(e.payload, ProbeResult)}
    assert sorted(by_probe) == ["p-device-1", "p-link-2"] and len(answers) == 2, answers
    answer, link = by_probe["p-device-1"], by_probe["p-link-2"]
    assert answer.rank == 1 and answer.reference_s > 0, why
    assert 0.2 < answer.duration_s / answer.reference_s < 5, answer  # a healthy device near the world's median
    # device 2 sent the buffer to device 3, as long as the world's median send took
    assert link.rank == 2 and link.duration_s > 0 and 0.1 < link.duration_s / link.reference_s < 10, link
    plans = [e for e in control if isinstance(e, PlanCurrent)]
    assert [p.plan.epoch for p in plans] == [0, 1] and plans[1].reason == "restart", why
    assert plans[0].plan.devices == [0, 1, 2, 3] and plans[1].plan.devices == [0, 1], why
    assert [len(p.stages) for p in plans[1].plan.pipelines] == [1, 1], why
    phases = [e.phase for e in telemetry if isinstance(e, ReshapePhase) and e.epoch == 1]
    assert phases == ["new_mesh", "first_step"], why

    summaries = [e for e in telemetry if isinstance(e, IterationSummary) and e.loss is not None]
    old = [(e.iteration, e.loss) for e in summaries if e.epoch == 0]
    new = {e.iteration: e.loss for e in summaries if e.epoch == 1}
    first_round = dict(old[:5])
    assert sorted(first_round) == [1, 2, 3, 4, 5], old
    second_round = old[5:]
    assert [s for s, _ in second_round] == [4, 5], old  # resumed from step 3's checkpoint, died in step 6 again
    assert all(loss == first_round[s] for s, loss in second_round), old
    assert sorted(new) == list(range(4, STEPS + 1)), new  # the smaller world resumed from the same checkpoint
    for step in (4, 5):
        assert new[step] == pytest.approx(first_round[step], rel=1e-5), (step, new[step], first_round[step])
