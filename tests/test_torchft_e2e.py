"""A slow replica group of a torchft job found, evicted through torchft and healed back, end to end.

One run of ``resihp bench torchft``'s loop (bench/torchft.py's ``run_story``), shared by every
assertion: torchft's own lighthouse and three replica groups of torchtitan's torchft trainer (one
CPU rank each, gloo), the analytics consumer with the detector, the engine with auto-apply, on
the embedded bus. Group 1's device is ×3 slow for a few steps. The detector must name that device,
the engine's command must evict group 1 (signed, fenced, acknowledged with its phases), the other
groups must go on committing steps in a quorum of two while group 1 is out, and group 1 must come
back after its probation, healed from a peer (its step jumps to theirs) and committing in a quorum
of three again.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.torchft import SLOW_DEVICE, Story, run_story
from collector.events import (AckStatus, CommandAck, ExecutorCapabilities, IncidentOpened, PlanCurrent,
                              ReconfigureCommand, ReshapePhase)

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

STORY = Story(groups=3, warmup=8, slow_steps=8, steps=24, probation_s=4.0, timeout_s=600.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("torchft") / "run"
    result = run_story(STORY, workdir)
    result["why"] = "".join(f"\n--- {p.name}\n" + p.read_text()[-3000:]
                            for p in sorted([*(workdir / "logs").glob("*.log"), *(workdir / "job" / "logs").glob("*.log")]))
    return result


def _payloads(run: dict[str, Any], kind: type) -> list[Any]:
    return [e.payload for e in run["events"] if isinstance(e.payload, kind)]


def test_the_slow_group_is_found_evicted_by_command_and_healed_back_while_the_others_go_on(
        run: dict[str, Any]) -> None:
    why = run["why"]
    assert run["code"] == 0, why

    found = [i for i in _payloads(run, IncidentOpened) if any(loc.rank == SLOW_DEVICE for loc in i.locations)]
    assert found and found[0].category == "fail_slow", why
    assert found[0].iteration >= STORY.warmup, why

    (caps,) = _payloads(run, ExecutorCapabilities)
    assert caps.executor == "torchft" and caps.dp_drop, why
    command = _payloads(run, ReconfigureCommand)[0]
    assert SLOW_DEVICE not in command.plan.devices and command.run, why  # the engine's order, for this run
    ack = next(a for a in _payloads(run, CommandAck) if a.command_id == command.command_id)
    assert ack.status is AckStatus.APPLIED and ack.pause_s > 0, why
    phases = [(p.epoch, p.phase) for p in _payloads(run, ReshapePhase)]
    assert phases[:2] == [(command.plan.epoch, "agree"), (command.plan.epoch, "first_step")], why
    announced: list[list[int]] = []
    for p in _payloads(run, PlanCurrent):  # the ack announces the command's plan, then the executor what runs
        if not announced or announced[-1] != sorted(p.plan.devices):
            announced.append(sorted(p.plan.devices))
    assert announced[:3] == [[0, 1, 2], [0, 2], [0, 1, 2]], why  # start, evicted, healed back

    progress = run["progress"]
    slow = [p for p in progress if p["group"] == 1]
    others = [p for p in progress if p["group"] != 1]
    # out: the others commit steps in a quorum of two, and group 1 reports no step meanwhile
    shrunk = [p for p in others if p["participants"] == 2 and p["committed"]]
    assert {p["group"] for p in shrunk} == {0, 2} and len(shrunk) >= 4, why
    out_steps = {p["step"] for p in shrunk}
    assert not out_steps & {p["step"] for p in slow}, why
    # back: group 1's next step is the others' (healed from a peer), committed in a quorum of three
    left_at = max(p["step"] for p in slow if p["step"] < min(out_steps))
    back = [p for p in slow if p["step"] > left_at]
    assert back and back[0]["step"] > max(out_steps) and back[0]["participants"] == 3 and back[0]["committed"], why
    assert back[0]["ft_step"] > left_at + len(out_steps) - 1, why  # torchft's own step count came from the peer
    assert ("redistribute" in [p for _, p in phases]), why
