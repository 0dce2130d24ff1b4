"""The local Kafka broker from infra/ starts, serves a real produce/consume round trip, and stops.

Integration test against the real thing: Maven fetches the broker once (into .kafka/lib), then a
throwaway broker runs on free loopback ports with its data dir under pytest's tmp_path. Like every
Kafka test it never skips: without Java or Maven, ``up`` fails and says which one is missing.
"""

from __future__ import annotations

import socket

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from infra import broker

pytestmark = pytest.mark.kafka


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def running_broker(tmp_path):
    data_dir = tmp_path / "kafka"
    bootstrap = broker.up(port=_free_port(), controller_port=_free_port(), data_dir=data_dir)
    try:
        yield bootstrap, data_dir
    finally:
        broker.down(data_dir)


def test_broker_round_trips_a_message_and_stops(running_broker):
    bootstrap, data_dir = running_broker

    info = broker.status(data_dir)
    assert info["running"] and info["reachable"]
    assert info["bootstrap"] == bootstrap
    assert broker.up(data_dir=data_dir) == bootstrap  # already up: no second broker

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics({"infra.smoke": {"num_partitions": 1, "replication_factor": 1}},
                            wait_for_metadata=True)
        assert "infra.smoke" in admin.list_topics()
    finally:
        admin.close()

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send("infra.smoke", key=b"rank-0", value=b"hello").get(timeout=30)
    producer.close()

    # A consumer group exercises the group coordinator and its __consumer_offsets topic, which
    # only works on one broker because the data dir's config sets its replication factor to 1.
    consumer = KafkaConsumer("infra.smoke", bootstrap_servers=bootstrap, group_id="infra-test",
                             auto_offset_reset="earliest", consumer_timeout_ms=60_000)
    try:
        received = next(iter(consumer))
    finally:
        consumer.close()
    assert (received.key, received.value) == (b"rank-0", b"hello")

    assert broker.down(data_dir) is True
    stopped = broker.status(data_dir)
    assert not stopped["running"] and not stopped["reachable"] and stopped["pid"] is None
    assert broker.down(data_dir) is False


def test_a_broker_started_for_a_supervisor_stops_when_the_supervisor_is_killed(tmp_path):
    """A test session that dies hard (SIGKILL, no fixture teardown) leaves no broker behind."""
    import os
    import signal
    import subprocess
    import time

    data_dir = tmp_path / "kafka"
    supervisor = subprocess.Popen(["sleep", "600"])
    try:
        broker.up(port=_free_port(), controller_port=_free_port(), data_dir=data_dir, die_with=supervisor.pid)
        pid = broker.status(data_dir)["pid"]
        assert pid is not None and broker.status(data_dir)["running"]
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 120  # a liveness wait (a clean Kafka shutdown), not a speed bound
        while broker.status(data_dir)["running"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not broker.status(data_dir)["running"], "the broker outlived the process it was started for"
    finally:
        supervisor.kill()
        broker.down(data_dir)


def test_a_broker_borrowed_by_a_command_is_stopped_and_deleted_when_it_ends(monkeypatch, tmp_path):
    """`resihp bench bus --backend kafka` borrows a broker: with none up on the default data dir it
    starts one of its own, tied to the process, and leaves neither the JVM nor its data behind."""
    monkeypatch.setenv("RESIHP_KAFKA_DATA_DIR", str(tmp_path / "no-broker-here"))
    with broker.borrowed() as lent:
        assert lent.started and "stopped when it ends" in lent.describe()
        admin = KafkaAdminClient(bootstrap_servers=lent.bootstrap)
        assert isinstance(admin.list_topics(), list)  # it answers
        admin.close()
        pid = broker.status(lent.data_dir)["pid"]
        assert pid is not None
    assert not lent.data_dir.exists()
    try:  # gone, or a zombie waiting to be reaped (its command line is empty then)
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except FileNotFoundError:
        cmdline = b""
    assert b"kafka" not in cmdline, f"the borrowed broker (pid {pid}) outlived the command"
