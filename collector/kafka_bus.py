"""The Kafka backend, through kafka-python: for jobs that outgrow one machine.

Producer: idempotent (``enable_idempotence=True``, ``acks="all"``) so a retried batch is never
written twice; ``publish`` flushes and checks every send, so it returns only when the brokers have
the batch. Keys are ``job/source``: one rank's events land in one partition, in order; a rank
report's key ``job/replica-D`` goes to the partition ``collector.topics.replica_partition`` says
(``ReplicaPartitioner``), so each partition holds an even share of a job's replicas.
Consumers: a consumer group with manual commits; ``on_assign`` seeks to positions a consumer stored
itself (in its DuckDB transaction) whenever the group hands it partitions.
Security: with ``RESIHP_KAFKA_USERNAME`` (collector/settings.py) every client signs in with SASL
(SCRAM-SHA-256 by default) as that principal; the broker's ACLs decide what it may read and write
(docs/kafka.md). A principal without the right to create topics uses the ones that exist. Over
``SASL_SSL`` (or ``SSL``) clients trust the CA of ``RESIHP_KAFKA_SSL_CAFILE`` (else the system's)
and check the broker's name; before its first client a bus shakes hands with a broker itself, so a
certificate that does not verify is named as such at once, not as a broker that never answered.
Outages: a broker that goes away never stops a process. ``publish`` retries what the brokers did
not take, with back-off, until they take it (``RESIHP_KAFKA_OUTAGE_LIMIT_S`` bounds the wait; 0, the
default, waits for ever), and a consumer's ``poll`` and ``commit`` ride it out; both mark the bus's
``BusHealth`` down on the connection errors and up again, so a consumer can say an outage happened
and suspend what missing data would mislead (analytics/service/consumer.py). A retried batch may land
twice (the broker may have written it before the connection broke): consumers dedupe on event id.
Topics are created at start-up with the admin client (replication from RESIHP_KAFKA_REPLICATION,
default 1 for the single-node broker) and the configs of ``collector.topics.TOPIC_CONFIGS`` (the
control topic keeps every record). A control topic that already exists with another retention is
left as it is and reported: changing a cluster's topic is its operator's call.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from pathlib import Path
from collections.abc import Mapping, Sequence

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka import TopicPartition as KafkaTP
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.partitioner import DefaultPartitioner
from kafka.errors import (
    AuthorizationError, CommitFailedError, IllegalGenerationError, IllegalStateError, KafkaConnectionError, KafkaError,
    KafkaTimeoutError, RebalanceInProgressError, TopicAlreadyExistsError, UnknownMemberIdError,
)
from kafka.structs import OffsetAndMetadata

from collector.bus import Bus, BusHealth, Consumer, OnAssign, RawMessage, Record, TopicPartition
from collector.codec import MAX_EVENT_BYTES
from collector.settings import Environment, environment
from collector.topics import ALL_TOPICS, PARTITIONS, TOPIC_CONFIGS, replica_partition, to_every_partition

_JOIN_POLL_MS = 250
_POSITION_MS = 1_000  # how long a position may wait on a broker before the partition is left out
_record = tuple.__new__  # a Record from (topic, partition, offset, key, value, timestamp_s)
# The producer's delivery settings: one home for the bus and the benchmarks' raw clients, which
# measure the bus against kafka-python alone on the same terms (bench/bus.py, bench/_sim_publish.py).
PRODUCER_SETTINGS: dict[str, object] = {
    "acks": "all", "enable_idempotence": True, "linger_ms": 5, "batch_size": 512 * 1024,
    "max_request_size": MAX_EVENT_BYTES + 64 * 1024,
}
_RETRY_MAX_S = 5.0  # the longest back-off between two tries of a publish during an outage
_FLUSH_TIMEOUT_S = 30.0  # twice the producer's delivery timeout
log = logging.getLogger(__name__)


PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


def client_security(env: Environment | None = None) -> dict[str, str | bool]:
    """kafka-python's SASL and TLS settings from the environment (empty: plaintext, no sign-in)."""
    env = env or environment()
    protocol = env.kafka_security_protocol or ("SASL_PLAINTEXT" if env.kafka_username else "")
    if protocol and protocol not in PROTOCOLS:
        raise ValueError(f"RESIHP_KAFKA_SECURITY_PROTOCOL={protocol} is not one of {', '.join(PROTOCOLS)}")
    if not protocol or protocol == "PLAINTEXT":
        return {}
    settings: dict[str, str | bool] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        if not env.kafka_username:
            raise ValueError(f"RESIHP_KAFKA_SECURITY_PROTOCOL={protocol} needs RESIHP_KAFKA_USERNAME and "
                             "RESIHP_KAFKA_PASSWORD (source a principal's env file: docs/kafka.md)")
        settings.update(sasl_mechanism=env.kafka_sasl_mechanism, sasl_plain_username=env.kafka_username,
                        sasl_plain_password=env.kafka_password)
    if protocol.endswith("SSL"):
        if env.kafka_ssl_cafile and not Path(env.kafka_ssl_cafile).is_file():
            raise ValueError(f"RESIHP_KAFKA_SSL_CAFILE={env.kafka_ssl_cafile} is not a file; point it at the CA "
                             "certificate that signed the brokers' (`resihp kafka up --secure` writes "
                             "<data dir>/tls/ca.pem)")
        if env.kafka_ssl_cafile:
            settings["ssl_cafile"] = env.kafka_ssl_cafile
        settings["ssl_check_hostname"] = True
    return settings


