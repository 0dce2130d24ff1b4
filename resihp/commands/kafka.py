"""``resihp kafka up | down | status | certs | provision``: the local single-node KRaft broker from
infra/, and the secrets of a real cluster.

``up --secure`` starts it on SASL_SSL (a certificate of the platform's own CA, ``<data dir>/tls/``)
with SCRAM principals and ACLs (infra/kafka_security.py), creates the platform's topics as the admin
principal (the others may not create topics), grants the ACLs for them, and prints where each
principal's env file is (docs/kafka.md). For a cluster (infra/compose.yaml): ``certs --out DIR
--host NAME…`` makes its secrets folder (the CA, a broker certificate for those names, the
principals' passwords), and once the brokers run ``provision --bootstrap B --secrets DIR`` does as
``up --secure`` does after start."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kafka", help="fetch, start, stop or inspect the local Apache Kafka broker", description=__doc__)
    p.add_argument("action", choices=["up", "down", "status", "certs", "provision"])
    p.add_argument("--port", type=int, default=None, help="client port (default: $RESIHP_KAFKA_PORT or 19092)")
    p.add_argument("--data-dir", default=None, help="broker data directory (default: .kafka/broker)")
    p.add_argument("--secure", action="store_true",
                   help="TLS (SASL_SSL, the platform's CA in <data dir>/tls/ca.pem), SCRAM-SHA-256 principals "
                        "(telemetry, trainer, analytics, engine, console) and ACLs; needs a fresh data dir")
    p.add_argument("--secrets", default=None,
                   help="certs, provision: a cluster's secrets folder (made 0700: tls/, credentials.json, "
                        "admin.password; the principals' env files go to its credentials/)")
    p.add_argument("--host", action="append", default=[],
                   help="certs: a name clients dial the brokers by, in the broker certificate (repeat; default "
                        "localhost and 127.0.0.1)")
    p.add_argument("--bootstrap", default=None, help="provision: the cluster's bootstrap servers, as clients dial them")
    p.add_argument("--namespace", default=None,
                   help="with --secure, provision: the topic prefix to create topics and grant ACLs for "
                        "(default: $RESIHP_KAFKA_NAMESPACE)")
    p.set_defaults(func=run)


def secure_topics(bootstrap: str, data_dir: str | None, namespace: str) -> str:
    """Provision the local secure broker of ``data_dir`` (``provision``); returns the folder of the
    principals' env files."""
    from infra import broker

    return str(provision(bootstrap, Path(data_dir or broker.default_data_dir()).resolve(), namespace))


def provision(bootstrap: str, folder: Path, namespace: str = "") -> Path:
    """As ``admin`` of a running secure cluster whose secrets are in ``folder`` (a local broker's
    data dir, or a cluster's secrets folder from ``certs``): store every principal's SCRAM
    credential, create the platform's topics under ``namespace`` (the others may not create
    topics), grant the ACLs, and write the principals' env files; returns their folder."""
    from collector.kafka_bus import ensure_topics
    from infra import kafka_security as security

    creds = security.load_or_create_credentials(folder)
    cafile = folder / security.TLS_DIR / "ca.pem"
    if not cafile.is_file():
        raise FileNotFoundError(f"{cafile} is missing: make the cluster's secrets first with "
                                f"`resihp kafka certs --out {folder} --host NAME ...`")
    security.create_users(bootstrap, creds, cafile)
    ensure_topics(bootstrap, namespace=namespace, security=security.client_config(security.ADMIN, creds[security.ADMIN],
                                                                                    cafile))
    security.apply_acls(bootstrap, creds, cafile, namespace)
    return security.write_env_files(folder, bootstrap, creds, cafile)


def run(args: argparse.Namespace) -> int:
    from collector.settings import environment
    from infra import broker

    if args.action == "up":
        bootstrap = broker.up(port=args.port, data_dir=args.data_dir, secure=args.secure)
        if args.secure:
            namespace = environment().kafka_namespace if args.namespace is None else args.namespace
            env_dir = secure_topics(bootstrap, args.data_dir, namespace)
            print(f"principals' env files: {env_dir}/<principal>.env (source one to sign in as it)", file=sys.stderr)
        print(bootstrap)
    elif args.action in ("certs", "provision"):
        from infra import kafka_security as security
        from infra import tls

        if not args.secrets or (args.action == "provision" and not args.bootstrap):
            print(f"error: {args.action} needs --secrets DIR"
                  + (" and --bootstrap HOST:PORT,..." if args.action == "provision" else ""), file=sys.stderr)
            return 2
        folder = Path(args.secrets).resolve()
        if args.action == "certs":
            files = security.cluster_secrets(folder, tuple(args.host) or tls.LOCAL_HOSTS)
            print(f"CA certificate (give to clients as RESIHP_KAFKA_SSL_CAFILE): {files.ca_cert}\n"
                  f"broker certificate chain: {files.broker_cert}\nbroker key (0600): {files.broker_key}\n"
                  f"passwords (0600): {folder / security.CREDENTIALS_FILE}, {folder / security.ADMIN_PASSWORD_FILE}")
        else:
            namespace = environment().kafka_namespace if args.namespace is None else args.namespace
            env_files = provision(args.bootstrap, folder, namespace)
            print(f"principals' env files: {env_files}/<principal>.env (source one to sign in as it)")
    elif args.action == "down":
        print("stopped" if broker.down(data_dir=args.data_dir) else "no broker was running")
    else:
        state = broker.status(data_dir=args.data_dir)
        print(json.dumps(state, indent=2, default=str))
        return 0 if state.get("running") else 1
    return 0
