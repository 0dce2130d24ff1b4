"""Kafka security for the local broker: SASL over TLS, SCRAM-SHA-256 principals, StandardAuthorizer ACLs.

``python -m infra.broker up --secure`` (``resihp kafka up --secure``) starts the broker with:

- every listener on ``SASL_SSL``: TLS with a certificate from the platform's own CA
  (infra/tls.py, ``<data dir>/tls/``) for ``localhost`` and ``127.0.0.1``, which clients verify
  (``RESIHP_KAFKA_SSL_CAFILE``, hostname checked);
- the platform's principals sign in with SCRAM-SHA-256. Their credentials are created after the
  broker starts, through the admin API (``AlterUserScramCredentials``, as ``admin``), never on a
  command line: ``ps`` shows no password of any process the start runs;
- ``admin`` signs in with SASL ``PLAIN`` against the broker's own config (the only ``user_`` entry
  of its JAAS login), on the client listener and on the KRaft controller listener, which takes
  nobody else (SCRAM cannot authenticate the controller: its credentials live in the metadata the
  controller serves). ``admin`` is the broker itself and the ``resihp kafka`` tool;
- ``StandardAuthorizer`` (KRaft's) with ``allow.everyone.if.no.acl.found=false``: a principal may
  do only what an ACL below grants. ``admin`` is the only super user.

Secrets are files only their owner reads: the data dir is 0700; ``server.properties`` (which holds
``admin``'s password and the broker's TLS key), ``credentials.json`` (every password) and the
principals' env files under ``credentials/`` are 0600. Source one env file and the platform's
Kafka clients sign in as that principal (collector/settings.py reads ``RESIHP_KAFKA_USERNAME``
and friends).

Kafka authorises per topic, not per event kind, so the grants follow what each part publishes
(collector/topics.py routes kinds to topics). The commands topic — the only one a trainer takes
``command.reconfigure`` from — is written by the engine alone, and by the trainer principal for the
launcher's own on-death policy. The control topic carries the lifecycle's record: the engine's
plans (and a copy of each command), the console's decisions, the trainer's acknowledgements,
``plan.current`` and probe results, and the analytics consumer's probe requests. Telemetry writers
(ranks, node agents) are the untrusted many: they can write the telemetry topic and nothing else.
Which control event came from whom is the signature check's job (docs/security.md); the ACLs stop
everyone else from writing at all.

Consumer groups are granted by prefix, each principal its own (``GROUPS``): a reader cannot join,
and so cannot steal partitions from or move the offsets of, another part's group.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from infra import tls

ADMIN = "admin"
MECHANISM = "SCRAM-SHA-256"
ADMIN_MECHANISM = "PLAIN"
PROTOCOL = "SASL_SSL"
CREDENTIALS_FILE = "credentials.json"
CREDENTIALS_DIR = "credentials"
TLS_DIR = "tls"
ADMIN_PASSWORD_FILE = "admin.password"  # a cluster's secrets folder: what its brokers read (infra/compose.yaml)
SECURE_MARKER = "secure"  # in the data dir: the broker runs secure (SASL_SSL, users, ACLs)

# The platform's topics (collector/topics.py; infra imports none of our packages, and
# tests/test_kafka_security.py checks the two lists agree).
TELEMETRY, ANALYTICS, CONTROL, COMMANDS, TRUTH, DEADLETTER = (
    "resihp.telemetry", "resihp.analytics", "resihp.control", "resihp.commands", "resihp.truth", "resihp.deadletter")
TOPICS = (TELEMETRY, ANALYTICS, CONTROL, COMMANDS, TRUTH, DEADLETTER)

# principal -> (topics it may write, topics it may read).
GRANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "telemetry": ((TELEMETRY,), ()),  # ranks and node agents: telemetry, nothing else
    # acks, plan.current, probe results; commands only for the launcher's own on-death policy. Reads
    # analytics for the predicted iteration time a node agent's hang deadline follows (trainer/agent/predicted.py)
    "trainer": ((TELEMETRY, TRUTH, CONTROL, COMMANDS, DEADLETTER), (ANALYTICS, CONTROL, COMMANDS)),
    "analytics": ((ANALYTICS, CONTROL, DEADLETTER), (TELEMETRY, ANALYTICS, CONTROL)),  # incidents, probes
    "engine": ((CONTROL, COMMANDS, DEADLETTER), (ANALYTICS, CONTROL)),  # plans; commands
    "console": ((CONTROL, DEADLETTER), TOPICS),  # decisions, policies; reads everything
}
# principal -> the consumer-group name prefixes it may use (the group ids the platform's readers
# take: trainer/reference/launcher.py ``trainer:JOB``, trainer/sim ``simulator:JOB``, the node agent
# ``agent:…``; ``resihp analytics --group`` (``analytics``, shards' ``analytics.fits.…``); the
# engine's ``remediation``; the console's ``ui-…``, ``resihp plans list``'s ``plans-view-USER``
# and the demo's ``demo-watch-…``). A ``--group`` of another name is refused by the broker.
GROUPS: dict[str, tuple[str, ...]] = {
    "telemetry": (),
    "trainer": ("trainer", "simulator", "agent"),
    "analytics": ("analytics",),
    "engine": ("remediation",),
    "console": ("ui-", "plans-view-", "demo-watch-"),
}
PRINCIPALS = (ADMIN, *GRANTS)


def tls_files(data_dir: Path, hosts: tuple[str, ...] = tls.LOCAL_HOSTS) -> tls.TlsFiles:
    """The broker's CA and certificate under ``<data dir>/tls`` (made on first use)."""
    return tls.ensure_tls(data_dir / TLS_DIR, hosts)


