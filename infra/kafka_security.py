"""Kafka security for the local broker: SASL/SCRAM-SHA-256 principals and StandardAuthorizer ACLs.

``python -m infra.broker up --secure`` (``resihp kafka up --secure``) starts the broker with:

- the client listener on SASL_PLAINTEXT with SCRAM-SHA-256 (loopback only, so no TLS: the
  password never crosses the wire, SCRAM sends proofs, and the traffic never leaves the host);
- the KRaft controller listener on SASL_PLAINTEXT with PLAIN for the one ``admin`` user (SCRAM
  cannot authenticate the controller: its credentials live in the metadata the controller
  serves), so no local process reaches the controller anonymously;
- ``StandardAuthorizer`` (KRaft's) with ``allow.everyone.if.no.acl.found=false``: a principal
  may do only what an ACL below grants. ``admin`` is the only super user (the broker itself and
  the ``resihp kafka`` tool, which creates the topics).

SCRAM credentials are written into the metadata log when the data dir is formatted
(``kafka-storage format --add-scram``), so a secure broker needs a fresh data dir; passwords are
random, kept in ``<data dir>/credentials.json`` (mode 0600), and written as one env file per
principal under ``<data dir>/credentials/`` (source it, and the platform's Kafka clients sign in
as that principal: collector/settings.py reads ``RESIHP_KAFKA_USERNAME`` and friends).

Kafka authorises per topic, not per event kind, so the grants follow what each part publishes
(collector/topics.py routes kinds to topics). The commands topic — the only one a trainer takes
``command.reconfigure`` from — is written by the engine alone, and by the trainer principal for the
launcher's own on-death policy. The control topic carries the lifecycle's record: the engine's
plans (and a copy of each command), the console's decisions, the trainer's acknowledgements,
``plan.current`` and probe results, and the analytics consumer's probe requests. Telemetry writers
(ranks, node agents) are the untrusted many: they can write the telemetry topic and nothing else.
Which control event came from whom is the signature check's job (docs/security.md); the ACLs stop
everyone else from writing at all.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

ADMIN = "admin"
MECHANISM = "SCRAM-SHA-256"
CREDENTIALS_FILE = "credentials.json"
CREDENTIALS_DIR = "credentials"
SECURE_MARKER = "secure"  # in the data dir: the storage was formatted with SCRAM users

# The platform's topics (collector/topics.py; infra imports none of our packages, and
# tests/test_kafka_security.py checks the two lists agree).
TELEMETRY, ANALYTICS, CONTROL, COMMANDS, TRUTH, DEADLETTER = (
    "resihp.telemetry", "resihp.analytics", "resihp.control", "resihp.commands", "resihp.truth", "resihp.deadletter")
TOPICS = (TELEMETRY, ANALYTICS, CONTROL, COMMANDS, TRUTH, DEADLETTER)

# principal -> (topics it may write, topics it may read). Readers also read every consumer group.
GRANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "telemetry": ((TELEMETRY,), ()),  # ranks and node agents: telemetry, nothing else
    # acks, plan.current, probe results; commands only for the launcher's own on-death policy
    "trainer": ((TELEMETRY, TRUTH, CONTROL, COMMANDS, DEADLETTER), (CONTROL, COMMANDS)),
    "analytics": ((ANALYTICS, CONTROL, DEADLETTER), (TELEMETRY, ANALYTICS, CONTROL)),  # incidents, probes
    "engine": ((CONTROL, COMMANDS, DEADLETTER), (ANALYTICS, CONTROL)),  # plans; commands
    "console": ((CONTROL, DEADLETTER), TOPICS),  # decisions, policies; reads everything
}
PRINCIPALS = (ADMIN, *GRANTS)


def load_or_create_credentials(data_dir: Path) -> dict[str, str]:
    """principal -> password, created once per data dir (mode 0600) and reused on every start."""
    path = data_dir / CREDENTIALS_FILE
    if path.exists():
        creds: dict[str, str] = json.loads(path.read_text())
        missing = [p for p in PRINCIPALS if p not in creds]
        if missing:
            raise ValueError(f"{path} lacks principals {missing}; it was written by another version. Start the "
                             "secure broker on a fresh --data-dir")
        return creds
    creds = {p: secrets.token_urlsafe(18) for p in PRINCIPALS}
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(creds, f)
    return creds


def format_args(creds: dict[str, str]) -> list[str]:
    """``kafka-storage format`` arguments that store every principal's SCRAM credential."""
    out: list[str] = []
    for user, password in creds.items():
        out += ["--add-scram", f"{MECHANISM}=[name={user},password={password}]"]
    return out


