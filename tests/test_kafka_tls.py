"""The secure broker over TLS, on the real thing (``up --secure``, the session's one ``secure_kafka``):
clients that trust the platform's CA produce and consume; a client without it, with another CA, or
speaking plaintext gets nowhere and is told why; each principal may use only its own consumer
groups; the broker's secrets are files only their owner reads, and no password is ever an argument
of a process the start ran."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from collector import topics
from collector.bus import RawMessage
from collector.kafka_bus import KafkaBus, client_security, speaks_tls
from collector.settings import Environment
from infra import broker, tls
from infra import kafka_security as security

pytestmark = pytest.mark.kafka


@pytest.fixture
def secure(secure_kafka) -> dict:
    if not broker.status(secure_kafka["data_dir"])["running"]:  # a test before stopped it
        broker.up(port=secure_kafka["port"], controller_port=secure_kafka["controller_port"],
                  data_dir=secure_kafka["data_dir"], secure=True, die_with=os.getpid())
    return secure_kafka


def _bus(secure: dict, user: str, **overrides: object) -> KafkaBus:
    settings = dict(security.principal_config(secure["data_dir"], user), **overrides)
    return KafkaBus(secure["bootstrap"], namespace="", security=settings)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_client_that_trusts_the_platforms_ca_produces_and_consumes_over_tls(secure, monkeypatch) -> None:
    assert speaks_tls(secure["bootstrap"])  # the listener is TLS, not plaintext
    body = uuid.uuid4().bytes
    engine = _bus(secure, "engine")
    try:
        engine.publish_raw([RawMessage(topics.CONTROL, b"j/engine", body)])
    finally:
        engine.close()
    # the console signs in from its env file, as a process would: SASL_SSL, the CA, its password
    for line in (secure["data_dir"] / security.CREDENTIALS_DIR / "console.env").read_text().splitlines():
        key, value = line.split("=", 1)
        monkeypatch.setenv(key, value)
    assert client_security()["ssl_cafile"] == str(secure["cafile"])
    console = KafkaBus(secure["bootstrap"], namespace="")
    consumer = console.consumer(f"ui-tls-{uuid.uuid4().hex[:8]}", [topics.CONTROL])
    try:
        seen: list[bytes] = []
        for _ in range(120):  # polls, not seconds: each returns as soon as records arrive
            seen += [r.value for r in consumer.poll(timeout_s=1.0)]
            if body in seen:
                break
        assert body in seen
    finally:
        consumer.close()
        console.close()


def test_a_client_without_the_platforms_ca_is_refused_and_told_to_set_the_cafile(secure, tmp_path) -> None:
    with pytest.raises(ConnectionError, match="does not verify against the system's CAs.*RESIHP_KAFKA_SSL_CAFILE"):
        _bus(secure, "console", ssl_cafile=None)
    stranger = tls.ensure_tls(tmp_path / "another-ca")  # a CA, but not the one that signed the broker
    with pytest.raises(ConnectionError, match=f"does not verify against the CA in {stranger.ca_cert}"):
        _bus(secure, "console", ssl_cafile=str(stranger.ca_cert))


def test_a_plaintext_client_gets_no_answer_from_the_tls_listener(secure) -> None:
    with pytest.raises(KafkaError):
        KafkaAdminClient(bootstrap_servers=secure["bootstrap"], client_id="plaintext", bootstrap_timeout_ms=3_000)


def test_a_missing_cafile_setting_names_the_file() -> None:
    env = Environment(kafka_security_protocol="SASL_SSL", kafka_username="console", kafka_password="x",
                      kafka_ssl_cafile="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="RESIHP_KAFKA_SSL_CAFILE=/nonexistent/ca.pem is not a file"):
        client_security(env)


def test_a_principal_cannot_join_another_principals_consumer_group(secure) -> None:
    """Group ACLs are prefixed per principal: analytics may use ``analytics…`` groups, and joining
    the engine's ``remediation`` group (to take its partitions or move its offsets) is refused."""
    analytics = _bus(secure, "analytics")
    try:
        own = analytics.consumer(f"analytics-tls-{uuid.uuid4().hex[:8]}", [topics.CONTROL])
        try:
            for _ in range(30):  # joins and is assigned: no refusal
                own.poll(timeout_s=1.0)
                if not own.joining():
                    break
            assert not own.joining()
        finally:
            own.close()
        theirs = analytics.consumer("remediation", [topics.CONTROL])
        try:
            with pytest.raises(PermissionError, match="'analytics' consumer group 'remediation'"):
                for _ in range(30):
                    theirs.poll(timeout_s=1.0)
        finally:
            theirs.close()
    finally:
        analytics.close()


