"""A real single-node Apache Kafka broker (KRaft, no ZooKeeper) for tests and demos.

The broker is the stock ``kafka_2.13`` jar from Maven Central (version pinned in infra/pom.xml),
fetched once with Maven into ``.kafka/lib`` and run with the local ``java``. One JVM is both the
broker and the KRaft controller, listens on loopback only, and keeps everything it writes --
config, metadata, topic data, its log, its pid file -- in one data directory, so a second broker
is just a second data directory and two ports.

The broker runs detached: it outlives the Python process that started it, and ``down`` (from any
process) stops it through the pid file.

Public API (``resihp kafka up|down|status`` calls these)::

    bootstrap = up()           # '127.0.0.1:19092'; returns the running one if already up
    status()                   # {'running': True, 'pid': ..., 'bootstrap': ..., 'reachable': True, ...}
    down()                     # True if a broker was stopped
    up(secure=True)            # SASL_SSL, SCRAM principals and ACLs (infra/kafka_security.py)

CLI: ``python -m infra.broker up|down|status [--port N] [--data-dir D] [--secure]``.

Environment (arguments win over these):
    RESIHP_KAFKA_PORT             client port (default 19092)
    RESIHP_KAFKA_CONTROLLER_PORT  KRaft controller port (default: client port + 1)
    RESIHP_KAFKA_DATA_DIR         data directory (default <repo>/.kafka/broker)
    RESIHP_KAFKA_LIB_DIR          where the jars go (default <repo>/.kafka/lib)
    KAFKA_HEAP_OPTS               JVM heap flags, as for Kafka's own scripts (default -Xmx512m -Xms256m)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from infra import kafka_security as security
from infra import tls

INFRA_DIR = Path(__file__).resolve().parent
REPO_ROOT = INFRA_DIR.parent
POM = INFRA_DIR / "pom.xml"
SERVER_TEMPLATE = INFRA_DIR / "server.properties"
LOG4J_CONFIG = INFRA_DIR / "log4j.properties"

HOST = "127.0.0.1"
DEFAULT_PORT = 19092
DEFAULT_HEAP_OPTS = "-Xmx512m -Xms256m"
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"

# Files inside the data directory.
PID_FILE = "broker.pid"
LOG_FILE = "broker.log"
CONFIG_FILE = "server.properties"
KRAFT_DIR = "kraft"  # log.dirs: metadata log and topic partitions


class BrokerError(RuntimeError):
    """The broker could not be fetched, started or stopped; the message says why and what to do."""


# --- configuration -----------------------------------------------------------------------------


def kafka_version() -> str:
    """The Kafka version infra/pom.xml pins (its ``kafka.version`` property)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    version = ET.parse(POM).getroot().findtext("m:properties/m:kafka.version", namespaces=ns)
    if version is None:
        raise RuntimeError(f"{POM} has no kafka.version property; restore it (the broker fetch pins it)")
    return version


def default_lib_dir() -> Path:
    return Path(os.environ.get("RESIHP_KAFKA_LIB_DIR", REPO_ROOT / ".kafka" / "lib"))


def default_data_dir() -> Path:
    return Path(os.environ.get("RESIHP_KAFKA_DATA_DIR", REPO_ROOT / ".kafka" / "broker"))


def _resolve_ports(port: int | None, controller_port: int | None) -> tuple[int, int]:
    port = port or int(os.environ.get("RESIHP_KAFKA_PORT", DEFAULT_PORT))
    controller_port = controller_port or int(os.environ.get("RESIHP_KAFKA_CONTROLLER_PORT", port + 1))
    if port == controller_port:
        raise BrokerError(f"client and controller port are both {port}; pick two different ports")
    return port, controller_port


# --- fetch -------------------------------------------------------------------------------------


