"""A Kafka consumer's positions through an outage and a rebalance: kafka-python's ``position`` may
ask a broker (and raise a connection error when none answers) or find a partition revoked since
``assignment``. The bus's consumer leaves such partitions out and marks itself down, never raises
(an analytics consumer waiting out an outage asked for them and died: tests/test_bus_outage.py is
the same on a real broker). Logic only: kafka-python's consumer is a stand-in here."""

from __future__ import annotations

import pytest
from kafka import TopicPartition as KafkaTP
from kafka.errors import AuthorizationError, IllegalStateError, KafkaConnectionError

from collector.bus import BusHealth, TopicPartition
from collector.kafka_bus import KafkaBusConsumer


class _Kafka:
    def __init__(self, answers: dict[KafkaTP, object]) -> None:
        self.answers = answers

    def assignment(self) -> set[KafkaTP]:
        return set(self.answers)

    def position(self, tp: KafkaTP, timeout_ms: int | None = None) -> int | None:
        assert timeout_ms is not None, "a position must not wait on a broker without bound"
        answer = self.answers[tp]
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]


def _consumer(answers: dict[KafkaTP, object]) -> KafkaBusConsumer:
    consumer = object.__new__(KafkaBusConsumer)
    consumer._kafka, consumer._ns, consumer.health = _Kafka(answers), "ns.", BusHealth()
    return consumer


def test_positions_leave_out_what_an_outage_or_a_rebalance_keeps_from_them() -> None:
    consumer = _consumer({KafkaTP("ns.events", 0): 7, KafkaTP("ns.events", 1): KafkaConnectionError("111 ECONNREFUSED"),
                          KafkaTP("ns.events", 2): IllegalStateError("Partition is not assigned"),
                          KafkaTP("ns.events", 3): None})
    assert consumer.positions() == {TopicPartition("events", 0): 7}
    assert consumer.health.down and "KafkaConnectionError" in consumer.health.reason


def test_positions_raise_what_a_broker_coming_back_cannot_cure() -> None:
    consumer = _consumer({KafkaTP("ns.events", 0): AuthorizationError("denied")})
    with pytest.raises(AuthorizationError):
        consumer.positions()
