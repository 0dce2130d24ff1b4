"""Files only their owner reads: the embedded log, the DuckDB projections, the console's users file.

Why: every event is on the bus file, signed ones included, and the DuckDB files hold what analytics
derived from them; a file any local user can read hands them all out. Python's ``open`` and the
databases create files with mode 0666 (or 0644) less the process's umask, so the umask would decide
who reads them. Here the mode is stated: files are created 0600 (``os.open`` with that mode, then
``fchmod``, since the umask can only take bits away), and every directory these helpers make is
0700.

DuckDB gives no say over the mode of its write-ahead log (``NAME.duckdb.wal``, deleted at each
checkpoint and created again with 0666 less the umask), so a DuckDB file must sit in a directory
others cannot enter: :func:`require_private_dir` refuses one that is open, naming the fix.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p path``, each directory it makes 0700 whatever the umask; existing ones keep their mode
    (it may be the working directory, or /tmp)."""
    path = Path(path)
    missing: list[Path] = []
    for d in (path, *path.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:  # another process made it between the check and here
            continue
        os.chmod(d, DIR_MODE)
    return path


def is_private_dir(path: str | os.PathLike[str]) -> bool:
    """Whether no one but its owner can reach files under ``path``: it, or a directory above it, is
    owned by this user and gives group and others no search (x) permission."""
    uid = os.geteuid()
    here = Path(path).resolve()
    for d in (here, *here.parents):
        try:
            st = d.stat()
        except OSError:
            return False
        if st.st_uid == uid and not st.st_mode & (stat.S_IXGRP | stat.S_IXOTH):
            return True
    return False


def require_private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Make ``path``'s missing directories (0700) and refuse it when others can enter it."""
    folder = private_dir(path)
    if not is_private_dir(folder):
        mode = stat.S_IMODE(folder.stat().st_mode)
        raise PermissionError(
            f"{what}: directory {folder} is open to other users (mode {mode:04o}), and the files written there "
            f"would be readable by them; run `chmod 700 {folder}` or choose a path under a directory only you can enter "
            "(the platform makes the directories it creates 0700)")
    return folder


def create_private_file(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` empty with mode 0600 unless it exists; True when this call made it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return True


def tighten(path: str | os.PathLike[str]) -> None:
    """Make an existing file of this user 0600 when group or others may read or write it (a file
    created before its creator stated the mode); logged, since someone may have meant to share it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, FILE_MODE)
        log.warning("%s was readable by other users (mode %04o); made it 0600", path, stat.S_IMODE(st.st_mode))


def write_new_file(path: str | os.PathLike[str], data: bytes, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``path``, a file this call creates (``O_EXCL``: no one can plant it first)
    with ``mode`` from its first byte, whatever the umask, and flushed to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, mode 0600 from its first byte: written to a fresh
    file beside it and renamed into place."""
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_new_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
