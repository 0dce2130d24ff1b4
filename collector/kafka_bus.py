"""The Kafka backend, through kafka-python: for jobs that outgrow one machine.

Producer: idempotent (``enable_idempotence=True``, ``acks="all"``) so a retried batch is never
written twice; ``publish`` flushes and checks every send, so it returns only when the brokers have
the batch. Keys are ``job/source``: one rank's events land in one partition, in order.
Consumers: a consumer group with manual commits; ``on_assign`` seeks to positions a consumer stored
itself (in its DuckDB transaction) whenever the group hands it partitions.
Security: with ``RESIHP_KAFKA_USERNAME`` (collector/settings.py) every client signs in with SASL
(SCRAM-SHA-256 by default) as that principal; the broker's ACLs decide what it may read and write
(docs/kafka.md). A principal without the right to create topics uses the ones that exist.
Topics are created at start-up with the admin client (replication from RESIHP_KAFKA_REPLICATION,
default 1 for the single-node broker) and the configs of ``collector.topics.TOPIC_CONFIGS`` (the
control topic keeps every record). A control topic that already exists with another retention is
left as it is and reported: changing a cluster's topic is its operator's call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka import TopicPartition as KafkaTP
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import AuthorizationError, KafkaError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from collector.bus import Bus, Consumer, OnAssign, RawMessage, Record, TopicPartition
from collector.codec import MAX_EVENT_BYTES
from collector.settings import Environment, environment
from collector.topics import ALL_TOPICS, PARTITIONS, TOPIC_CONFIGS

_JOIN_POLL_MS = 250
log = logging.getLogger(__name__)


def client_security(env: Environment | None = None) -> dict[str, str]:
    """kafka-python's SASL settings from the environment (empty: plaintext, no sign-in)."""
    env = env or environment()
    protocol = env.kafka_security_protocol or ("SASL_PLAINTEXT" if env.kafka_username else "")
    if not protocol or protocol == "PLAINTEXT":
        return {}
    if not env.kafka_username:
        raise ValueError(f"RESIHP_KAFKA_SECURITY_PROTOCOL={protocol} needs RESIHP_KAFKA_USERNAME and "
                         "RESIHP_KAFKA_PASSWORD (source a principal's env file: docs/kafka.md)")
    return {"security_protocol": protocol, "sasl_mechanism": env.kafka_sasl_mechanism,
            "sasl_plain_username": env.kafka_username, "sasl_plain_password": env.kafka_password}


def ensure_topics(bootstrap: str, topics: Sequence[str] = ALL_TOPICS, namespace: str = "",
                  security: Mapping[str, str] | None = None) -> None:
    """Create the platform's topics (under ``namespace``) if they do not exist (idempotent). A
    principal the ACLs do not let create topics logs it and goes on with those that exist."""
    replication = environment().kafka_replication
    security = client_security() if security is None else security
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="resihp-admin", **security)
    try:
        existing = set(admin.list_topics())
        missing = {
            namespace + t: {"num_partitions": PARTITIONS.get(t, 1), "replication_factor": replication,
                            "configs": dict(TOPIC_CONFIGS.get(t, {}))}
            for t in topics
            if namespace + t not in existing
        }
        if missing:
            try:
                admin.create_topics(missing, wait_for_metadata=True)
            except TopicAlreadyExistsError:
                pass  # another process created them first
            except AuthorizationError as exc:
                log.info("principal %s may not create topics %s (%s); using what exists (the admin creates them: "
                         "resihp kafka up --secure)", security.get("sasl_plain_username"), sorted(missing), exc)
                return
        for t in topics:
            if namespace + t in existing and t in TOPIC_CONFIGS:
                _report_drift(admin, namespace + t, TOPIC_CONFIGS[t])
    finally:
        admin.close()


def topic_configs(admin: KafkaAdminClient, topic: str, keys: Sequence[str]) -> dict[str, str | None]:
    """The values of ``keys`` on ``topic`` as the brokers hold them (defaults included)."""
    resource = ConfigResource(ConfigResourceType.TOPIC, topic, configs={k: None for k in keys})
    described = admin.describe_configs([resource], config_filter="all")
    entries = next(iter(next(iter(described.values())).values()))
    return {k: (entries.get(k) or {}).get("value") for k in keys}


def _report_drift(admin: KafkaAdminClient, topic: str, wanted: Mapping[str, str]) -> None:
    try:
        held = topic_configs(admin, topic, list(wanted))
    except KafkaError as exc:  # reporting only: a cluster that refuses DescribeConfigs still works
        log.warning("cannot read the configs of topic %s (%s); check that it has %s", topic, exc, dict(wanted))
        return
    for key, value in wanted.items():
        if held.get(key) != value:
            log.warning("topic %s has %s=%s, not %s: the broker may delete records the remediation lifecycle is "
                        "folded from; fix it with kafka-configs.sh --alter --entity-type topics --entity-name %s "
                        "--add-config %s=%s", topic, key, held.get(key), value, topic, key, value)