def fetch(lib_dir: Path | str | None = None) -> Path:
    """Copy the broker's jars from Maven Central into ``lib_dir`` (once) and return it.

    Cheap when done: if the pinned ``kafka_2.13-<version>.jar`` is already there nothing runs.
    Maven copies into a sibling folder of this process's own that is renamed at the end, so an
    interrupted fetch never leaves a half-filled lib dir that looks complete, and two processes
    fetching at once do not mix their files. Jars of another Kafka version (the pom was bumped)
    are replaced.
    """
    lib_dir = Path(lib_dir or default_lib_dir()).resolve()
    version = kafka_version()
    marker = f"kafka_2.13-{version}.jar"
    if (lib_dir / marker).exists():
        return lib_dir
    _require_tool("mvn", "Maven is needed once to download the broker jars (apt-get install maven)")
    partial = lib_dir.with_name(f"{lib_dir.name}.partial-{os.getpid()}")
    cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={partial}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise BrokerError(
            f"Maven could not fetch org.apache.kafka:kafka_2.13:{version} (exit {done.returncode}).\n"
            f"Is Maven Central (repo.maven.apache.org) reachable? Behind a proxy, configure it in "
            f"~/.m2/settings.xml.\nCommand: {' '.join(cmd)}\n{_tail(done.stdout + done.stderr)}"
        )
    if (lib_dir / marker).exists():  # another process finished first
        shutil.rmtree(partial)
    else:
        shutil.rmtree(lib_dir, ignore_errors=True)
        partial.rename(lib_dir)
    return lib_dir


def _require_tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BrokerError(f"`{name}` is not on PATH. {hint}")
    return path


# --- up / down / status ------------------------------------------------------------------------


def up(
    port: int | None = None,
    data_dir: Path | str | None = None,
    controller_port: int | None = None,
    timeout_s: float = 120.0,
    lib_dir: Path | str | None = None,
    secure: bool = False,
    die_with: int | None = None,
) -> str:
    """Start the broker (fetching it first if needed) and return its bootstrap address.

    ``die_with``: the pid of the broker's supervisor (a test session): the broker is stopped once
    that process is gone, however it ended. Without it the broker outlives its caller, as
    ``resihp kafka up`` means it to.

    ``secure``: every listener on SASL_SSL with a certificate of the platform's CA
    (``<data dir>/tls/``), SCRAM-SHA-256 principals created through the admin API once the broker
    answers, and ACLs (infra/kafka_security.py); the data dir must be fresh or have been started
    secure before, and the principals' credentials are written under ``<data dir>/credentials/``.

    Secrets never leave files only their owner reads: the data dir is 0700, its config (``admin``'s
    password, the TLS key) and credential files 0600, and no process this starts gets a password in
    its arguments.

    If a broker already runs on ``data_dir`` no other is started: ``up`` waits for that one and
    returns its address (even if it listens on another port than asked). Otherwise the data dir is
    formatted on first use (random cluster id), the broker is started detached, and ``up`` waits
    until an admin client can list topics. If that does not happen within ``timeout_s`` the broker
    is stopped and BrokerError carries the tail of its log.
    """
    data_dir = Path(data_dir or default_data_dir()).resolve()
    if _running_pid(data_dir) is not None:
        return _wait_ready(data_dir, _bootstrap_of(data_dir), timeout_s)
    formatted = (data_dir / KRAFT_DIR / "meta.properties").exists()
    was_secure = (data_dir / security.SECURE_MARKER).exists()
    if formatted and secure != was_secure:
        raise BrokerError(f"{data_dir} was started {'with' if was_secure else 'without'} SASL users; start it "
                          f"{'with' if was_secure else 'without'} --secure, or use a fresh --data-dir")
    tls.private_dir(data_dir)
    creds = security.load_or_create_credentials(data_dir) if secure else None
    ca_file = security.tls_files(data_dir).ca_cert if secure else None

    port, controller_port = _resolve_ports(port, controller_port)
    lib_dir = fetch(lib_dir)
    java = _require_tool("java", "the broker runs on Java (17 recommended: apt-get install openjdk-17-jre-headless)")
    for p in (port, controller_port):
        _require_free(p)

    config = _write_config(data_dir, port, controller_port, creds)
    classpath = ["-cp", str(lib_dir / "*")]
    if not formatted:
        _format_storage(java, classpath, config)
        if creds:
            (data_dir / security.SECURE_MARKER).write_text("SASL_SSL, SCRAM-SHA-256 users, ACLs\n")

    jvm = [java, *os.environ.get("KAFKA_HEAP_OPTS", DEFAULT_HEAP_OPTS).split(),
           "-Djava.awt.headless=true", f"-Dlog4j.configuration={LOG4J_CONFIG.as_uri()}",
           # Tags the process so a recycled pid is never mistaken for our broker.
           f"-Dresihp.kafka.data.dir={data_dir}"]
    log_file = data_dir / LOG_FILE
    if not log_file.exists():
        tls.write_private(log_file, b"")
    pid = _spawn_detached([*jvm, *classpath, MAIN_CLASS, str(config)], log_file)
    (data_dir / PID_FILE).write_text(f"{pid}\n")
    if die_with is not None:
        _stop_when_gone(die_with, pid)

    bootstrap = _wait_ready(data_dir, f"{HOST}:{port}", timeout_s)
    if creds and ca_file:
        security.create_users(bootstrap, creds, ca_file)
        security.apply_acls(bootstrap, creds, ca_file)
        security.write_env_files(data_dir, bootstrap, creds, ca_file)
    return bootstrap


