"""A slow node found, drained out of the job by the engine's order, and a waiting spare joined in
its place: the whole platform on loopback (bench/nodes.py runs it and prints its figures).

Real processes on one embedded bus: two ``resihp run`` agents of two ranks (c10d, ``--on-failure
shrink``) training the sample job with ``--report``, a spare agent waiting for an order, the
analytics consumer, the engine under the auto policy with node plans on. Node 1 turns ×3 slow
(the node: the spare that replaces it is healthy). What must come of it: both of node 1's ranks
found slow; one node plan, its stop and the spare's join issued with its command (the shrinking
world's devices leave only with their node); the stop drains node 1's ranks at a step boundary;
the executor acknowledges the layout; the spare takes the place and the world is four ranks again;
nothing planned afterwards against the machine that left; every step run exactly once (the final
model is the one-process reference's); nothing left running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.nodes import run_story
from collector.events import AckStatus
from tests.test_agent_run import alive
from trainer.agent.sample_job import reference_state

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py


def test_a_slow_node_is_drained_out_by_the_engines_order_and_a_spare_takes_its_place(tmp_path: Path) -> None:
    import torch

    story = run_story(tmp_path / "work", steps=400, slow_from=30, after_steps=10, timeout_s=500)
    logs = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in story.logs.items())
    assert {(i.locations[0].rank, i.category.value) for i in story.incidents if i.severity.value == "high"} == {
        (2, "fail_slow"), (3, "fail_slow")}, logs
    proposal = story.proposal
    assert proposal is not None, logs
    stop, join = proposal.node_orders
    assert (stop.action, stop.node, join.action, join.node) == ("stop", 1, "join", 1)
    assert stop.with_command and join.with_command and join.spare == story.spares[0].spare
    assert sorted(proposal.plan.devices) == [0, 1]
    assert len(story.proposals) == 1, [p.diff for p in story.proposals]  # nothing against the machine that left
    assert [(a.status, a.epoch) for a in story.acks] == [(AckStatus.APPLIED, 1)], story.acks
    assert "ranks [2, 3] left the world with their node" in story.acks[0].detail
    by_action = {a.action: a for a in story.node_acks}
    assert by_action["stop"].status == AckStatus.APPLIED and "left the world at a step boundary" in by_action["stop"].detail
    assert by_action["join"].status == AckStatus.APPLIED and by_action["join"].ranks == [2, 3]
    assert [s.waiting for s in story.spares][-1] is False  # the spare took the place and said so
    worlds = story.worlds
    two = worlds.index(2)
    assert set(worlds[:two]) == {4} and worlds[-1] == 4 and set(worlds[two:]) <= {2, 3, 4}, worlds
    assert story.final_state is not None and story.final_state.exists(), logs
    final = torch.load(story.final_state, weights_only=True)
    for name, tensor in reference_state(len(worlds)).items():  # one progress row per step: every step once
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
    assert alive([int(p.name) for p in (tmp_path / "work" / "pids").iterdir()]) == []