class KafkaBus(Bus):
    name = "kafka"

    def __init__(self, bootstrap: str, *, namespace: str | None = None, create_topics: bool = True,
                 security: Mapping[str, str] | None = None) -> None:
        self.bootstrap = bootstrap
        # SASL settings for every client (default: from the environment, client_security()).
        self.security = dict(client_security() if security is None else security)
        # Several environments (or tests) can share a cluster: every topic name gets this prefix.
        self.namespace = environment().kafka_namespace if namespace is None else namespace
        if create_topics:
            try:
                ensure_topics(bootstrap, namespace=self.namespace, security=self.security)
            except KafkaError as exc:
                raise ConnectionError(
                    f"cannot reach Kafka at {bootstrap} ({exc.__class__.__name__}: {exc}); start the local "
                    "broker with `resihp kafka up` or set RESIHP_KAFKA_BOOTSTRAP"
                ) from exc
        self._producer: KafkaProducer | None = None

    @property
    def producer(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                client_id="resihp-producer",
                acks="all",
                enable_idempotence=True,
                linger_ms=5,
                batch_size=512 * 1024,
                max_request_size=MAX_EVENT_BYTES + 64 * 1024,
                **self.security,
            )
        return self._producer

    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        ns = self.namespace
        futures = [self.producer.send(ns + topic, key=key, value=value) for topic, key, value in messages]
        self.producer.flush()
        for f in futures:
            if f.failed() and isinstance(f.exception, AuthorizationError):
                raise PermissionError(
                    f"Kafka refused principal {self.security.get('sasl_plain_username', 'ANONYMOUS')!r} a write "
                    f"({f.exception}); its ACLs do not allow this topic (docs/kafka.md lists who may write what)"
                ) from f.exception
            if f.failed():
                raise ConnectionError(f"Kafka did not accept a record: {f.exception}") from f.exception

    def consumer(
        self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None, instance_id: str | None = None
    ) -> Consumer:
        return KafkaBusConsumer(self.bootstrap, group, topics, on_assign, self.namespace, instance_id, self.security)

    def end_offsets(self, topics: Sequence[str]) -> dict[TopicPartition, int]:
        c = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, **self.security)
        try:
            ns = self.namespace
            tps = [KafkaTP(ns + t, p) for t in topics for p in sorted(c.partitions_for_topic(ns + t) or ())]
            return {TopicPartition(tp.topic[len(ns):], tp.partition): off for tp, off in c.end_offsets(tps).items()}
        finally:
            c.close()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None


class _SeekOnAssign(ConsumerRebalanceListener):
    def __init__(self, owner: KafkaBusConsumer, on_assign: OnAssign | None) -> None:
        self.owner = owner
        self.on_assign = on_assign

    def on_partitions_revoked(self, revoked):
        pass

    def on_partitions_assigned(self, assigned):
        if self.owner._rewind_pending and assigned:
            self.owner._kafka.seek_to_beginning(*assigned)
            self.owner._rewind_pending = False
        if self.on_assign is None or not assigned:
            return
        ours = [self.owner._logical(tp) for tp in assigned]
        self.owner.seek(self.on_assign(ours))


class KafkaBusConsumer(Consumer):
    def __init__(
        self,
        bootstrap: str,
        group: str,
        topics: Sequence[str],
        on_assign: OnAssign | None,
        namespace: str = "",
        instance_id: str | None = None,
        security: Mapping[str, str] | None = None,
    ) -> None:
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        self.group = group
        self._ns = namespace
        self._rewind_pending = False
        self._kafka = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group,
            client_id=f"resihp-{group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            group_instance_id=instance_id,
            session_timeout_ms=10_000,
            heartbeat_interval_ms=1_000,
            max_partition_fetch_bytes=8 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
            **(security or {}),
        )
        self._kafka.subscribe([namespace + t for t in topics], listener=_SeekOnAssign(self, on_assign))

    def _logical(self, tp: KafkaTP) -> TopicPartition:
        return TopicPartition(tp.topic[len(self._ns):], tp.partition)

    def _physical(self, tp: TopicPartition) -> KafkaTP:
        return KafkaTP(self._ns + tp.topic, tp.partition)

    def poll(self, max_records: int = 10_000, timeout_s: float = 1.0) -> list[Record]:
        timeout_ms = int(timeout_s * 1000)
        if not self._kafka.assignment():
            # Joining the group takes several round trips that only advance inside poll; a caller
            # that polls with timeout 0 (a simulator or trainer checking for commands between
            # iterations) would otherwise never join.
            timeout_ms = max(timeout_ms, _JOIN_POLL_MS)
        batches = self._kafka.poll(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Record] = []
        for tp, records in batches.items():
            topic = tp.topic[len(self._ns):]
            out.extend(Record(topic, tp.partition, r.offset, r.key, r.value, r.timestamp / 1000.0) for r in records)
        return out

    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        if positions is None:
            self._kafka.commit()
            return
        self._kafka.commit({self._physical(tp): OffsetAndMetadata(off, "", -1) for tp, off in positions.items()})

    def seek(self, positions: Mapping[TopicPartition, int]) -> None:
        for tp, off in positions.items():
            self._kafka.seek(self._physical(tp), off)

    def seek_to_beginning(self) -> None:
        assigned = self._kafka.assignment()
        if assigned:
            self._kafka.seek_to_beginning(*assigned)
        else:  # not joined yet: rewind as soon as the group hands us partitions
            self._rewind_pending = True

    def positions(self) -> dict[TopicPartition, int]:
        return {self._logical(tp): self._kafka.position(tp) for tp in self._kafka.assignment()}

    def close(self) -> None:
        self._kafka.close(autocommit=False)