def _admin_config(data_dir: Path) -> dict:
    """kafka-python settings of the broker's admin principal (empty for a plaintext broker)."""
    if not (data_dir / security.SECURE_MARKER).exists():
        return {}
    return security.principal_config(data_dir, security.ADMIN)


def _wait_ready(data_dir: Path, bootstrap: str, timeout_s: float) -> str:
    """Return ``bootstrap`` once the broker answers; stop it and raise if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while not _answers(bootstrap, timeout_s=5.0, client=_admin_config(data_dir)):
        if _running_pid(data_dir) is None:
            (data_dir / PID_FILE).unlink(missing_ok=True)
            raise BrokerError(f"the Kafka broker exited during start-up; its log ({data_dir / LOG_FILE}) ends with:\n"
                              f"{_tail(_read_log(data_dir))}")
        if time.monotonic() > deadline:
            log_tail = _tail(_read_log(data_dir))
            down(data_dir)
            raise BrokerError(f"the Kafka broker did not answer on {bootstrap} within {timeout_s:.0f} s and was "
                              f"stopped; raise timeout_s on a slow machine. Its log ends with:\n{log_tail}")
        time.sleep(0.5)
    return bootstrap


class Borrowed(NamedTuple):
    """A broker a command uses: its address, whether the command started it, where its data lives."""

    bootstrap: str
    started: bool
    data_dir: Path

    def describe(self) -> str:
        return (f"a broker started for this command at {self.bootstrap} (stopped when it ends)" if self.started
                else f"the broker already up at {self.bootstrap} (left running)")


@contextlib.contextmanager
def borrowed(timeout_s: float = 120.0) -> Iterator[Borrowed]:
    """A broker for one command (a benchmark). The broker already up on the default data dir is
    used and left running; otherwise one is started on free ports in a throw-away data dir, tied to
    this process (``die_with``: it dies with it however it ends), and stopped and deleted on
    leaving. Why: a command that started a 0.5 GB JVM for itself must not leave it behind."""
    running = status()
    if running["running"] and running["bootstrap"] and not running["secure"]:
        yield Borrowed(running["bootstrap"], False, Path(running["data_dir"]))
        return
    data_dir = Path(tempfile.mkdtemp(prefix="resihp-broker-"))
    try:
        bootstrap = up(port=_free_port(), controller_port=_free_port(), data_dir=data_dir, timeout_s=timeout_s,
                       die_with=os.getpid())
        try:
            yield Borrowed(bootstrap, True, data_dir)
        finally:
            down(data_dir=data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def down(data_dir: Path | str | None = None, timeout_s: float = 30.0) -> bool:
    """Stop the broker on ``data_dir``; return True if one was running.

    SIGTERM lets Kafka shut down cleanly (flush, close the metadata log, so the next start needs
    no log recovery); after ``timeout_s`` it gets SIGKILL. Data stays; delete the data dir to
    start from scratch.
    """
    data_dir = Path(data_dir or default_data_dir()).resolve()
    pid = _running_pid(data_dir)
    if pid is None:
        (data_dir / PID_FILE).unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):  # it may exit on its own meanwhile
        os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, data_dir, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not _wait_gone(pid, data_dir, 10.0):
            raise BrokerError(f"Kafka broker pid {pid} survived SIGKILL; check it with `ps -p {pid}`")
    (data_dir / PID_FILE).unlink(missing_ok=True)
    return True


def status(data_dir: Path | str | None = None) -> dict:
    """Describe the broker on ``data_dir``.

    Returns ``running`` (the process is alive), ``pid``, ``bootstrap`` (None if never configured),
    ``reachable`` (an admin client can list topics -- a running broker may still be starting),
    ``data_dir`` and ``log`` (the broker's log file).
    """
    data_dir = Path(data_dir or default_data_dir()).resolve()
    pid = _running_pid(data_dir)
    bootstrap = _bootstrap_of(data_dir) if (data_dir / CONFIG_FILE).exists() else None
    return {
        "running": pid is not None,
        "pid": pid,
        "bootstrap": bootstrap,
        "reachable": bool(pid and bootstrap and _answers(bootstrap, timeout_s=5.0, client=_admin_config(data_dir))),
        "secure": (data_dir / security.SECURE_MARKER).exists(),
        "data_dir": str(data_dir),
        "log": str(data_dir / LOG_FILE),
    }


# --- helpers -----------------------------------------------------------------------------------


def _write_config(data_dir: Path, port: int, controller_port: int, creds: dict[str, str] | None = None) -> Path:
    """Render infra/server.properties for this data dir and these ports (rewritten on every start,
    mode 0600: it holds ``admin``'s password and the TLS key), with TLS, SASL and ACLs when ``creds``
    are given."""
    plain = {"client_listener": "PLAINTEXT", "controller_protocol": "PLAINTEXT", "security": ""}
    values = security.server_properties(creds[security.ADMIN], security.tls_files(data_dir)) if creds else plain
    text = string.Template(SERVER_TEMPLATE.read_text()).substitute(
        host=HOST, port=port, controller_port=controller_port, log_dir=data_dir / KRAFT_DIR, **values)
    config = data_dir / CONFIG_FILE
    tls.write_private(config, text.encode())
    return config


def _format_storage(java: str, classpath: list[str], config: Path) -> None:
    """Format the KRaft log dir with a fresh cluster id (a KRaft broker refuses to start without).
    No SCRAM users here: ``--add-scram`` would put their passwords in this process's arguments, so
    a secure broker gets them through the admin API once it answers."""
    cmd = [java, "-Xmx256m", f"-Dlog4j.configuration={LOG4J_CONFIG.as_uri()}", *classpath,
           STORAGE_TOOL, "format", "--config", str(config), "--cluster-id", _random_cluster_id()]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BrokerError(f"formatting the Kafka log dir failed (exit {done.returncode}):\n"
                          f"{_tail(done.stdout + done.stderr)}")


def _random_cluster_id() -> str:
    """A Kafka Uuid as text: 16 random bytes, URL-safe base64 without padding.

    Same as `kafka-storage random-uuid` without starting a JVM; like Kafka we avoid a leading '-'
    so the id never looks like a command-line flag.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _spawn_detached(cmd: list[str], log_path: Path) -> int:
    """Start ``cmd`` in the background with stdout+stderr appended to ``log_path``; return its pid.

    A short-lived ``sh`` backgrounds the JVM and exits, so the broker is re-parented to init: it
    survives our process, never lingers as our zombie, and runs in its own session (Ctrl-C in the
    terminal that ran ``up`` does not reach it).
    """
    script = 'log="$1"; shift; "$@" >>"$log" 2>&1 </dev/null & echo $!'
    done = subprocess.run(["sh", "-c", script, "sh", str(log_path), *cmd],
                          capture_output=True, text=True, start_new_session=True, check=True)
    return int(done.stdout.strip())


WATCHER_SCRIPT = ('while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done; '
                  'kill -TERM "$2" 2>/dev/null; exit 0')


def _stop_when_gone(owner: int, pid: int) -> None:
    """A detached watcher that sends the broker SIGTERM (a clean shutdown) once ``owner`` has
    exited, and itself exits with the broker. A watcher rather than PR_SET_PDEATHSIG because the
    broker is re-parented to init (``_spawn_detached``): its parent is never the owner."""
    subprocess.Popen(["sh", "-c", WATCHER_SCRIPT, "sh", str(owner), str(pid)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _running_pid(data_dir: Path) -> int | None:
    """The pid in the pid file if that process is alive and is the broker of this data dir."""
    try:
        pid = int((data_dir / PID_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _is_our_broker(pid, data_dir) else None


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive but someone else's: not ours
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():  # no procfs (macOS): trust the pid file
        return True
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return f"-Dresihp.kafka.data.dir={data_dir}".encode() in args  # zombies have an empty cmdline


def _wait_gone(pid: int, data_dir: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_our_broker(pid, data_dir):
            return True
        time.sleep(0.2)
    return False


def _bootstrap_of(data_dir: Path) -> str:
    """host:port from the advertised listener of the config the broker was started with."""
    for line in (data_dir / CONFIG_FILE).read_text().splitlines():
        if line.startswith("advertised.listeners="):
            return line.split("//", 1)[1].split(",", 1)[0].strip()
    raise BrokerError(f"no advertised.listeners in {data_dir / CONFIG_FILE}")


def _require_free(port: int) -> None:
    """Refuse a port another process listens on. SO_REUSEADDR, as the JVM's own listener sets it:
    the sockets a stopped broker leaves in TIME_WAIT do not block the port, so ``up`` right after
    ``down`` reuses it at once instead of refusing for a minute."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            raise BrokerError(f"port {HOST}:{port} is taken ({exc.strerror}); another broker? "
                              f"Choose free ports with --port / RESIHP_KAFKA_PORT and "
                              f"RESIHP_KAFKA_CONTROLLER_PORT") from None


def _answers(bootstrap: str, timeout_s: float, client: dict | None = None) -> bool:
    """True if a kafka-python admin client connects to ``bootstrap`` and lists topics.

    A plain TCP probe comes first: it is instant while the JVM is still starting, and spares the
    admin client's noisy bootstrap retries.
    """
    host, port = bootstrap.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    from kafka import KafkaAdminClient  # imported late: fetch/down/the CLI help work without it
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="resihp-infra",
                                 bootstrap_timeout_ms=int(timeout_s * 1000),
                                 request_timeout_ms=int(timeout_s * 1000), **(client or {}))
    except (KafkaError, OSError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def _read_log(data_dir: Path) -> str:
    try:
        return (data_dir / LOG_FILE).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --- CLI ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.broker",
        description="Run a local single-node Kafka (KRaft) broker for ResiHP tests and demos.",
        epilog="Environment: RESIHP_KAFKA_PORT, RESIHP_KAFKA_CONTROLLER_PORT, RESIHP_KAFKA_DATA_DIR, "
               "RESIHP_KAFKA_LIB_DIR, KAFKA_HEAP_OPTS. `up` prints only the bootstrap address on stdout: "
               "export RESIHP_KAFKA_BOOTSTRAP=$(python -m infra.broker up)")
    parser.add_argument("action", choices=["up", "down", "status", "fetch"])
    parser.add_argument("--port", type=int, help=f"client port (default $RESIHP_KAFKA_PORT or {DEFAULT_PORT})")
    parser.add_argument("--controller-port", type=int, help="KRaft controller port (default: port + 1)")
    parser.add_argument("--data-dir", type=Path, help="broker data dir (default $RESIHP_KAFKA_DATA_DIR or .kafka/broker)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for start-up / shutdown")
    parser.add_argument("--secure", action="store_true",
                        help="SASL_SSL with the platform's CA, SCRAM principals and ACLs (a fresh data dir; "
                             "credentials in <data dir>/credentials, CA in <data dir>/tls/ca.pem)")
    args = parser.parse_args(argv)
    try:
        if args.action == "fetch":
            print(fetch())
        elif args.action == "up":
            print(up(port=args.port, data_dir=args.data_dir, controller_port=args.controller_port,
                     timeout_s=args.timeout, secure=args.secure))
        elif args.action == "down":
            stopped = down(args.data_dir, timeout_s=args.timeout)
            print("stopped" if stopped else "not running", file=sys.stderr)
        else:
            info = status(args.data_dir)
            for key, value in info.items():
                print(f"{key}: {value}")
            return 0 if info["running"] else 3  # 3, like `systemctl status` for "not running"
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
