"""A component's guard: the process that ties a component's whole process group to the demo.

``python -m resihp.demo.guard [--parent PID] -- CMD...`` runs ``CMD`` as its child in its own process group (the
demo starts the guard in a new session, so the guard leads it, and every process the component
starts — the trainer's ranks, Streamlit's server — joins that group unless it leaves on purpose).

Why a guard: Linux's parent-death signal (``PR_SET_PDEATHSIG``) reaches only the direct child of
the process that died, and survives ``exec``, but a Python handler does not. So the guard sets the
signal on itself (the demo's ``preexec_fn`` already did, this covers any other launcher), and when
its parent dies — even by SIGKILL, when no ``finally`` of the demo runs — it gets SIGTERM and
takes the whole group down: SIGTERM to every member, then SIGKILL after a grace period.

SIGINT is the demo's "stop cleanly" (the components commit and close their files on it): the
demo sends it to the whole group, the guard lets the component handle it and exits with the
component's exit code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

PR_SET_PDEATHSIG = 1
GRACE_S = 5.0


def set_parent_death_signal(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where unsupported
    (not Linux). ``parent_pid``: the parent expected; if it already died before the request (a
    race the kernel cannot see), the signal is sent now."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def _end_group(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the whole group, SIGKILL after ``grace_s`` (the guard itself goes with it)."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard outlives its own SIGTERM to wait
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)  # anything left, the guard included


def main(argv: list[str] | None = None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    parent = None
    if cmd[:1] == ["--parent"] and len(cmd) > 1:  # the pid the guard's parent should be (the demo)
        parent, cmd = int(cmd[1]), cmd[2:]
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        print("usage: python -m resihp.demo.guard [--parent PID] -- CMD [ARG...]", file=sys.stderr)
        return 2
    set_parent_death_signal(signal.SIGTERM, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the component gets the demo's SIGINT and stops cleanly
    child = subprocess.Popen(cmd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def stop(signum: int, frame: FrameType | None) -> None:
        _end_group(child)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    while True:
        try:
            return child.wait()
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
