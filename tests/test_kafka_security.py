"""Kafka security on the real broker the project starts (``up --secure``): SASL/SCRAM-SHA-256
principals over TLS and StandardAuthorizer ACLs (TLS itself, groups and secrets: test_kafka_tls.py). An unauthorised principal's write is refused by Kafka
itself; an authorised one lands. The platform's own client (collector/kafka_bus.py) signs in."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from collector import topics
from collector.bus import RawMessage
from collector.codec import encode
from collector.events import EventFactory, Heartbeat
from collector.plan import Plan
from tests.fixtures.signing import factory as signing_factory
from trainer.integration import new_command
from collector.kafka_bus import KafkaBus
from infra import broker
from infra import kafka_security as security

pytestmark = pytest.mark.kafka


@pytest.fixture
def secure_broker(secure_kafka):
    if not broker.status(secure_kafka["data_dir"])["running"]:  # a test before stopped it
        broker.up(port=secure_kafka["port"], controller_port=secure_kafka["controller_port"],
                data_dir=secure_kafka["data_dir"], secure=True, die_with=os.getpid())
    return secure_kafka["bootstrap"], secure_kafka["data_dir"], secure_kafka["creds"]


def _bus(bootstrap: str, data_dir: Path, user: str) -> KafkaBus:
    return KafkaBus(bootstrap, namespace="", security=security.principal_config(data_dir, user))


def test_the_broker_tool_knows_the_platforms_topics() -> None:
    assert security.TOPICS == topics.ALL_TOPICS


def test_a_telemetry_writer_writes_telemetry_and_kafka_refuses_it_the_control_topic(secure_broker) -> None:
    bootstrap, data_dir, creds = secure_broker
    assert broker.status(data_dir)["secure"] and broker.status(data_dir)["reachable"]
    admin = _bus(bootstrap, data_dir, security.ADMIN)
    before = admin.end_offsets([topics.TELEMETRY, topics.CONTROL])
    rank = _bus(bootstrap, data_dir, "telemetry")
    try:
        hb = EventFactory("j", "rank-3").make(Heartbeat(rank=3, epoch=0, iteration=1, interval_s=1.0))
        assert rank.publish([hb]) == 1  # topic creation is not its right: it uses the topics that exist
        forged = RawMessage(topics.CONTROL, b"j/mallory", b'{"kind": "command.reconfigure"}')
        with pytest.raises(PermissionError, match="'telemetry'.*TopicAuthorization"):
            rank.publish_raw([forged])
        with pytest.raises(PermissionError):
            rank.publish_raw([RawMessage(topics.ANALYTICS, b"j/mallory", b"{}")])
    finally:
        rank.close()
    engine = _bus(bootstrap, data_dir, "engine")
    try:
        engine.publish_raw([RawMessage(topics.CONTROL, b"j/engine", uuid.uuid4().bytes)])  # the engine may
        with pytest.raises(PermissionError):
            engine.publish_raw([RawMessage(topics.TELEMETRY, b"j/engine", b"{}")])
    finally:
        engine.close()
    after = admin.end_offsets([topics.TELEMETRY, topics.CONTROL])
    admin.close()
    grew = {tp.topic: after[tp] - before[tp] for tp in after if after[tp] != before[tp]}
    assert grew == {topics.TELEMETRY: 1, topics.CONTROL: 1}  # the refused writes left nothing


def test_every_principal_gets_an_env_file_the_platform_signs_in_with(secure_broker, monkeypatch) -> None:
    bootstrap, data_dir, creds = secure_broker
    env_file = Path(data_dir) / security.CREDENTIALS_DIR / "console.env"
    assert env_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    for line in env_file.read_text().splitlines():
        key, value = line.split("=", 1)
        monkeypatch.setenv(key, value)
    bus = KafkaBus(bootstrap, namespace="")
    try:
        assert bus.security["sasl_plain_username"] == "console"
        assert [tp.topic for tp in bus.end_offsets([topics.CONTROL])] == [topics.CONTROL]
    finally:
        bus.close()


def test_only_the_engine_and_the_trainer_may_write_the_commands_topic_kafka_refuses_the_rest(secure_broker) -> None:
    """A command a trainer obeys comes from the commands topic; Kafka itself refuses a telemetry,
    analytics or console principal's write there, even of a command signed with a valid key."""
    bootstrap, data_dir, _ = secure_broker
    admin = _bus(bootstrap, data_dir, security.ADMIN)
    before = admin.end_offsets([topics.COMMANDS])
    plan = Plan.uniform(tp=1, pp=1, dp=2, num_layers=2, microbatches_per_replica=2).model_copy(update={"epoch": 1})
    command = signing_factory("j", "remediation", "engine").make(new_command(plan))
    for user in ("telemetry", "analytics", "console"):
        bus = _bus(bootstrap, data_dir, user)
        try:
            with pytest.raises(PermissionError, match=f"'{user}'.*TopicAuthorization"):
                bus.publish_raw([RawMessage(topics.COMMANDS, b"j/remediation", encode(command))])
        finally:
            bus.close()
    engine = _bus(bootstrap, data_dir, "engine")
    try:
        assert engine.publish([command]) == 1  # to the commands topic, and its record to control
    finally:
        engine.close()
    after = admin.end_offsets([topics.COMMANDS])
    admin.close()
    assert sum(after.values()) - sum(before.values()) == 1  # only the engine's landed
