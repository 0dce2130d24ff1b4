"""The platform's Kafka topics carry the configs it needs, on a real broker: the control topic, which
the remediation lifecycle is folded from, keeps every record; one that exists with the broker's
default retention is reported, not silently trusted (and not changed behind its operator's back)."""

from __future__ import annotations

import logging
import uuid

import pytest
from kafka import KafkaAdminClient

from collector import topics
from collector.kafka_bus import ensure_topics, topic_configs

pytestmark = pytest.mark.kafka


def test_the_control_topic_keeps_every_record_and_the_others_take_the_cluster_default(kafka_bootstrap) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(kafka_bootstrap, namespace=namespace)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        assert topic_configs(admin, namespace + topics.CONTROL, ["retention.ms"]) == {"retention.ms": "-1"}
        (telemetry,) = topic_configs(admin, namespace + topics.TELEMETRY, ["retention.ms"]).values()
        assert telemetry is not None and int(telemetry) > 0  # the broker's default (7 days)
    finally:
        admin.close()


def test_a_control_topic_created_with_a_retention_is_reported_and_left_alone(kafka_bootstrap, caplog) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}."
    control = namespace + topics.CONTROL
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics({control: {"num_partitions": 1, "replication_factor": 1}}, wait_for_metadata=True)
        with caplog.at_level(logging.WARNING, logger="collector.kafka_bus"):
            ensure_topics(kafka_bootstrap, namespace=namespace)
        (held,) = topic_configs(admin, control, ["retention.ms"]).values()
        assert held != "-1"
        assert (f"topic {control} has retention.ms={held}, not -1: the broker may delete records the remediation "
                "lifecycle is folded from" in caplog.text)
        assert f"--entity-name {control} --add-config retention.ms=-1" in caplog.text
    finally:
        admin.close()
