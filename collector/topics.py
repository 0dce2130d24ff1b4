"""Topic names, which kind goes where, and the keys that keep one rank's events in order.

Five topics keep the hot path apart from the control path: telemetry is large and steady; the
analytics topic carries what the detector derived; control carries the low-volume lifecycle
(plans, decisions, commands, acknowledgements, probes); commands carries the orders a trainer
obeys; truth carries ground truth from the simulator and failure injection, on a topic of its own
so that no detector reads it by accident. Invalid records go to the dead-letter topic with their
reason.

Why commands have a topic of their own: Kafka authorises writes per topic, not per event kind, and
the control topic must be writable by the trainer (acknowledgements), analytics (probe requests)
and the console (decisions). A trainer takes ``command.reconfigure``, and a node agent
``command.node``, only from the commands topic, which only the engine (and the trainer itself, for
its own on-death policy) may write, so the broker refuses a forged command before any signature is
checked (infra/kafka_security.py).

A command is also written to the control topic, as the lifecycle's record: every reader that folds
plans (the engine, the console, analytics) reads proposal → decision → command → ack in the order
of one partition there, which two topics could not give. Both copies have one event id; a fold
reads the control copy only (a reader of the whole run reads :data:`RECORD_TOPICS`), and a trainer
acts on the commands copy only (:func:`obeyed_from`).
"""

from __future__ import annotations

import zlib

TELEMETRY = "resihp.telemetry"
ANALYTICS = "resihp.analytics"
CONTROL = "resihp.control"
COMMANDS = "resihp.commands"
TRUTH = "resihp.truth"
DEADLETTER = "resihp.deadletter"
ALL_TOPICS: tuple[str, ...] = (TELEMETRY, ANALYTICS, CONTROL, COMMANDS, TRUTH, DEADLETTER)

# Kafka partitions per topic; telemetry scales out with the analytics consumer group.
PARTITIONS: dict[str, int] = {TELEMETRY: 8, ANALYTICS: 2, CONTROL: 1, COMMANDS: 1, TRUTH: 1, DEADLETTER: 1}

# Kafka topic configs the platform sets when it creates a topic. The control topic is the remediation
# lifecycle's record, folded from its first event by the engine and the console: the broker's
# default retention (7 days) would delete a long job's plans and commands, so it keeps everything.
# The other topics take the cluster's retention (telemetry is most of the bytes).
TOPIC_CONFIGS: dict[str, dict[str, str]] = {CONTROL: {"retention.ms": "-1"}}

_TOPIC_BY_PREFIX: dict[str, str] = {
    "telemetry": TELEMETRY,
    "analytics": ANALYTICS,
    "incident": ANALYTICS,
    "probe": CONTROL,
    "plan": CONTROL,
    "policy": CONTROL,
    "command": CONTROL,
    "node": CONTROL,
    "control": CONTROL,
    "ui": CONTROL,
    "truth": TRUTH,
    "deadletter": DEADLETTER,
}


def topic_for(kind: str) -> str:
    """The topic an event kind is published to (its prefix before the first dot decides)."""
    try:
        return _TOPIC_BY_PREFIX[kind.split(".", 1)[0]]
    except KeyError:
        raise ValueError(f"no topic for event kind {kind!r}; known prefixes: {sorted(_TOPIC_BY_PREFIX)}") from None


# What a reader that records the whole run reads (the demo's watcher, its trace): every topic but
# the commands topic, whose orders are copies, same event ids, of the control topic's records. A
# fold that met the copy first (poll order across topics is any order) would take the command
# before its proposal, report it unknown and then drop the record as a duplicate.
RECORD_TOPICS: tuple[str, ...] = tuple(t for t in ALL_TOPICS if t != COMMANDS)

# What a trainer reads: probe requests on control, commands on their own topic.
TRAINER_TOPICS: tuple[str, ...] = (CONTROL, COMMANDS)

# kind -> the topic a trainer obeys it from, where that is not (only) its own topic
_ORDERS: dict[str, str] = {"command.reconfigure": COMMANDS, "command.node": COMMANDS}


_ROUTES: dict[str, tuple[str, ...]] = {}  # kind -> its topics, for the kinds met so far (every publish and read asks)
_ROUTES_MAX = 4096  # the platform has ~50 kinds; a stranger's made-up ones are not kept


def topics_for(kind: str) -> tuple[str, ...]:
    """Every topic an event of ``kind`` is published to: its own, and the commands topic for an order."""
    routes = _ROUTES.get(kind)
    if routes is None:
        own = topic_for(kind)
        order = _ORDERS.get(kind)
        routes = (own, order) if order is not None else (own,)
        if len(_ROUTES) < _ROUTES_MAX:
            _ROUTES[kind] = routes
    return routes