def cluster_secrets(folder: Path, hosts: tuple[str, ...]) -> tls.TlsFiles:
    """A cluster's secrets folder (0700), the same layout as a local broker's data dir: the CA and a
    broker certificate for ``hosts`` under ``tls/``, every principal's password in
    ``credentials.json``, and ``admin.password`` (0600 each), which the brokers read for their own
    sign-in (infra/compose.yaml)."""
    files = tls_files(tls.private_dir(folder), hosts)
    creds = load_or_create_credentials(folder)
    tls.write_private(folder / ADMIN_PASSWORD_FILE, creds[ADMIN].encode())
    return files


def load_or_create_credentials(data_dir: Path) -> dict[str, str]:
    """principal -> password, created once per data dir (0600 in the 0700 data dir) and reused."""
    path = data_dir / CREDENTIALS_FILE
    if path.exists():
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        creds: dict[str, str] = json.loads(path.read_text())
        missing = [p for p in PRINCIPALS if p not in creds]
        if missing:
            raise ValueError(f"{path} lacks principals {missing}; it was written by another version. Start the "
                             "secure broker on a fresh --data-dir")
        return creds
    creds = {p: secrets.token_urlsafe(18) for p in PRINCIPALS}
    tls.private_dir(data_dir)
    tls.write_private(path, json.dumps(creds).encode())
    return creds


def _properties_value(text: str) -> str:
    """``text`` as one java.util.Properties value (PEM's line breaks as ``\\n`` escapes)."""
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n")


def server_properties(admin_password: str, files: tls.TlsFiles) -> dict[str, str]:
    """The template values of infra/server.properties for a secure broker.

    The broker's TLS key goes into the config itself (``ssl.keystore.key``): Kafka reads a PEM key
    from a file only when it is encrypted, and a passphrase would sit in this same 0600 file."""
    plain = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
             f'username="{ADMIN}" password="{admin_password}" user_{ADMIN}="{admin_password}";')
    security = "\n".join([
        "# Security (infra/kafka_security.py): TLS everywhere, SCRAM-SHA-256 principals, PLAIN for admin, ACLs.",
        f"sasl.enabled.mechanisms={MECHANISM},{ADMIN_MECHANISM}",
        f"sasl.mechanism.inter.broker.protocol={ADMIN_MECHANISM}",
        "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config="
        "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        f"listener.name.sasl_ssl.plain.sasl.jaas.config={plain}",
        f"sasl.mechanism.controller.protocol={ADMIN_MECHANISM}",
        f"listener.name.controller.sasl.enabled.mechanisms={ADMIN_MECHANISM}",
        f"listener.name.controller.plain.sasl.jaas.config={plain}",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.key={_properties_value(files.broker_key.read_text())}",
        f"ssl.keystore.certificate.chain={_properties_value(files.broker_cert.read_text())}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={files.ca_cert}",
        "ssl.endpoint.identification.algorithm=https",
        "ssl.client.auth=none",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{ADMIN}",
    ])
    return {"client_listener": PROTOCOL, "controller_protocol": PROTOCOL, "security": security}


