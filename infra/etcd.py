"""An etcd cluster from Debian's ``etcd-server`` on loopback, for the multi-node rendezvous.

:func:`start_cluster` starts N members (three by default: one may die and the quorum holds) on
free loopback ports with their data under a work directory, and waits until each answers
``/health``. Each member is bound to the process that started it (Linux ``PR_SET_PDEATHSIG``,
SIGKILL): if the tests or ``resihp bench agent`` die, so does the cluster. :meth:`EtcdCluster.kill`
kills one member (what the tests and the benchmark do to prove the job trains on), and
:meth:`EtcdCluster.stop` stops them all.

A production cluster is not started this way: it runs on three or five hosts of its own,
managed by systemd, Kubernetes or the site's tooling (docs/agent.md, multi-node).

What can go wrong: the binary is missing (install Debian's ``etcd-server``: ``make test`` does), a
member exits at start (the error holds the end of its log).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BINARY = "etcd"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def argv(self, cluster: str, token: str) -> list[str]:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        return [BINARY, "--name", self.name, "--data-dir", str(self.data_dir), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                peer, "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token",
                token, "--logger", "zap", "--log-level", "warn"]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    members: list[Member] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """``host:port,...`` of every member: what ``resihp run --rdzv-endpoint`` takes."""
        return ",".join(m.endpoint for m in self.members)

    def kill(self, index: int) -> None:
        """SIGKILL one member (as a host failure would end it)."""
        member = self.members[index]
        if member.alive():
            assert member.process is not None
            member.process.kill()
            member.process.wait()

    def leader(self) -> int:
        """The index of the member that leads the cluster now (as the live members see it)."""
        for member in self.members:
            if not member.alive():
                continue
            request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=2.0) as r:
                status = json.loads(r.read())
            ids = {self._member_id(m): i for i, m in enumerate(self.members) if m.alive()}
            if status.get("leader") in ids:
                return ids[status["leader"]]
        raise RuntimeError("no live etcd member names a live leader")

    @staticmethod
    def _member_id(member: Member) -> str:
        request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=2.0) as r:
            return str(json.loads(r.read())["header"]["member_id"])

    def stop(self, grace_s: float = 10.0) -> None:
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                member.process.terminate()
        for member in self.members:
            if member.process is None:
                continue
            try:
                member.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()


def missing_binary() -> bool:
    return shutil.which(BINARY) is None


def start_cluster(workdir: Path, members: int = 3, timeout_s: float = 30.0) -> EtcdCluster:
    """Start ``members`` etcd members on loopback under ``workdir`` and wait until each is healthy."""
    if missing_binary():
        raise RuntimeError("etcd is not installed; install Debian's etcd-server (make etcd)")
    workdir.mkdir(parents=True, exist_ok=True)
    ports = _free_ports(2 * members)
    cluster = EtcdCluster([Member(f"m{i}", ports[2 * i], ports[2 * i + 1], workdir / f"m{i}.etcd",
                                  workdir / f"m{i}.log") for i in range(members)])
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in cluster.members)
    token = uuid.uuid4().hex
    try:
        for member in cluster.members:
            with open(member.log_path, "ab") as log:
                member.process = subprocess.Popen(member.argv(initial, token), stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        for member in cluster.members:
            _wait_healthy(member, deadline, timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_healthy(member: Member, deadline: float, timeout_s: float) -> None:
    while True:
        assert member.process is not None
        if member.process.poll() is not None:
            raise RuntimeError(f"etcd member {member.name} exited with {member.process.returncode} at start; its log "
                               f"{member.log_path} ends:\n" + member.log_path.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://{member.endpoint}/health", timeout=1.0) as r:
                if r.status == 200 and b'"true"' in r.read():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"etcd member {member.name} was not healthy within {timeout_s:.0f} s; see "
                               f"{member.log_path}")
        time.sleep(0.05)
