"""The wrapper every rank runs in: ``python -m trainer.agent.child [-m] SCRIPT ARGS…``.

Why a wrapper: torch's agent starts each rank in its own session (so it can kill the rank's
whole process group), but a session does not die with its parent. If the agent is SIGKILLed,
nothing would stop its ranks; they would sit in a collective holding the node's devices. The
wrapper asks the kernel to SIGKILL the rank when the agent dies (``prctl(PR_SET_PDEATHSIG)``) and,
because the agent may have died before that call, exits at once if its parent is no longer the
agent. It also registers faulthandler on SIGUSR1 so the agent can collect every thread's stack
into a hang report without stopping the rank. Then it runs the user's script as ``__main__``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import runpy
import signal
import sys

from collector.settings import elastic_environment, environment

AGENT_PID_ENV = "RESIHP_AGENT_PID"
STACK_DIR_ENV = "RESIHP_STACK_DIR"
PR_SET_PDEATHSIG = 1
STACK_SIGNAL = signal.SIGUSR1


def die_with_parent(expected_parent: int | None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has (the race between
    the agent's fork and this call). Linux only: elsewhere the process-group kill is all there is."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def stack_file_path(stack_dir: str, local_rank: int | str) -> str:
    return os.path.join(stack_dir, f"local-{local_rank}.stacks")


def run_script(*argv: str) -> None:
    """The entry point of a rank forked from the agent's preloaded fork server (``--preload``):
    its parent is the fork server, which exits when the agent dies, so the death signal still
    follows the agent."""
    _run(list(argv), expected_parent=None)


def main(argv: list[str]) -> None:
    _run(argv, expected_parent=environment().agent_pid)


def _run(argv: list[str], expected_parent: int | None) -> None:
    die_with_parent(expected_parent)
    stack_dir = environment().stack_dir
    if stack_dir:
        # Kept open for the life of the process: faulthandler writes to the descriptor from a
        # signal handler, where nothing can be opened.
        stacks = open(stack_file_path(stack_dir, str(elastic_environment().LOCAL_RANK)), "w")
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    if not argv:
        raise SystemExit("usage: python -m trainer.agent.child [-m] SCRIPT [ARGS...]")
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
