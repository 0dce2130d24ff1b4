"""``resihp ui``: serve the operators' console (Streamlit), or add a user to its users file."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from collector.settings import environment
from resihp.options import add_bus_flags

APP = Path(__file__).resolve().parents[2] / "ui" / "app.py"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="serve the operators' console (Streamlit); --add-user writes a users-file entry",
                       description=__doc__)
    add_bus_flags(p)
    p.add_argument("--port", type=int, default=8501, help="HTTP port (default 8501)")
    p.add_argument("--address", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--users", default=None,
                   help="TOML users file (default: $RESIHP_UI_USERS or .resihp/ui-users.toml)")
    p.add_argument("--traces", default=None, help="folder Replay lists traces from (default: $RESIHP_UI_TRACE_DIR or .resihp/traces)")
    p.add_argument("--session-hours", type=float, default=None, help="how long a sign-in lasts (default 8)")
    p.add_argument("--no-telemetry", action="store_true",
                   help="do not read per-rank telemetry (lighter for very large jobs; no per-rank heatmap)")
    p.add_argument("--alertmanager-url", default=None,
                   help="Alertmanager whose alerts each incident shows (default: $RESIHP_UI_ALERTMANAGER_URL or "
                        "http://127.0.0.1:9093, `resihp ops up`'s; '' for none)")
    p.add_argument("--tls-cert", default=None,
                   help="serve HTTPS with this PEM certificate (chain); needs --tls-key. Off loopback, prefer a "
                        "TLS-terminating reverse proxy (docs/security.md)")
    p.add_argument("--tls-key", default=None, help="the certificate's PEM private key (mode 0600)")
    p.add_argument("--add-user", metavar="NAME", default=None,
                   help="add or replace a user in the users file and exit (password from $RESIHP_UI_PASSWORD or a prompt)")
    p.add_argument("--role", choices=["operator", "viewer"], default="viewer", help="role for --add-user (default viewer)")
    p.set_defaults(func=run)


def console_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment ui/app.py reads its settings from (see ui/settings.py)."""
    env = dict(os.environ)
    for flag, var in (("bus", "RESIHP_BUS"), ("bus_path", "RESIHP_EMBEDDED_PATH"), ("bootstrap", "RESIHP_KAFKA_BOOTSTRAP"),
                      ("users", "RESIHP_UI_USERS"), ("traces", "RESIHP_UI_TRACE_DIR"),
                      ("alertmanager_url", "RESIHP_UI_ALERTMANAGER_URL")):
        value = getattr(args, flag)
        if value is not None:
            env[var] = os.path.abspath(value) if flag in ("bus_path", "users", "traces") else str(value)
    if args.no_telemetry:
        env["RESIHP_UI_TELEMETRY"] = "0"
    if args.session_hours is not None:
        env["RESIHP_UI_SESSION_S"] = str(args.session_hours * 3600)
    root = str(APP.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(args: argparse.Namespace) -> int:
    if args.add_user is not None:
        return _add_user(args)
    try:
        cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
               "--server.port", str(args.port), "--server.address", args.address,
               "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
               "--global.developmentMode", "false", "--client.toolbarMode", "viewer", *tls_flags(args)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Become the Streamlit server (exec, not a child): a signal to `resihp ui` then reaches the
    # server itself, so stopping the console never leaves an orphaned server on the port.
    os.execve(sys.executable, cmd, console_env(args))


def tls_flags(args: argparse.Namespace) -> list[str]:
    """Streamlit's HTTPS options for ``--tls-cert`` / ``--tls-key`` (none without them). Both or
    neither; the key must exist and be readable by its owner only, or anyone on the host could
    impersonate the console."""
    if args.tls_cert is None and args.tls_key is None:
        return []
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both, or neither for plain HTTP")
    cert, key = Path(args.tls_cert).resolve(), Path(args.tls_key).resolve()
    for path in (cert, key):
        if not path.is_file():
            raise ValueError(f"{path} is not a file")
    if key.stat().st_mode & 0o077:
        raise ValueError(f"{key} is readable by others; chmod 600 {key}")
    return ["--server.sslCertFile", str(cert), "--server.sslKeyFile", str(key)]


def _add_user(args: argparse.Namespace) -> int:
    from ui.auth import UsersFile

    env = environment()
    path = args.users or env.ui_users
    password = env.ui_password
    if password is None:
        password = getpass.getpass(f"password for {args.add_user}: ")
        if password != getpass.getpass("again: "):
            print("the two passwords differ; nothing written", file=sys.stderr)
            return 1
    try:
        UsersFile(path).add_user(args.add_user, args.role, password)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(f"{args.add_user} ({args.role}) written to {path}")
    return 0
