"""Files only their owner reads: the embedded log with its -wal and -shm, the DuckDB projections with
their .wal, the console's users file, and the directories the platform makes for them — 0600 and
0700 whatever the umask (each test runs under umask 0, the most permissive one)."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from analytics.projections.projector import Projector
from collector.embedded import EmbeddedBus
from collector.events import EventFactory, Heartbeat
from collector import topics
from ui.auth import UsersFile


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class _Rows:
    """A projection that writes one row per event, so DuckDB has a .wal to write."""

    tables: tuple[str, ...] = ("rows",)

    def create(self, conn) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS rows (id VARCHAR)")

    def apply(self, conn, deliveries) -> None:
        for d in deliveries:
            conn.execute("INSERT INTO rows VALUES (?)", [d.event.id])


def _publish_heartbeats(bus: EmbeddedBus, n: int) -> None:
    factory = EventFactory("job", "rank-0")
    bus.publish([factory.make(Heartbeat(rank=0, epoch=0, iteration=i, interval_s=1.0)) for i in range(n)])


def test_the_embedded_log_and_its_wal_and_shm_are_0600_in_a_0700_directory(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "state" / "logs" / "bus.sqlite"
    bus = EmbeddedBus(path)
    try:
        _publish_heartbeats(bus, 3)
        side = [Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(p.exists() for p in side)
        assert {p.name: mode(p) for p in [path, *side]} == {p.name: 0o600 for p in [path, *side]}
        assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    finally:
        bus.close()


def test_an_embedded_log_made_readable_before_is_made_0600_on_open(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "bus.sqlite"
    EmbeddedBus(path).close()
    os.chmod(path, 0o644)
    bus = EmbeddedBus(path)
    try:
        assert mode(path) == 0o600
    finally:
        bus.close()


def test_a_duckdb_projection_and_its_wal_are_0600_in_a_0700_directory(tmp_path: Path, open_umask: None) -> None:
    bus = EmbeddedBus(tmp_path / "bus.sqlite")
    db = tmp_path / "analytics" / "a.duckdb"
    projector = Projector(bus, db, "g", [topics.TELEMETRY], [_Rows()])
    try:
        _publish_heartbeats(bus, 2)
        while projector.step(timeout_s=0.05):
            pass
        wal = Path(f"{db}.wal")
        assert projector.conn.execute("SELECT count(*) FROM rows").fetchone() == (2,)
        assert mode(db) == 0o600 and mode(db.parent) == 0o700
        # DuckDB gives the .wal the umask's mode (0666 here); only the closed directory keeps it private.
        assert wal.exists() and mode(wal) & 0o077 and mode(db.parent) & 0o077 == 0
    finally:
        projector.conn.close()
        bus.close()


@pytest.fixture
def open_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` with pytest's 0700 directories above it opened (0755) for the test, closed after."""
    opened = [d for d in (tmp_path, *tmp_path.parents) if d.is_relative_to(tempfile.gettempdir())
              and d != Path(tempfile.gettempdir())]
    modes = {d: mode(d) for d in opened}
    for d in opened:
        os.chmod(d, 0o755)
    try:
        yield tmp_path
    finally:
        for d, m in modes.items():
            os.chmod(d, m)


def test_a_duckdb_projection_in_a_directory_others_can_enter_is_refused(open_tmp_path: Path, open_umask: None) -> None:
    shared = open_tmp_path / "shared"
    shared.mkdir(mode=0o755)
    bus = EmbeddedBus(open_tmp_path / "bus.sqlite")
    try:
        with pytest.raises(PermissionError, match=r"open to other users \(mode 0755\).*chmod 700"):
            Projector(bus, shared / "a.duckdb", "g", [topics.TELEMETRY], [_Rows()])
        assert not (shared / "a.duckdb").exists()
        # A directory the projector makes itself, under the same open one, is closed and taken.
        projector = Projector(bus, shared / "own" / "a.duckdb", "g", [topics.TELEMETRY], [_Rows()])
        projector.conn.close()
        assert mode(shared / "own") == 0o700 and mode(shared / "own" / "a.duckdb") == 0o600
    finally:
        bus.close()


def test_the_users_file_is_0600_from_its_first_byte(tmp_path: Path, open_umask: None, monkeypatch) -> None:
    """Created with its mode, not chmod-ed after being written: with chmod turned into a no-op the
    file must still be 0600 when it takes its name."""
    path = tmp_path / "console" / "users.toml"
    seen: list[int] = []
    real_replace = os.replace

    def replace_watching(src, dst):
        seen.append(mode(Path(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_watching)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    monkeypatch.setattr(os, "fchmod", lambda *a, **k: None)
    users = UsersFile(path)
    users.add_user("alice", "operator", "pw")
    users.add_user("bob", "viewer", "pw")
    assert seen == [0o600, 0o600]
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert set(users.load()) == {"alice", "bob"}
    assert [p.name for p in path.parent.iterdir()] == ["users.toml"]  # no temporary file left behind