def server_properties(admin_password: str) -> dict[str, str]:
    """The template values of infra/server.properties for a secure broker."""
    plain = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
             f'username="{ADMIN}" password="{admin_password}" user_{ADMIN}="{admin_password}";')
    scram = ("org.apache.kafka.common.security.scram.ScramLoginModule required "
             f'username="{ADMIN}" password="{admin_password}";')
    security = "\n".join([
        "# Security (infra/kafka_security.py): SCRAM-SHA-256 clients, PLAIN admin-only controller, ACLs.",
        f"sasl.enabled.mechanisms={MECHANISM}",
        f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
        f"listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config={scram}",
        "sasl.mechanism.controller.protocol=PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
        f"listener.name.controller.plain.sasl.jaas.config={plain}",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{ADMIN}",
    ])
    return {"client_listener": "SASL_PLAINTEXT", "controller_protocol": "SASL_PLAINTEXT", "security": security}


def client_config(user: str, password: str) -> dict[str, Any]:
    """kafka-python client settings that sign in as ``user``."""
    return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": MECHANISM,
            "sasl_plain_username": user, "sasl_plain_password": password}


def env_lines(bootstrap: str, user: str, password: str) -> str:
    """The environment that makes the platform's Kafka clients sign in as ``user``."""
    return (f"RESIHP_BUS=kafka\nRESIHP_KAFKA_BOOTSTRAP={bootstrap}\nRESIHP_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT\n"
            f"RESIHP_KAFKA_SASL_MECHANISM={MECHANISM}\nRESIHP_KAFKA_USERNAME={user}\nRESIHP_KAFKA_PASSWORD={password}\n")


def write_env_files(data_dir: Path, bootstrap: str, creds: dict[str, str]) -> Path:
    """One ``<principal>.env`` per principal (mode 0600) under ``<data dir>/credentials``."""
    folder = data_dir / CREDENTIALS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    for user, password in creds.items():
        path = folder / f"{user}.env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(env_lines(bootstrap, user, password))
    return folder


def apply_acls(bootstrap: str, creds: dict[str, str], namespace: str = "") -> int:
    """Create the ACLs of ``GRANTS`` for topics under ``namespace`` (idempotent); returns how many."""
    from kafka.admin import (
        ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, KafkaAdminClient, ResourcePattern, ResourceType,
    )

    def allow(user: str, op: ACLOperation, rtype: ResourceType, name: str) -> ACL:
        return ACL(principal=f"User:{user}", host="*", operation=op, permission_type=ACLPermissionType.ALLOW,
                   resource_pattern=ResourcePattern(rtype, name, ACLResourcePatternType.LITERAL))

    acls = []
    for user, (writes, reads) in GRANTS.items():
        for topic in writes:
            acls += [allow(user, ACLOperation.WRITE, ResourceType.TOPIC, namespace + topic),
                     allow(user, ACLOperation.DESCRIBE, ResourceType.TOPIC, namespace + topic)]
        for topic in reads:
            acls += [allow(user, ACLOperation.READ, ResourceType.TOPIC, namespace + topic),
                     allow(user, ACLOperation.DESCRIBE, ResourceType.TOPIC, namespace + topic)]
        if reads:
            acls.append(allow(user, ACLOperation.READ, ResourceType.GROUP, "*"))
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="resihp-acl", **client_config(ADMIN, creds[ADMIN]))
    try:
        result = admin.create_acls(acls)
    finally:
        admin.close()
    if result["failed"]:
        raise RuntimeError(f"Kafka refused {len(result['failed'])} of {len(acls)} ACLs: {result['failed'][:3]}")
    return len(acls)
