"""One node's job under the node agent on loopback: the launcher both executors' ranks run under.

``resihp train`` (trainer/reference/launcher.py) and the native executor (trainer/native/worker.py) start
their ranks the same way: a standalone :class:`NodeAgent` hosts the rendezvous store on loopback
(the ranks find the job's own keys there too, so any rank may die and the survivors still meet),
forks one rank per device from a server that imported the executor once, and hands every exit to
the job's :class:`JobController` each monitor pass — or, for a job whose ranks recover as under
``resihp run --on-failure shrink`` (the native executor's), marks a dead rank lost itself, so
those ranks find their store, keys and loss count the same way in both. The store is opened first
(:func:`standalone_node`) because the ranks' arguments and the controller need its port and
client; :meth:`StandaloneNode.run` then runs the ranks to their end.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from trainer.agent.node import AgentSettings, JobController, NodeAgent
from trainer.agent.store import RendezvousStore, make_handler, open_rendezvous_store


@dataclass
class StandaloneNode:
    """The rendezvous store this node hosts (``store`` is its client, ``port`` where ranks connect)
    and what :meth:`run` needs to start the agent over it."""

    rdzv: RendezvousStore
    handler: Any
    host: str
    work_dir: Path

    @property
    def store(self) -> dist.Store:
        return self.rdzv.store

    @property
    def port(self) -> int:
        return self.rdzv.port

    def run(self, *, job: str, role: str, ranks: int, entrypoint: Callable[..., Any], args: tuple,
            preload: tuple[str, ...], controller: JobController | None, poll_s: float,
            on_failure: str = "restart") -> dict[int, int]:
        """Run ``ranks`` ranks of ``entrypoint(*args)`` (forked from a server that imported
        ``preload``; the entrypoint must live in one of those modules) until all have exited,
        calling ``controller.watch`` every ``poll_s``; returns each exited rank's code.
        ``on_failure="shrink"``: the agent marks a rank that dies lost in the ranks' store, as
        ``resihp run --on-failure shrink`` does, and its peers go on (the native executor's ranks,
        trainer/native/worker.py); otherwise a death is the controller's to handle."""
        worker = WorkerSpec(role=role, local_world_size=ranks, entrypoint=entrypoint, args=args,
                            rdzv_handler=self.handler, max_restarts=0, monitor_interval=poll_s)
        settings = AgentSettings(job=job, node_label=os.uname().nodename, work_dir=self.work_dir, preload=preload,
                                 controller=controller, job_store=self.rdzv.store, hosts_rendezvous=True,
                                 on_failure=on_failure, node_address=self.host)
        agent = NodeAgent(worker, DefaultLogsSpecs(log_dir=str(self.work_dir / "logs")), settings)
        with signal_handlers_kept():
            agent.run()
        return agent.exits()


@contextmanager
def standalone_node(host: str, run_id: str, timeout_s: float) -> Iterator[StandaloneNode]:
    """Host the job's rendezvous store on ``host`` (a free port) with torch's handler over it;
    shut the handler down and remove the agent's work directory on the way out (the store stops
    listening when it is destroyed: it owns its socket, trainer/agent/store.py). Fails when the
    store cannot bind."""
    rdzv = open_rendezvous_store(f"{host}:0", run_id, hosts=True, node_rank=0, bind=None, timeout_s=timeout_s)
    work_dir = Path(tempfile.mkdtemp(prefix="resihp-agent-"))
    handler = None
    try:
        params = RendezvousParameters(backend="c10d", endpoint=f"{rdzv.host}:{rdzv.port}", run_id=run_id,
                                      min_nodes=1, max_nodes=1, local_addr=host)
        handler = make_handler(rdzv, params, host, timeout_s)
        yield StandaloneNode(rdzv, handler, host, work_dir)
    finally:
        if handler is not None:
            handler.shutdown()
        shutil.rmtree(work_dir, ignore_errors=True)


@contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """torch's process context turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception that
    stops the ranks; put the caller's handlers back afterwards (the launchers run inside programs
    and test runners that keep going)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, previous in kept.items():
            signal.signal(sig, previous)


__all__ = ["StandaloneNode", "signal_handlers_kept", "standalone_node"]
