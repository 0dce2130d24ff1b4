"""The presence listener listens on one interface, never on every one (trainer/agent/presence.py):
the address the agent was given, else the one this host reaches the rendezvous store from."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tests.test_agent_run import free_port
from trainer.agent.presence import AgentPresence, listen_address
from trainer.agent.signed_store import SignedStore


def test_an_agent_given_no_address_listens_where_it_reaches_a_loopback_store_and_registers_that() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=10), wait_for_workers=False)
    records = SignedStore(dist.PrefixStore("round-1", store), "round", reader="agent-0")
    presence = AgentPresence(records, 0, 2, (0, 1), None)
    try:
        host, port = presence.listener.getsockname()[:2]
        assert host == "127.0.0.1"  # not 0.0.0.0: a stranger on the network cannot reach it
        peer = AgentPresence(SignedStore(dist.PrefixStore("round-1", store), "round", reader="agent-1"), 1, 2, (2, 3),
                             None)
        try:
            assert peer.poll() == []  # the registration names where it listens, and a peer connects there
            assert 0 in peer.watched
        finally:
            peer.close(finished=True)
    finally:
        presence.close(finished=True)


def test_a_given_address_is_used_as_it_is_and_no_store_means_loopback() -> None:
    assert listen_address("10.1.2.3", None) == "10.1.2.3"
    assert listen_address(None, object()) == "127.0.0.1"

    class Store:  # a TCPStore's host and port, on another loopback address: reached from 127.0.0.1
        host, port = "127.0.0.2", 29500

    assert listen_address(None, Store()) == "127.0.0.1"
