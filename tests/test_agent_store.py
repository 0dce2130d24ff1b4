"""The rendezvous store owns the socket the agent binds for it (trainer/agent/store.py).

TCPStore's server closes the listening descriptor it is handed when the store is destroyed. An
agent that also closed its own handle on it closed the number twice, and the store's late close hit
whatever had taken the number in between (a test's torch.load failed with EBADF)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from trainer.agent.standalone import standalone_node
from trainer.agent.store import listen_on, serve_store


def test_a_store_takes_the_descriptor_it_serves_on() -> None:
    sock = listen_on("127.0.0.1", 0)
    assert sock is not None
    fd = sock.fileno()
    store = serve_store("127.0.0.1", sock, timeout_s=5)
    assert sock.fileno() == -1  # this process keeps no handle on it
    os.fstat(fd)  # the store still listens on it
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_a_finished_node_closes_nothing_another_file_took(tmp_path: Path) -> None:
    with standalone_node("127.0.0.1", "store-owner", 5) as node:
        node.store.set("k", "v")
    with open(tmp_path / "after", "wb") as f:  # takes the lowest free descriptor
        del node
        gc.collect()  # the store goes, and its server closes its own socket
        f.write(b"still mine")
    assert (tmp_path / "after").read_bytes() == b"still mine"