def tls_refusal(bootstrap: str, security: Mapping[str, object], timeout_s: float = 5.0) -> str | None:
    """Why a TLS client with ``security`` cannot trust the first bootstrap broker that answers (its
    certificate does not verify against the CA, or names another host), or None when it can or no
    broker answers (then kafka-python's own bootstrap reports it)."""
    cafile = security.get("ssl_cafile")
    context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        host = host or "127.0.0.1"
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
                with context.wrap_socket(raw, server_hostname=host):
                    return None
        except ssl.SSLCertVerificationError as exc:
            trusted = f"the CA in {cafile}" if cafile else "the system's CAs (RESIHP_KAFKA_SSL_CAFILE is not set)"
            return (f"the broker at {address.strip()} presented a certificate that does not verify against {trusted}: "
                    f"{exc.verify_message}; set RESIHP_KAFKA_SSL_CAFILE to the CA that signed it (`resihp kafka up "
                    "--secure` writes <data dir>/tls/ca.pem; source the principal's env file)")
        except ssl.SSLError as exc:
            return (f"the broker at {address.strip()} does not complete a TLS handshake ({exc.reason}); it may speak "
                    "PLAINTEXT or SASL_PLAINTEXT: set RESIHP_KAFKA_SECURITY_PROTOCOL to what its listener speaks")
        except (OSError, ValueError):
            continue
    return None


def speaks_tls(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True if the first bootstrap broker that answers completes a TLS handshake (whoever signed
    its certificate): why a plaintext client's bootstrap never got an answer."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only asks whether it is TLS
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s) as raw:
                with context.wrap_socket(raw):
                    return True
        except ssl.SSLError:
            return False
        except (OSError, ValueError):
            continue
    return False


def ensure_topics(bootstrap: str, topics: Sequence[str] = ALL_TOPICS, namespace: str = "",
                  security: Mapping[str, object] | None = None) -> None:
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


class ReplicaPartitioner(DefaultPartitioner):
    """Kafka's default partitioner, except for replica-keyed records (``job/replica-D``), which go
    where ``collector.topics.replica_partition`` says: an even share of a job's replicas per partition."""

    def partition(self, topic, key, serialized_key, value, serialized_value, cluster):
        partitions = cluster.partitions_for_topic(topic) or ()
        index = replica_partition(serialized_key, len(partitions))
        if index is None:
            return super().partition(topic, key, serialized_key, value, serialized_value, cluster)
        return sorted(partitions)[index]


