"""The rendezvous store, bound to one address, and the check that every agent is of one job.

torch's c10d rendezvous backend creates its TCPStore itself, and a TCPStore server listens on
every interface. The agent that hosts the rendezvous binds a socket to one address instead — the
endpoint's own address (loopback for ``localhost`` / ``127.0.0.1``, and for ``--standalone``), or
``--rdzv-bind ADDR`` — and hands it to TCPStore (``master_listen_fd``). The store the ranks
bootstrap from (MASTER_ADDR/MASTER_PORT, created by the rank-0 node's rendezvous handler) is bound
the same way, to the node's address.

Which agent hosts: ``is_host`` from ``--rdzv-conf`` when given, else an agent with ``--node-rank 0``
whose endpoint names this machine; if the port is already taken (another agent of the job on the
same machine hosts it), the agent joins as a client, as torchrun does.

The job check: the host writes the rendezvous id under ``resihp/rdzv-id``; a client whose id
differs stops with an error naming both, where torch would wait out the join timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

JOB_KEY = "resihp/rdzv-id"
DEFAULT_PORT = 29400
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


class AgentError(RuntimeError):
    """A problem the user can fix (the message says how); printed as one line."""


@dataclass
class RendezvousStore:
    store: dist.TCPStore
    host: str
    port: int
    hosting: bool
    bound: str | None  # the address the hosted store listens on; None when this agent is a client


def bind_address(host: str, bind: str | None) -> str:
    """The address the hosting agent listens on: ``bind`` if given, loopback for loopback names,
    else the endpoint host's own address."""
    if bind:
        return bind
    if host in LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def listen_on(address: str, port: int) -> socket.socket | None:
    """A listening socket on ``address:port``, or None when the port is taken."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise AgentError(f"cannot listen on {address}:{port} for the rendezvous ({exc.strerror}); pass "
                         "--rdzv-bind with an address of this machine") from exc
    sock.listen(1024)
    return sock


def serve_store(address: str, sock: socket.socket, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on ``sock`` (bound and listening): the store takes the descriptor and its
    server closes it when the store is destroyed, so this process lets go of it (``detach``).
    Closed here as well, the second close would hit whatever file or socket took that number in
    the meantime: a checkpoint being read, a bus connection."""
    port = sock.getsockname()[1]
    return dist.TCPStore(address, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=sock.detach())


def bound_store_server(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    sock = listen_on(address, port)
    if sock is None:
        raise AgentError(f"port {port} on {address} is taken; pass a free port in --rdzv-endpoint")
    return serve_store(address, sock, timeout_s)


def open_rendezvous_store(endpoint: str, run_id: str, *, hosts: bool | None, node_rank: int, bind: str | None,
                          timeout_s: float) -> RendezvousStore:
    """Host the rendezvous store (bound to one address) or connect to it, and check the job id."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    if hosts is None:
        hosts = node_rank == 0 and (host in LOOPBACK_NAMES or _matches_machine_hostname(host))
    if hosts:
        address = bind_address(host, bind)
        sock = listen_on(address, port)
        if sock is not None:
            port = sock.getsockname()[1]
            store = serve_store(address, sock, timeout_s)
            store.set(JOB_KEY, run_id)
            return RendezvousStore(store, host, port, True, address)
    if port == 0:
        raise AgentError(f"rendezvous endpoint {endpoint} has port 0, which only the hosting agent may use; "
                         "give the port the node-rank 0 agent printed")
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError, dist.DistError) as exc:
        raise AgentError(f"cannot reach the rendezvous store at {host}:{port} within {timeout_s:g} s; check "
                         "--rdzv-endpoint and that the node-rank 0 agent is running") from exc
    try:
        store.wait([JOB_KEY], timedelta(seconds=timeout_s))
        other = store.get(JOB_KEY).decode()
    except (RuntimeError, TimeoutError, dist.DistError) as exc:
        raise AgentError(f"the store at {host}:{port} is not a resihp rendezvous (no {JOB_KEY} within "
                         f"{timeout_s:g} s); check --rdzv-endpoint") from exc
    if other != run_id:
        raise AgentError(f"the rendezvous at {host}:{port} belongs to job {other!r}, not {run_id!r}; every agent "
                         "of a job passes the same --rdzv-id")
    return RendezvousStore(store, host, port, False, None)


def make_handler(rdzv: RendezvousStore, params: RendezvousParameters, node_address: str | None,
                 timeout_s: float) -> RendezvousHandler:
    """torch's dynamic rendezvous handler over our store; the ranks' bootstrap store it creates on
    the rank-0 node listens on ``node_address`` only (all interfaces when None)."""
    handler = create_handler(rdzv.store, C10dRendezvousBackend(rdzv.store, params.run_id), params)
    bind_bootstrap_store(handler, node_address, timeout_s)
    return handler


def bind_bootstrap_store(handler: RendezvousHandler, node_address: str | None, timeout_s: float) -> None:
    """Make the ranks' bootstrap store that torch's dynamic handler creates on the rank-0 node
    listen on ``node_address`` only (all interfaces when None)."""
    if node_address is None:
        return

    def create_server(_addr: str, port: int) -> dist.TCPStore:
        return bound_store_server(node_address, port, timeout_s)

    # torch names this a private method; it is the one place the bootstrap store is created.
    setattr(handler, "_create_tcp_store_server", create_server)  # noqa: B010


def leave_rendezvous(handler: RendezvousHandler) -> bool:
    """Take this node out of the job's rendezvous without closing it (``shutdown`` closes it for
    every node): for an agent whose node the job no longer runs on. The others' next round then
    waits for no keep-alive of ours to expire. Uses torch's own exit step of ``next_rendezvous``
    (private to its dynamic handler); False where the handler has none, and the keep-alive then
    expires on its own."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    executor = getattr(handler, "_op_executor", None)
    stop = getattr(handler, "_stop_heartbeats", None)
    if executor is None or stop is None:
        return False
    stop()
    executor.run(dyn._RendezvousExitOp(), time.monotonic() + 30)  # torch's private step
    return True


def forget_bootstrap_store(handler: RendezvousHandler) -> Any:
    """Before each rendezvous round: make the next round create a new bootstrap store.

    torch's handler creates the ranks' bootstrap store once and hands the same one to every round,
    while the ranks assume a new store per attempt (torch/distributed/rendezvous.py says so) and
    gloo reads its peers' addresses from it. After a restart the new ranks then read the dead
    ranks' addresses and fail to connect ("connectFullMesh failed … Connection refused"), restart
    after restart. Dropping the handler's cached store and address makes the rank-0 node create a
    fresh store and every node read its address from the new round. Returns the last round's store
    server (None on other nodes): it closes when dropped, so a caller that keeps it serves it on."""
    served = getattr(handler, "_shared_tcp_store_server", None)
    if hasattr(handler, "_bootstrap_store_info"):
        setattr(handler, "_bootstrap_store_info", None)  # noqa: B010 - torch's private cache
        setattr(handler, "_shared_tcp_store_server", None)  # noqa: B010
    return served
