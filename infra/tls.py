"""The platform's own certificate authority for Kafka over TLS, made with the ``cryptography`` library.

``resihp kafka up --secure`` runs the broker's listeners on ``SASL_SSL``, so clients need a
certificate to check the broker against. Nobody should need OpenSSL or a keytool recipe for that:
this module makes a private CA (an EC P-256 key and a self-signed certificate, ten years) and signs a
broker certificate (two years) for the names clients dial -- ``localhost`` and ``127.0.0.1`` for the
local broker, ``kafka-1``… for the compose cluster. Clients verify the broker's name against it
(``RESIHP_KAFKA_SSL_CAFILE``, docs/kafka.md).

Everything lives in one folder, mode 0700: ``ca.key`` and ``broker.key`` (0600: whoever reads the
CA key can mint a broker anyone trusts), ``ca.pem`` (what clients are given) and ``broker.pem``
(the broker's certificate followed by the CA's). Files are written aside and renamed into place,
so a crash never leaves half a key. The CA is made once and reused; a broker certificate that
lacks a name asked for, or expires within 30 days, is issued again by the same CA, so clients keep
their ``ca.pem``.

CLI (the compose cluster's certificates, infra/compose.yaml)::

    python -m infra.tls --out infra/secrets --host kafka-1 --host kafka-2 --host kafka-3 --host localhost
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_KEY, CA_CERT = "ca.key", "ca.pem"
BROKER_KEY, BROKER_CERT = "broker.key", "broker.pem"
LOCAL_HOSTS = ("localhost", "127.0.0.1")
CA_DAYS, BROKER_DAYS, RENEW_DAYS = 3650, 730, 30


@dataclass(frozen=True)
class TlsFiles:
    """Where a CA folder's files are."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / CA_CERT

    @property
    def broker_key(self) -> Path:
        return self.folder / BROKER_KEY

    @property
    def broker_cert(self) -> Path:
        return self.folder / BROKER_CERT


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter (0700), made if missing, tightened if wider."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte (never the umask's mode first),
    through a sibling file renamed into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_tls(folder: Path | str, hosts: tuple[str, ...] = LOCAL_HOSTS) -> TlsFiles:
    """The CA and a broker certificate for ``hosts`` in ``folder``, made or renewed as needed."""
    files = TlsFiles(private_dir(Path(folder)))
    ca_key, ca_cert = _load_or_create_ca(files.folder)
    if not _broker_cert_covers(files, hosts, ca_cert):
        _issue_broker_cert(files, hosts, ca_key, ca_cert)
    return files


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    # PKCS#8, unencrypted: Kafka's PEM keystore (ssl.keystore.key) and Python's ssl read it; the
    # file's mode, not a passphrase stored next to it, is what keeps it.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_or_create_ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_path, cert_path = folder / CA_KEY, folder / CA_CERT
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not an EC key this tool made; move the folder aside to make a new CA")
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ResiHP"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "ResiHP Kafka CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    write_private(key_path, _pem_key(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _broker_cert_covers(files: TlsFiles, hosts: tuple[str, ...], ca_cert: x509.Certificate) -> bool:
    if not (files.broker_key.exists() and files.broker_cert.exists()):
        return False
    cert = x509.load_pem_x509_certificate(files.broker_cert.read_bytes())  # the first one: the broker's
    if cert.issuer != ca_cert.subject or cert.not_valid_after_utc < _now() + dt.timedelta(days=RENEW_DAYS):
        return False
    held = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    return set(_san(hosts)) <= held


def _issue_broker_cert(files: TlsFiles, hosts: tuple[str, ...], ca_key: ec.EllipticCurvePrivateKey,
                       ca_cert: x509.Certificate) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=BROKER_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            # the broker is a server to clients and a client of its own listeners (inter-broker, controller)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_private(files.broker_key, _pem_key(key))
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    write_private(files.broker_cert, chain)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.tls",
        description="Make (once) a private CA and issue a Kafka broker certificate for the given names. "
                    "Give clients <out>/ca.pem (RESIHP_KAFKA_SSL_CAFILE); give brokers broker.pem and broker.key.")
    parser.add_argument("--out", type=Path, required=True, help="the folder (made 0700; keys 0600)")
    parser.add_argument("--host", action="append", default=[],
                        help="a name or IP address clients dial the broker by (repeat; default localhost, 127.0.0.1)")
    args = parser.parse_args(argv)
    files = ensure_tls(args.out, tuple(args.host) or LOCAL_HOSTS)
    print(f"CA certificate (give to clients): {files.ca_cert}\n"
          f"broker certificate chain: {files.broker_cert}\nbroker key (0600): {files.broker_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