def misplaced(kind: str, topic: str) -> str | None:
    """Why an event of ``kind`` read from ``topic`` is not to be used (None: it belongs there).

    Why: the broker authorises writes per topic (infra/kafka_security.py), so the topic a record was
    read from says which principal could have written it. A decision or a command read from the
    telemetry topic was written by whoever may write telemetry; a reader that took it there would
    give every rank writer a path to every control reader's parser and signature check. Topics this
    module does not name (a test's, a user's) are not judged."""
    if topic not in ALL_TOPICS:
        return None
    try:
        home = topics_for(kind)
    except ValueError:
        home = ()
    if topic in home:
        return None
    return f"{kind} is never published to {topic} (it belongs on {', '.join(home) or 'no topic'}); read as misplaced"


def obeyed_from(kind: str) -> str:
    """The one topic a trainer may take an event of ``kind`` from and act on."""
    return _ORDERS.get(kind) or topic_for(kind)


REPLICA_KEY = "/replica-"  # a rank report's key: job/replica-D
EVERY_PARTITION = "/*"  # the key of a record every partition gets a copy of: job/*
_TO_EVERY_PARTITION = frozenset({"telemetry.tracing"})


_EVERY_PARTITION = EVERY_PARTITION.encode()


def to_every_partition(key: bytes | None) -> bool:
    """Whether a record's key asks for a copy in every partition of its topic (``job/*``).

    Why: a tracing declaration says which ranks and steps report. Every analytics shard needs it
    (a shard that does not know a rank is untraced waits for its reports for ever), but a keyed
    record lands in one partition, so one member of the group would read it. The copies share
    one event id: a reader of the whole topic applies it once."""
    return key is not None and (key if type(key) is bytes else bytes(key)).endswith(_EVERY_PARTITION)


def replica_partition(key: bytes | None, partitions: int) -> int | None:
    """The partition of a replica-keyed record (``job/replica-D``): the job's CRC-32, plus D, modulo
    the topic's partitions. None for any other key (it is hashed as Kafka's default does).

    Why not the key's hash: a job's replicas are a handful of keys, and hashing a handful into
    partitions is uneven. 32 replicas of job ``bench`` hash to 8 partitions as 5, 2, 5, 2 | 8, 4, 4, 2:
    of two shards one held 18 replicas and the other 14, and the lighter one waited for the other
    every iteration. Consecutive replicas in consecutive partitions give every partition
    ⌊dp/P⌋ or ⌈dp/P⌉ of them; the job's offset spreads several jobs' replica 0 apart. Every producer
    of a job's telemetry must use this rule (``collector.kafka_bus`` does): a replica split over
    two partitions would be held by two shards, and neither would see it complete."""
    if key is None or partitions <= 0:
        return None
    job, sep, replica = bytes(key).rpartition(REPLICA_KEY.encode())
    if not sep or not replica.isdigit():
        return None
    return (zlib.crc32(job) + int(replica)) % partitions


def key_for(job: str, source: str) -> bytes:
    """Partition key: one source's events (one rank's, say) land in one partition, in order."""
    return f"{job}/{source}".encode()



class PartitionKeys:
    """Partition keys of what one producer publishes. A rank report (telemetry.iteration) is keyed
    by its DP replica, ``job/replica-D``: all of a replica's reports land in one partition, so one
    member of the analytics consumer group holds whole replicas (docs/analytics-scaling.md); which
    partition is ``replica_partition``'s rule, not the key's hash.

    A heartbeat follows its rank's reports: keyed by the replica of the last report this producer
    published for that rank. The detector reads a heartbeat that says a rank started iteration i+2
    as "report i is lost", which is only sound while the two share a partition, in order. A
    heartbeat sent before the rank's first report (nothing to overtake yet) keeps the rank's own
    key. A tracing declaration goes to every partition (``to_every_partition``). Everything else
    keeps its per-source key."""

    def __init__(self) -> None:
        self._replica: dict[tuple[str, int], int] = {}

    def key(self, job: str, source: str, kind: str, payload: object) -> bytes:
        if kind in _TO_EVERY_PARTITION:
            return f"{job}{EVERY_PARTITION}".encode()
        if kind == "telemetry.iteration":
            coords, rank = getattr(payload, "coords", None), getattr(payload, "rank", None)
            if coords is not None:
                if rank is not None:
                    self._replica[(job, rank)] = coords.dp
                return f"{job}{REPLICA_KEY}{coords.dp}".encode()
        elif kind == "telemetry.heartbeat":
            replica = self._replica.get((job, getattr(payload, "rank", -1)))
            if replica is not None:
                return f"{job}{REPLICA_KEY}{replica}".encode()
        return key_for(job, source)
