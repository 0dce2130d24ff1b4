"""Shared fixtures: a real Kafka broker for the session, and a fresh bus of either backend.

The broker is started by the project's own infra (infra/broker.py) on a free loopback port with a
throw-away data dir. If it cannot start, every test that needs it fails with the broker's log:
Kafka tests are never skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from collector.bus import Bus
from infra import broker
from tests.fixtures.processes import FIXTURE_OWNED
from tests.fixtures.tiers import KAFKA_FIXTURES, NEEDS, no_process_started, tier_of

# Property tests judge values, never time: `make test` runs the fast tier niced beside the slow
# one on two cores, where how long Hypothesis takes to draw an input says nothing about the code.
# A test's own @settings inherits these for what it leaves out.
settings.register_profile("resihp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("resihp")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=("fast", "slow", "light", "heavy", "all"), default="all",
                     help="fast: the tests that need none of tests/fixtures/tiers.py's NEEDS (make test-fast); "
                          "slow: the others, which are light (servers only: broker, browser, Prometheus) and "
                          "heavy (processes of their own, or long); all (default): every test")


def pytest_configure(config: pytest.Config) -> None:
    for mark, why in NEEDS.items():
        config.addinivalue_line("markers", f"{mark}: {why}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that requests a broker fixture needs the broker, whatever its marks say; ``--tier``
    keeps the fast or the slow tier."""
    for item in items:
        if KAFKA_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("kafka") is None:
            item.add_marker(pytest.mark.kafka)
    tier = config.getoption("--tier")
    if tier == "all":
        return
    wanted = {"fast": {"fast"}, "slow": {"light", "heavy"}, "light": {"light"}, "heavy": {"heavy"}}[tier]
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marks = {mark for mark in NEEDS if item.get_closest_marker(mark)}
        (keep if tier_of(marks) in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that says it needs none of tests/fixtures/tiers.py's ``NEEDS`` starts no process."""
    if any(request.node.get_closest_marker(mark) for mark in NEEDS):
        yield
        return
    started: list[str] = []
    with no_process_started(request.node.nodeid, started):
        yield
    if started:
        pytest.fail(f"{request.node.nodeid} started {len(started)} process(es) ({started[0]}) but is in the fast "
                    "tier: mark it @pytest.mark.processes (or kafka, browser, monitoring; tests/fixtures/tiers.py)",
                    pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def control_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One throw-away key directory for the session (collector/keys.py), inherited by child
    processes, with every role's key and a key for each person the tests name (cli:alice …);
    tests sign control events with it through tests/fixtures/signing.py."""
    from collector.keys import KeyDir
    from tests.fixtures.signing import PEOPLE

    path = tmp_path_factory.mktemp("keys") / "keys"
    keys = KeyDir(path)
    keys.create()
    for name in PEOPLE:
        keys.add_person(name)
    before = os.environ.get("RESIHP_KEYS")
    os.environ["RESIHP_KEYS"] = str(path)
    yield path
    if before is None:
        os.environ.pop("RESIHP_KEYS", None)
    else:
        os.environ["RESIHP_KEYS"] = before


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: every file mode a test then sees is the platform's choice, not the umask's."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


@pytest.fixture(autouse=True)
def keep_main_module() -> Iterator[None]:
    """Streamlit's AppTest runs the console script as ``__main__`` and leaves it in ``sys.modules``.
    A rank started afterwards by multiprocessing (forkserver or spawn) re-imports the parent's
    ``__main__`` from its path, so it would run the console and exit 1 before training: put back
    the real one after every test."""
    main = sys.modules.get("__main__")
    yield
    if main is not None:
        sys.modules["__main__"] = main


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> Iterator[None]:
    """A process context a test starts itself (tests/test_agent_pcontext.py) installs torch's
    handlers, which turn SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception meant for the agent:
    left installed, the run would take a SIGTERM as that exception in whatever test runs next
    instead of stopping. Every test gets the run's handlers back."""
    from trainer.agent.standalone import signal_handlers_kept

    with signal_handlers_kept():
        yield


# The servers multiprocessing starts for this process live as long as it does, whichever test
# started them (tests/test_agent_pcontext.py: the run shares one fork server); the ranks they fork
# are the test's. Other processes belong elsewhere with everything below them: the watcher that
# stops the session's Kafka broker when the run ends (a test may restart the broker) and what a
# test hands to a wider fixture (tests/fixtures/processes.py).
_RUN_LONG = (b"from multiprocessing.forkserver import main", b"from multiprocessing.resource_tracker import main")
LEFT_RUNNING_GRACE_S = 15.0


def _descendants() -> dict[int, bytes]:
    """Every process below this one (children, theirs, ...), pid -> command line, from /proc;
    the broker's watcher and fixture-owned processes left out with their subtrees."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a zombie has ended; its parent reaps it
            children.setdefault(int(fields[1]), []).append(int(entry))
    watcher = broker.WATCHER_SCRIPT.encode()
    found: dict[int, bytes] = {}
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        except OSError:
            continue
        if pid in FIXTURE_OWNED or watcher in cmd:
            continue
        found[pid] = cmd
        todo += children.get(pid, [])
    return found


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Children never outlive their supervisor: whatever a test started below this process must
    be gone once the test and its fixtures are torn down (processes of module- and session-wide
    fixtures started before it or handed to them, and multiprocessing's servers, excepted). What
    is left gets ``LEFT_RUNNING_GRACE_S`` to exit, then is killed and fails the test by name, so
    one leak neither passes unseen nor slows every later test of the run. Linux only (/proc)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    before = set(_descendants())
    yield
    deadline = time.monotonic() + LEFT_RUNNING_GRACE_S
    while True:
        left = {pid: cmd for pid, cmd in _descendants().items()
                if pid not in before and not any(k in cmd for k in _RUN_LONG)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"{request.node.nodeid} left {len(left)} process(es) running (killed now): "
                    + "; ".join(f"{pid}: {cmd.decode(errors='replace')[:200]}" for pid, cmd in sorted(left.items())),
                    pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running single-node KRaft broker; RESIHP_TEST_KAFKA_BOOTSTRAP reuses one already up."""
    existing = os.environ.get("RESIHP_TEST_KAFKA_BOOTSTRAP")
    if existing:
        yield existing
        return

    data_dir = tmp_path_factory.mktemp("kafka")
    port = _free_port()
    try:
        bootstrap = broker.up(port=port, controller_port=_free_port(), data_dir=data_dir, die_with=os.getpid())
    except Exception as exc:  # noqa: BLE001 - any failure to start is a test failure, with the reason
        pytest.fail(f"the Kafka broker from infra/ did not start: {exc}", pytrace=False)
    try:
        yield bootstrap
    finally:
        broker.down(data_dir=data_dir)


@dataclasses.dataclass(frozen=True)
class BusFactory:
    """Opens a bus onto one test's log when called; ``backend`` and ``spec`` name that log, so a
    child process the test starts can open it too."""

    open: Callable[[], Bus]
    backend: str
    spec: dict[str, str | None]

    def __call__(self) -> Bus:
        return self.open()


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BusFactory]:
    """Opens buses onto one fresh, isolated log of the parametrised backend (one test = one log)."""
    opened: list[Bus] = []
    if request.param == "embedded":
        from collector.embedded import EmbeddedBus

        path = tmp_path / "bus.sqlite"

        def make() -> Bus:
            opened.append(EmbeddedBus(path))
            return opened[-1]
    else:
        from collector.kafka_bus import KafkaBus

        bootstrap = request.getfixturevalue("kafka_bootstrap")
        namespace = f"t{uuid.uuid4().hex[:10]}."

        def make() -> Bus:
            opened.append(KafkaBus(bootstrap, namespace=namespace))
            return opened[-1]

    spec = {"backend": request.param, "path": str(tmp_path / "bus.sqlite"),
            "bootstrap": request.getfixturevalue("kafka_bootstrap") if request.param == "kafka" else None,
            "namespace": namespace if request.param == "kafka" else ""}
    yield BusFactory(make, request.param, spec)
    for bus in opened:
        bus.close()


@pytest.fixture
def bus(bus_factory: BusFactory) -> Bus:
    return bus_factory()


@contextlib.contextmanager
def _recording_argv(into: list[list[str]]) -> Iterator[None]:
    """Record the argument list of every process started meanwhile (subprocess.Popen's ``args``,
    which ``run`` and the broker's detached ``sh`` go through) and what the JVM it spawns was
    given (its /proc cmdline, read once the broker runs)."""
    real_init = subprocess.Popen.__init__

    def recording_init(self, args, *rest, **kwargs):
        into.append([str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)])
        real_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = recording_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real_init  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The one single-node broker started with ``up --secure`` (SASL_SSL with the platform's CA,
    SCRAM principals and ACLs) that every secure test shares, its topics created by the admin
    principal: ``bootstrap``, ``data_dir``, ``port``, ``controller_port``, ``creds`` (principal ->
    password), ``cafile`` (the CA clients trust) and ``argv`` (the command line of every process
    the start ran). A test may stop and restart it (tests/test_bus_outage.py); whatever it leaves
    stopped is started again for the next."""
    from infra import kafka_security as security
    from resihp.commands.kafka import secure_topics

    data_dir = tmp_path_factory.mktemp("kafka-secure")
    port, controller_port = _free_port(), _free_port()
    argv: list[list[str]] = []
    with _recording_argv(argv):
        try:
            bootstrap = broker.up(port=port, controller_port=controller_port, data_dir=data_dir, secure=True,
                                  die_with=os.getpid())
            secure_topics(bootstrap, str(data_dir), "")
        except Exception as exc:  # noqa: BLE001 - any failure to start is a test failure, with the reason
            broker.down(data_dir)
            pytest.fail(f"the secure Kafka broker from infra/ did not start: {exc}", pytrace=False)
    info = {"bootstrap": bootstrap, "data_dir": data_dir, "port": port, "controller_port": controller_port,
            "creds": security.load_or_create_credentials(data_dir),
            "cafile": data_dir / security.TLS_DIR / "ca.pem", "argv": argv}
    try:
        yield info
    finally:
        broker.down(data_dir)