def test_the_platforms_group_ids_are_inside_their_principals_prefixes() -> None:
    from remediation.engine import EngineConfig
    from remediation.log_view import view_group

    def allowed(principal: str, group: str) -> bool:
        return any(group.startswith(prefix) for prefix in security.GROUPS[principal])

    assert allowed("engine", EngineConfig.group)
    assert allowed("console", view_group("alice")) and allowed("console", "ui-123-abcd")
    assert allowed("analytics", "analytics") and allowed("analytics", "analytics.fits.1a2b")
    assert allowed("trainer", "trainer:job") and allowed("trainer", "simulator:job")
    assert not allowed("analytics", "remediation") and not allowed("console", "analytics")


def test_the_brokers_secrets_are_owner_only_files_in_owner_only_folders(secure) -> None:
    data_dir: Path = secure["data_dir"]
    folders = [data_dir, data_dir / security.CREDENTIALS_DIR, data_dir / security.TLS_DIR]
    assert {f: _mode(f) for f in folders} == {f: 0o700 for f in folders}
    secrets = [data_dir / broker.CONFIG_FILE, data_dir / security.CREDENTIALS_FILE, data_dir / broker.LOG_FILE,
               data_dir / security.TLS_DIR / tls.CA_KEY, data_dir / security.TLS_DIR / tls.BROKER_KEY,
               *(data_dir / security.CREDENTIALS_DIR).glob("*.env")]
    assert len(secrets) == 5 + len(security.PRINCIPALS)
    assert {f: _mode(f) for f in secrets} == {f: 0o600 for f in secrets}
    assert secure["creds"][security.ADMIN] in (data_dir / broker.CONFIG_FILE).read_text()  # why it is 0600


def test_no_password_is_an_argument_of_any_process_the_secure_start_ran(secure) -> None:
    passwords = list(secure["creds"].values())
    started = secure["argv"]
    assert any(broker.STORAGE_TOOL in argv for argv in started)  # the formatter ran, and was recorded
    assert any(broker.MAIN_CLASS in argv for argv in started)  # and the broker's JVM
    leaked = [argv for argv in started for p in passwords if any(p in a for a in argv)]
    assert leaked == []
    jvm = Path(f"/proc/{broker.status(secure['data_dir'])['pid']}/cmdline").read_bytes().decode()
    assert broker.MAIN_CLASS in jvm and not [p for p in passwords if p in jvm]


def test_certs_makes_a_clusters_secrets_owner_only_and_reissues_from_the_same_ca(tmp_path) -> None:
    """``resihp kafka certs`` (what infra/compose.yaml's brokers mount): a CA, a broker certificate
    for the names asked, the passwords; asked again with another name, the broker certificate is
    issued again by the same CA, so clients keep their ca.pem."""
    from cryptography import x509

    from resihp.cli import main

    folder = tmp_path / "secrets"
    assert main(["kafka", "certs", "--secrets", str(folder), "--host", "kafka-1", "--host", "localhost"]) == 0
    files = tls.TlsFiles(folder / security.TLS_DIR)
    keys = [files.broker_key, files.folder / tls.CA_KEY, folder / security.CREDENTIALS_FILE,
            folder / security.ADMIN_PASSWORD_FILE]
    assert {f: _mode(f) for f in [*keys, folder, files.folder]} == {**{f: 0o600 for f in keys},
                                                                      folder: 0o700, files.folder: 0o700}
    ca_before = files.ca_cert.read_bytes()

    def names() -> set[str]:
        cert = x509.load_pem_x509_certificate(files.broker_cert.read_bytes())
        return {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}

    assert names() == {"kafka-1", "localhost"}
    assert main(["kafka", "certs", "--secrets", str(folder), "--host", "kafka-1", "--host", "kafka-2"]) == 0
    assert names() == {"kafka-1", "kafka-2"} and files.ca_cert.read_bytes() == ca_before
    assert (folder / security.ADMIN_PASSWORD_FILE).read_text() == json.loads(
        (folder / security.CREDENTIALS_FILE).read_text())[security.ADMIN]