class KafkaBus(Bus):
    name = "kafka"

    def __init__(self, bootstrap: str, *, namespace: str | None = None, create_topics: bool = True,
                 security: Mapping[str, object] | None = None) -> None:
        self.bootstrap = bootstrap
        # SASL and TLS settings for every client (default: from the environment, client_security()).
        self.security: dict = dict(client_security() if security is None else security)
        # Several environments (or tests) can share a cluster: every topic name gets this prefix.
        self.namespace = environment().kafka_namespace if namespace is None else namespace
        if str(self.security.get("security_protocol", "")).endswith("SSL"):
            refusal = tls_refusal(bootstrap, self.security)
            if refusal:
                raise ConnectionError(f"cannot trust Kafka at {bootstrap}: {refusal}")
        if create_topics:
            try:
                ensure_topics(bootstrap, namespace=self.namespace, security=self.security)
            except KafkaError as exc:
                hint = "start the local broker with `resihp kafka up` or set RESIHP_KAFKA_BOOTSTRAP"
                if not str(self.security.get("security_protocol", "")).endswith("SSL") and speaks_tls(bootstrap):
                    hint = ("the broker speaks TLS and this client does not: set RESIHP_KAFKA_SECURITY_PROTOCOL="
                            "SASL_SSL and RESIHP_KAFKA_SSL_CAFILE (source the principal's env file: docs/kafka.md)")
                raise ConnectionError(
                    f"cannot reach Kafka at {bootstrap} ({exc.__class__.__name__}: {exc}); {hint}") from exc
        self._producer: KafkaProducer | None = None
        self.health = BusHealth()

    @property
    def producer(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                client_id="resihp-producer",
                partitioner=ReplicaPartitioner(),
                **PRODUCER_SETTINGS,
                # An outage shows within seconds (then publish_raw retries), not after Kafka's minutes.
                max_block_ms=5_000,
                request_timeout_ms=5_000,
                delivery_timeout_ms=15_000,
                **self.security,
            )
        return self._producer

    def publish_raw(self, messages: Sequence[RawMessage]) -> None:
        """Return once the brokers hold every message; through an outage, retry with back-off."""
        pending = list(messages)
        limit_s = environment().kafka_outage_limit_s
        started, delay_s = time.monotonic(), 0.25
        while pending:
            try:
                pending = self._send(pending)
            except KafkaError as exc:
                if not _retriable(exc):
                    raise ConnectionError(f"Kafka did not accept a record: {exc}") from exc
                self._drop_producer()  # a fresh one re-bootstraps when the brokers are back
                self.health.mark_down(f"publish: {exc.__class__.__name__}: {exc}")
            if not pending:
                break
            if limit_s and time.monotonic() - started > limit_s:
                raise ConnectionError(f"Kafka at {self.bootstrap} took no records for {limit_s:g} s "
                                      f"({self.health.reason}); raise RESIHP_KAFKA_OUTAGE_LIMIT_S or check the brokers")
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, _RETRY_MAX_S)
        self.health.mark_up()

    def _send(self, messages: list[RawMessage]) -> list[RawMessage]:
        """Send and flush; returns the messages to try again (their send failed and may succeed)."""
        ns, producer = self.namespace, self.producer
        futures = []
        for m in messages:
            if to_every_partition(m.key):  # one copy per partition of its topic, one event id
                futures += [(m, producer.send(ns + m.topic, key=m.key, value=m.value, partition=p))
                            for p in sorted(producer.partitions_for(ns + m.topic))]
            else:
                futures.append((m, producer.send(ns + m.topic, key=m.key, value=m.value)))
        # Bounded: after a broker restart kafka-python can leave a batch that neither completes nor
        # expires; the timeout (KafkaTimeoutError) drops that producer and the batch goes again.
        producer.flush(timeout=_FLUSH_TIMEOUT_S)
        again: list[RawMessage] = []
        for m, f in futures:
            if not f.failed():
                continue
            if isinstance(f.exception, AuthorizationError):
                raise PermissionError(
                    f"Kafka refused principal {self.security.get('sasl_plain_username', 'ANONYMOUS')!r} a write "
                    f"({f.exception}); its ACLs do not allow this topic (docs/kafka.md lists who may write what)"
                ) from f.exception
            if not _retriable(f.exception):
                raise ConnectionError(f"Kafka did not accept a record: {f.exception}") from f.exception
            self.health.mark_down(f"publish: {f.exception.__class__.__name__}: {f.exception}")
            if not again or again[-1] is not m:  # a record sent to every partition goes again once
                again.append(m)
        if again:
            self._drop_producer()
        return again

    def _drop_producer(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=0)
            except Exception:  # closing a broken producer may fail any way; it is dropped
                log.debug("closing the producer after an outage failed", exc_info=True)
            self._producer = None

    def consumer(
        self, group: str, topics: Sequence[str], on_assign: OnAssign | None = None, instance_id: str | None = None
    ) -> Consumer:
        consumer = KafkaBusConsumer(self.bootstrap, group, topics, on_assign, self.namespace, instance_id,
                                    self.security)
        consumer.health = self.health
        return consumer

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