def client_config(user: str, password: str, cafile: Path | str | None) -> dict[str, Any]:
    """kafka-python client settings that sign in as ``user`` over TLS, trusting ``cafile``'s CA
    (None: the system's CAs) and checking the broker's name."""
    return {"security_protocol": PROTOCOL, "sasl_mechanism": ADMIN_MECHANISM if user == ADMIN else MECHANISM,
            "sasl_plain_username": user, "sasl_plain_password": password,
            "ssl_cafile": str(cafile) if cafile else None, "ssl_check_hostname": True}


def principal_config(data_dir: Path, user: str) -> dict[str, Any]:
    """kafka-python settings that sign in as ``user`` on the secure broker of ``data_dir``."""
    creds = load_or_create_credentials(data_dir)
    return client_config(user, creds[user], data_dir / TLS_DIR / tls.CA_CERT)


def env_lines(bootstrap: str, user: str, password: str, cafile: Path | str) -> str:
    """The environment that makes the platform's Kafka clients sign in as ``user``."""
    mechanism = ADMIN_MECHANISM if user == ADMIN else MECHANISM
    return (f"RESIHP_BUS=kafka\nRESIHP_KAFKA_BOOTSTRAP={bootstrap}\nRESIHP_KAFKA_SECURITY_PROTOCOL={PROTOCOL}\n"
            f"RESIHP_KAFKA_SSL_CAFILE={Path(cafile).resolve()}\n"
            f"RESIHP_KAFKA_SASL_MECHANISM={mechanism}\nRESIHP_KAFKA_USERNAME={user}\nRESIHP_KAFKA_PASSWORD={password}\n")


def write_env_files(data_dir: Path, bootstrap: str, creds: dict[str, str], cafile: Path) -> Path:
    """One ``<principal>.env`` per principal (0600) under ``<data dir>/credentials`` (0700)."""
    folder = tls.private_dir(data_dir / CREDENTIALS_DIR)
    for user, password in creds.items():
        tls.write_private(folder / f"{user}.env", env_lines(bootstrap, user, password, cafile).encode())
    return folder


def create_users(bootstrap: str, creds: dict[str, str], cafile: Path | str | None) -> None:
    """Store every principal's SCRAM credential on the broker (an upsert: idempotent), as ``admin``,
    through the admin API, so no password is ever an argument of a process."""
    from kafka.admin import KafkaAdminClient, UserScramCredentialUpsertion

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="resihp-users",
                             **client_config(ADMIN, creds[ADMIN], cafile))
    try:
        result = admin.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(user, MECHANISM, password) for user, password in creds.items()
             if user != ADMIN])
    finally:
        admin.close()
    failed = {user: error for user, error in result.items() if error}
    if failed:
        raise RuntimeError(f"Kafka refused the SCRAM credentials of {failed}")


def acls(namespace: str = "") -> list:
    """The ACLs of ``GRANTS`` (topics under ``namespace``) and ``GROUPS`` (prefixed group names)."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType

    def allow(user: str, op: ACLOperation, rtype: ResourceType, name: str,
              pattern: ACLResourcePatternType = ACLResourcePatternType.LITERAL) -> ACL:
        return ACL(principal=f"User:{user}", host="*", operation=op, permission_type=ACLPermissionType.ALLOW,
                   resource_pattern=ResourcePattern(rtype, name, pattern))

    out = []
    for user, (writes, reads) in GRANTS.items():
        for topic in writes:
            out += [allow(user, ACLOperation.WRITE, ResourceType.TOPIC, namespace + topic),
                    allow(user, ACLOperation.DESCRIBE, ResourceType.TOPIC, namespace + topic)]
        for topic in reads:
            out += [allow(user, ACLOperation.READ, ResourceType.TOPIC, namespace + topic),
                    allow(user, ACLOperation.DESCRIBE, ResourceType.TOPIC, namespace + topic)]
        out += [allow(user, ACLOperation.READ, ResourceType.GROUP, prefix, ACLResourcePatternType.PREFIXED)
                for prefix in GROUPS[user]]
    return out


def apply_acls(bootstrap: str, creds: dict[str, str], cafile: Path | str | None, namespace: str = "") -> int:
    """Create the ACLs of ``acls(namespace)`` as ``admin`` (idempotent); returns how many."""
    from kafka.admin import KafkaAdminClient

    wanted = acls(namespace)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="resihp-acl",
                             **client_config(ADMIN, creds[ADMIN], cafile))
    try:
        result = admin.create_acls(wanted)
    finally:
        admin.close()
    if result["failed"]:
        raise RuntimeError(f"Kafka refused {len(result['failed'])} of {len(wanted)} ACLs: {result['failed'][:3]}")
    return len(wanted)
