"""The etcd client's edges, without a cluster: endpoint lists, members that answer garbage or
nothing, and ``resihp run --rdzv-backend etcd``'s one-line errors (the cluster itself:
tests/test_agent_etcd.py)."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from trainer.agent.etcd_client import EtcdClient, EtcdError, EtcdUnavailable, parse_endpoints
from trainer.agent.etcd_store import EtcdStore, open_store_address
from trainer.agent.launch import run_agent
from trainer.agent.options import agent_parser
from trainer.spec import BusSpec


def test_an_endpoint_list_reads_as_host_port_pairs_and_a_bad_one_is_named() -> None:
    assert parse_endpoints("a:1, http://b:2,c,[::1]:5") == (("a", 1), ("b", 2), ("c", 2379), ("::1", 5))
    for bad, why in (("", "no etcd endpoint"), ("a:x", "'a:x' is not host:port"),
                     ("https://a:1", "plain HTTP"), ("a:99999", "'a:99999' is not host:port")):
        with pytest.raises(ValueError, match=why):
            parse_endpoints(bad)


def test_a_store_address_names_its_members_and_prefix() -> None:
    store = open_store_address("etcd://h1:1,h2:2/resihp/rdzv/j/ranks/r.0/", 5.0)
    assert store.client.endpoints == (("h1", 1), ("h2", 2)) and store.prefix == "/resihp/rdzv/j/ranks/r.0/"
    with pytest.raises(ValueError, match="not etcd://"):
        open_store_address("tcp://h1:1", 5.0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_nobody_answers_is_a_store_error_naming_every_member() -> None:
    ports = [closed_port(), closed_port()]
    client = EtcdClient([("127.0.0.1", p) for p in ports], timeout_s=0.3)
    with pytest.raises(EtcdUnavailable, match="no etcd member answered") as caught:
        EtcdStore(client, "/x/").add("n", 1)
    assert all(f"127.0.0.1:{p}: unreachable" in str(caught.value) for p in ports)


ANSWERS = {  # what a broken member (or a stranger on its port) might send back
    "not json": (200, b"\xff\xfe<html>"),
    "not an object": (200, b"[1, 2]"),
    "kvs of the wrong type": (200, b'{"kvs": "oops"}'),
    "a key that is not base64": (200, b'{"kvs": [{"key": "***", "value": "", "mod_revision": "1"}]}'),
    "a revision that is not a number": (200, b'{"kvs": [{"key": "", "value": "", "mod_revision": "x"}]}'),
    "a refusal": (400, b'{"error": "etcdserver: bad request", "code": 3}'),
    "deep nesting": (200, b"[" * 100_000),
}


@pytest.fixture
def broken_member() -> Iterator[tuple[int, dict[str, tuple[int, bytes]]]]:
    """An HTTP server on loopback (a thread of this process) that answers every request with
    the bytes the test puts in ``answer["now"]``."""
    answer: dict[str, tuple[int, bytes]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, body = answer["now"]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1], answer
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("what", sorted(ANSWERS))
def test_any_answer_of_a_member_is_an_error_naming_it_never_a_crash(
        broken_member: tuple[int, dict[str, tuple[int, bytes]]], what: str) -> None:
    port, answer = broken_member
    answer["now"] = ANSWERS[what]
    client = EtcdClient([("127.0.0.1", port)], timeout_s=0.2)
    with pytest.raises((EtcdError, EtcdUnavailable)) as caught:
        client.get(b"/k")
    assert str(caught.value) and "\n" not in str(caught.value)


def agent_args(*flags: str) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", "j", "--no-telemetry", *flags,
            "-m", "trainer.agent.sample_job"]


@pytest.mark.parametrize(("flags", "line"), [
    (("--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1,h:x"),
     "error: --rdzv-endpoint: etcd endpoint 'h:x' is not host:port"),
    (("--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{closed_port()}", "--rdzv-conf", "read_timeout=1"),
     "error: cannot reach the etcd cluster at 127.0.0.1:"),
    (("--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379"),
     "error: --rdzv-backend etcd-v2 needs etcd's v2 API and python-etcd; pass --rdzv-backend etcd"),
])
def test_a_bad_etcd_rendezvous_is_one_line_and_exit_2(flags: tuple[str, ...], line: str) -> None:
    args = agent_parser().parse_args(agent_args(*flags))
    lines: list[str] = []
    assert run_agent(args, BusSpec(), lines.append) == 2
    assert len(lines) == 1 and lines[0].startswith(line), lines