# A commit refused because the group is (re)forming, as it does after a broker restart: not fatal.
_MEMBERSHIP_ERRORS = (CommitFailedError, RebalanceInProgressError, IllegalGenerationError, UnknownMemberIdError)


def _retriable(exc: BaseException | None) -> bool:
    """An error that a broker coming back can cure (connection, timeout, no leader, no metadata)."""
    if isinstance(exc, AuthorizationError):
        return False
    return isinstance(exc, (KafkaTimeoutError, KafkaConnectionError, OSError)) or bool(
        getattr(exc, "retriable", False))


def reachable(bootstrap: str, timeout_s: float = 0.5) -> bool:
    """True if any bootstrap broker accepts a connection (a broker process that is gone refuses it)."""
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
            return True
        except (OSError, ValueError):
            continue
    return False


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
        security: Mapping[str, object] | None = None,
    ) -> None:
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        self.group = group
        self._principal = str((security or {}).get("sasl_plain_username", "ANONYMOUS"))
        self._ns = namespace
        self._bootstrap = bootstrap
        self.health = BusHealth()  # KafkaBus.consumer shares its bus's
        self._probed_at = 0.0
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

    def _rejoining(self) -> bool:
        """The group is rebalancing and this member must join again (kafka-python's coordinator)."""
        coordinator = getattr(self._kafka, "_coordinator", None)
        return bool(coordinator is not None and coordinator.need_rejoin())

    def joining(self) -> bool:
        return not self._kafka.assignment() or self._rejoining()

    def poll(self, max_records: int = 10_000, timeout_s: float = 1.0) -> list[Record]:
        timeout_ms = int(timeout_s * 1000)
        if self.joining():
            # Joining the group takes several round trips that only advance inside poll; a caller
            # that polls with timeout 0 (a simulator or trainer checking for commands between
            # iterations, a shard waiting on the merge) would otherwise never join — nor finish a
            # rebalance, keeping partitions a departed member left unread by anyone.
            timeout_ms = max(timeout_ms, _JOIN_POLL_MS)
        try:
            batches = self._kafka.poll(timeout_ms=timeout_ms, max_records=max_records)
        except AuthorizationError as exc:
            raise PermissionError(
                f"Kafka refused principal {self._principal!r} consumer group {self.group!r} or its topics ({exc}); "
                "each principal may use only its own group names and read only its topics (docs/kafka.md)") from exc
        except KafkaError as exc:
            if not _retriable(exc):
                raise
            self.health.mark_down(f"poll: {exc.__class__.__name__}: {exc}")
            time.sleep(min(timeout_s, 1.0))
            return []
        self._probe(bool(batches))
        self._collect_finished_join()
        out: list[Record] = []
        for tp, records in batches.items():
            topic, partition = tp.topic[len(self._ns):], tp.partition
            # tuple.__new__: a NamedTuple's own __new__ is a Python call a record
            out += [_record(Record, (topic, partition, r.offset, r.key, r.value, r.timestamp / 1000.0)) for r in records]
        return out

    def _collect_finished_join(self) -> None:
        """Ask for a rejoin when kafka-python holds a finished group join that no poll will collect.

        A poll that times out during a join leaves it in flight for the next poll. When the join
        was started because the topics' metadata changed (the leader had assigned before the
        partitions were known: a topic created just after the consumer subscribed), the leader's
        new assignment records that metadata, so the next poll sees nothing to rejoin for and never
        applies the join's result: the member keeps the partitions of the join before — none, at
        start-up — for ever (kafka-python 3.0; a shard that never read the merge's fits stalled a
        live run after its first iteration). A rejoin asked for then is one more rebalance, and
        the member gets its partitions (tests/test_kafka_group_join.py)."""
        coordinator = getattr(self._kafka, "_coordinator", None)
        task = getattr(coordinator, "_join_task", None)
        # kafka-python clears the task when a poll collects it: one done and still held was left
        if coordinator is not None and task is not None and getattr(task, "is_done", False) \
                and not coordinator.need_rejoin():
            log.info("group %s: a finished join was never applied; rejoining", self.group)
            coordinator.request_rejoin()

    def _probe(self, delivered: bool) -> None:
        """Records prove the brokers are there; with none, look (at most once a second) whether the
        brokers accept connections: kafka-python reconnects quietly, so an empty poll alone cannot
        tell an idle log from a gone broker."""
        if delivered:
            self.health.mark_up()
            return
        now = time.monotonic()
        if now - self._probed_at < 1.0:
            return
        self._probed_at = now
        if reachable(self._bootstrap):
            self.health.mark_up()
        else:
            self.health.mark_down(f"no broker of {self._bootstrap} accepts connections")

    def commit(self, positions: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit the group's offsets. Through an outage this logs and returns: the next commit
        carries later offsets, and a restart in between re-reads a little (consumers dedupe)."""
        offsets = None if positions is None else {
            self._physical(tp): OffsetAndMetadata(off, "", -1) for tp, off in positions.items()}
        try:
            self._kafka.commit(offsets, timeout_ms=5_000)
        except _MEMBERSHIP_ERRORS as exc:  # the group rebalanced meanwhile: the partitions' owner goes on
            log.warning("group %s: offsets not committed (%s); the next owner resumes from the last commit",
                        self.group, exc)
        except KafkaError as exc:
            if not _retriable(exc):
                raise
            self.health.mark_down(f"commit: {exc.__class__.__name__}: {exc}")

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
        """The next offset of each partition this member holds and can tell now. kafka-python may
        ask a broker for a position (a committed offset, a leader's epoch to validate), which in an
        outage raises a connection error, and a rebalance can revoke a partition between the two
        calls: such partitions are left out (every caller reads a missing partition as not read
        or not ours yet) and an outage marks the bus down, as a poll does."""
        out: dict[TopicPartition, int] = {}
        for tp in self._kafka.assignment():
            try:
                position = self._kafka.position(tp, timeout_ms=_POSITION_MS)
            except IllegalStateError:  # revoked meanwhile
                continue
            except KafkaError as exc:
                if not _retriable(exc):
                    raise
                self.health.mark_down(f"position: {exc.__class__.__name__}: {exc}")
                continue
            if position is not None:
                out[self._logical(tp)] = position
        return out

    def close(self) -> None:
        self._kafka.close(autocommit=False)
