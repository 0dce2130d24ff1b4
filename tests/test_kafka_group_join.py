"""A consumer whose group join completed while no poll was waiting for it still gets its partitions.

kafka-python 3 leaves a join in flight when ``poll`` times out during it, for the next poll to
collect. When that join was started because the topic's metadata changed (the group leader had
assigned before the topic's partitions were known: a topic created just after the consumer
subscribed, as a fresh broker's topics often are), the leader's assignment of the new join records
the new metadata, so the next poll finds nothing to rejoin for and never collects the finished
join: the member holds no partition for ever. Seen as a shard that never read the merge's fits, a
live run stalled after its first iteration. Here on a real broker, the state is made on purpose —
the topic appears after the first join, one poll of 1 ms starts the rejoin and gives up — and the
bus's consumer must come out of it with its partitions.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from collector.kafka_bus import KafkaBusConsumer

pytestmark = pytest.mark.kafka


def _stuck(consumer: KafkaBusConsumer) -> bool:
    """kafka-python's coordinator holds a finished join nobody will collect."""
    coordinator = consumer._kafka._coordinator
    task = coordinator._join_task
    return task is not None and task.is_done and not coordinator.need_rejoin() and not consumer._kafka.assignment()


ATTEMPTS = 5  # the state hangs on a 1 ms poll giving up before the join ends: a loaded machine can miss it


def _make_stuck(kafka_bootstrap: str, admin: KafkaAdminClient) -> KafkaBusConsumer | None:
    """A fresh consumer left holding a finished join nobody will collect, or None (closed) when
    this attempt's poll of 1 ms collected the join after all."""
    topic = f"j{uuid.uuid4().hex[:10]}"
    consumer = KafkaBusConsumer(kafka_bootstrap, f"g{uuid.uuid4().hex[:8]}", ["events"], None, namespace=f"{topic}.")
    kafka = consumer._kafka
    deadline = time.monotonic() + 60
    try:
        while not kafka._coordinator.stable():  # the first join: the topic does not exist yet
            assert time.monotonic() < deadline, "the first join did not complete"
            kafka.poll(timeout_ms=100)
        assert not kafka.assignment()
        admin.create_topics([NewTopic(f"{topic}.events", 2, 1)])
        while not kafka._coordinator.need_rejoin():  # the topic's metadata arrives: the leader must reassign
            assert time.monotonic() < deadline, "the new topic's metadata never reached the consumer"
            time.sleep(0.05)
        kafka.poll(timeout_ms=1)  # starts the rejoin and gives up on it at once
        while not (kafka._coordinator._join_task is None or kafka._coordinator._join_task.is_done):
            assert time.monotonic() < deadline, "the rejoin did not finish"
            time.sleep(0.05)
    except BaseException:
        consumer.close()
        raise
    if _stuck(consumer):
        return consumer
    consumer.close()
    return None


def test_a_join_finished_after_its_poll_gave_up_is_collected(kafka_bootstrap) -> None:
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    consumer = None
    try:
        for _ in range(ATTEMPTS):
            if (consumer := _make_stuck(kafka_bootstrap, admin)) is not None:
                break
        assert consumer is not None, (f"kafka-python collected the join by itself in {ATTEMPTS} attempts: the bus's "
                                      "workaround can go")
        kafka = consumer._kafka
        deadline = time.monotonic() + 60
        while not kafka.assignment():
            assert time.monotonic() < deadline, "the bus's consumer never got its partitions"
            consumer.poll(100, 0.1)
        assert {tp.partition for tp in kafka.assignment()} == {0, 1}
    finally:
        admin.close()
        if consumer is not None:
            consumer.close()
