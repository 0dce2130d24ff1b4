"""Agents see each other die (trainer/agent/presence.py): real sockets over a real TCPStore.

Every agent runs in this process here; what is under test is what the kernel does with a closed
socket and what the one-byte goodbye means, not process death (tests/test_agent_shrink.py kills
real agents).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from tests.test_agent_run import free_port
from trainer.agent.presence import AgentPresence, PeerAgent
from trainer.agent.signed_store import SignedStore


def poll_until_settled(presence: AgentPresence, rounds: int = 200) -> list[PeerAgent]:
    """Poll until nothing more is connected or lost (a bounded number of tries, not a time bound)."""
    died: list[PeerAgent] = []
    for _ in range(rounds):
        died += presence.poll()
        time.sleep(0.005)
    return died


def three_agents() -> list[AgentPresence]:
    store = dist.TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=10), wait_for_workers=False)
    return [AgentPresence(SignedStore(store, "round", reader=f"agent-{g}"), g, 3, (2 * g, 2 * g + 1), "127.0.0.1")
            for g in range(3)]


def test_an_agent_that_closes_without_a_goodbye_is_reported_once_by_each_peer_with_its_ranks() -> None:
    agents = three_agents()
    for a in agents:
        poll_until_settled(a)
    agents[2].close(finished=False)
    for survivor in agents[:2]:
        died = poll_until_settled(survivor)
        assert [(p.group_rank, p.ranks) for p in died] == [(2, (4, 5))]
        assert poll_until_settled(survivor, rounds=5) == []  # reported once
    for a in agents[:2]:
        a.close(finished=True)


def test_an_agent_that_finished_is_not_taken_for_dead() -> None:
    agents = three_agents()
    for a in agents:
        poll_until_settled(a)
    agents[1].close(finished=True)
    assert poll_until_settled(agents[0]) == [] and poll_until_settled(agents[2]) == []
    for a in (agents[0], agents[2]):
        a.close(finished=True)
