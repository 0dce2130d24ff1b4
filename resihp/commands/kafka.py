"""``resihp kafka up | down | status``: the local single-node KRaft broker from infra/.

``up --secure`` starts it on SASL_SSL (a certificate of the platform's own CA, ``<data dir>/tls/``)
with SCRAM principals and ACLs (infra/kafka_security.py), creates the platform's topics as the admin
principal (the others may not create topics), grants the ACLs for them, and prints where each
principal's env file is (docs/kafka.md). ``certs`` makes a CA and a broker certificate for other
brokers (the compose cluster, infra/compose.yaml)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kafka", help="fetch, start, stop or inspect the local Apache Kafka broker", description=__doc__)
    p.add_argument("action", choices=["up", "down", "status", "certs"])
    p.add_argument("--port", type=int, default=None, help="client port (default: $RESIHP_KAFKA_PORT or 19092)")
    p.add_argument("--data-dir", default=None, help="broker data directory (default: .kafka/broker)")
    p.add_argument("--secure", action="store_true",
                   help="TLS (SASL_SSL, the platform's CA in <data dir>/tls/ca.pem), SCRAM-SHA-256 principals "
                        "(telemetry, trainer, analytics, engine, console) and ACLs; needs a fresh data dir")
    p.add_argument("--out", default=None, help="certs: the folder for the CA and the broker certificate (made 0700)")
    p.add_argument("--host", action="append", default=[],
                   help="certs: a name clients dial a broker by (repeat; default localhost and 127.0.0.1)")
    p.add_argument("--namespace", default=None,
                   help="with --secure: the topic prefix to create topics and grant ACLs for "
                        "(default: $RESIHP_KAFKA_NAMESPACE)")
    p.set_defaults(func=run)


def secure_topics(bootstrap: str, data_dir: str | None, namespace: str) -> str:
    """Create the platform's topics under ``namespace`` as the admin principal and grant the ACLs
    for them; returns the folder of the principals' env files."""
    from collector.kafka_bus import ensure_topics
    from infra import broker
    from infra import kafka_security as security

    folder = Path(data_dir or broker.default_data_dir()).resolve()
    creds = security.load_or_create_credentials(folder)
    ca_file = security.tls_files(folder).ca_cert
    ensure_topics(bootstrap, namespace=namespace,
                  security=security.client_config(security.ADMIN, creds[security.ADMIN], ca_file))
    security.apply_acls(bootstrap, creds, ca_file, namespace)
    return str(folder / security.CREDENTIALS_DIR)


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
    elif args.action == "certs":
        from infra import tls

        if not args.out:
            print("error: certs needs --out DIR (the folder for ca.pem, broker.pem, broker.key)", file=sys.stderr)
            return 2
        files = tls.ensure_tls(Path(args.out), tuple(args.host) or tls.LOCAL_HOSTS)
        print(f"CA certificate (give to clients as RESIHP_KAFKA_SSL_CAFILE): {files.ca_cert}\n"
              f"broker certificate chain: {files.broker_cert}\nbroker key (0600): {files.broker_key}")
    elif args.action == "down":
        print("stopped" if broker.down(data_dir=args.data_dir) else "no broker was running")
    else:
        state = broker.status(data_dir=args.data_dir)
        print(json.dumps(state, indent=2, default=str))
        return 0 if state.get("running") else 1
    return 0
