"""The agent's process contexts: every rank watched on its own, optionally forked from a preloaded server.

torch's agent starts a node's ranks through a process context (``PContext``) and polls it every
monitor pass. Both of torch's contexts treat the ranks as one: the first failure stops every other
rank (``SubprocessContext`` closes them; ``MultiprocessContext``'s ``ProcessContext`` terminates
them). The platform needs the survivors to keep running after a death (``--on-failure shrink``, the
reference trainer's death policy in trainer/reference/launcher.py), and it needs ranks that start without
importing torch again (``import trainer.reference.worker`` costs ~8 CPU-seconds; eight fresh interpreters on
two cores would spend most of a short run importing). So:

* :class:`RankWatch`: the watch itself. Each rank is polled on its own; with ``release_failed`` a
  rank that exits with an error leaves the watch (:meth:`RankWatch.take_released` hands it to the
  agent) instead of ending the group, and the context is done when no watched rank runs. Without
  it, torch's rule holds: the first failure closes the rest. It can also signal one rank's process
  group and say which ranks have exited, with what code.
* :class:`WatchedSubprocessContext`: torch's ``SubprocessContext`` (a fresh interpreter per rank,
  as torchrun) under that watch.
* :class:`PreloadedContext`: each rank a process forked from multiprocessing's fork server, which
  imported the ``preload`` modules once; the server has run no compute, so forking it is safe, and
  it is reused by every later start in this interpreter (a server already running keeps the
  modules it was started with). Each rank starts its own session, as torch's ranks do, so a signal
  to its group reaches what it started too; it dies with the fork server, which exits when the agent
  does (trainer/agent/child.py's ``die_with_parent``).
* :func:`agent_contexts`: makes torch's agent start one of these two in place of its own.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.multiprocessing.api import (LogsSpecs, PContext, RunProcsResult, SubprocessContext)
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure, record


class RankWatch:
    """Each rank of a process context polled on its own (see the module's docstring).

    A mixin over a torch ``PContext``: the subclass says how to read one rank's exit code and pid."""

    nprocs: int
    error_files: dict[int, str]
    stdouts: dict[int, str]
    stderrs: dict[int, str]
    if TYPE_CHECKING:
        def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None: ...  # PContext's

    def _init_watch(self, release_failed: bool) -> None:
        self.release_failed = release_failed
        self._watched = set(range(self.nprocs))
        self._codes: dict[int, int] = {}
        self._failed: dict[int, ProcessFailure] = {}
        self._released: dict[int, ProcessFailure] = {}
        self._own: dict[int, int] = {}  # ranks that failed by themselves, before a close stopped the rest

    def exit_code(self, local_rank: int) -> int | None:
        """The rank's exit code (negative: the signal that killed it), None while it runs."""
        raise NotImplementedError

    def rank_pid(self, local_rank: int) -> int:
        raise NotImplementedError

    def exit_codes(self) -> dict[int, int]:
        """Every rank that has exited so far, watched or released, with its exit code."""
        for lr in range(self.nprocs):
            if lr not in self._codes and (code := self.exit_code(lr)) is not None:
                self._codes[lr] = code
        return dict(self._codes)

    def culprits(self) -> list[int]:
        """The local ranks whose failure ended the group: those that failed by themselves (not the
        peers the close then stopped) and, of those, the ones a signal killed when there are any. A
        rank that loses a peer mid-collective raises (exit code 1) a moment later; the peer that
        vanished raised nothing, so when both are seen in one pass the signalled one is the cause."""
        signalled = [lr for lr, code in self._own.items() if code < 0]
        return sorted(signalled or self._own)

    def take_released(self) -> dict[int, ProcessFailure]:
        """The ranks that failed and left the watch since the last call (``release_failed``)."""
        released, self._released = self._released, {}
        return released

    def signal_rank(self, local_rank: int, sig: signal.Signals) -> None:
        """``sig`` to the rank's process group (each rank leads its own); to the rank alone if it
        has not made its group yet (just forked); nothing if it is gone."""
        pid = self.rank_pid(local_rank)
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _poll(self) -> RunProcsResult | None:
        """torch's poll, rank by rank: None while a watched rank runs and none failed; else close
        what is left and return the failures (none when every failed rank was released)."""
        for lr in sorted(self._watched):
            code = self.exit_code(lr)
            if code is None:
                continue
            self._watched.discard(lr)
            if code != 0:
                self._own[lr] = code
                failure = ProcessFailure(local_rank=lr, pid=self.rank_pid(lr), exitcode=code,
                                         error_file=self.error_files[lr])
                (self._released if self.release_failed else self._failed)[lr] = failure
        if self._watched and not self._failed:
            return None
        self.close()
        for lr in sorted(self._watched):  # the peers the close stopped, as torch records them
            if (code := self.exit_code(lr)) not in (None, 0):
                self._failed[lr] = ProcessFailure(local_rank=lr, pid=self.rank_pid(lr), exitcode=code,
                                                  error_file=self.error_files[lr])
        result = RunProcsResult(failures=dict(self._failed), stdouts=self.stdouts, stderrs=self.stderrs)
        if not result.is_failed():
            result.return_values = dict.fromkeys(range(self.nprocs))
        return result


class WatchedSubprocessContext(RankWatch, SubprocessContext):
    """torch's context of one fresh interpreter per rank, each rank watched on its own."""

    def __init__(self, *args: Any, release_failed: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_watch(release_failed)

    def exit_code(self, local_rank: int) -> int | None:
        return self.subprocess_handlers[local_rank].proc.poll()

    def rank_pid(self, local_rank: int) -> int:
        return self.subprocess_handlers[local_rank].proc.pid


def _fork_server_context(preload: Sequence[str]) -> Any:
    """multiprocessing's forkserver context, its server to import ``preload`` and this module (a
    rank's first steps import nothing)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*preload, __name__])
    return ctx


def start_fork_server(preload: Sequence[str]) -> None:
    """Start the fork server now rather than at the first rank: an agent that waits in the
    rendezvous (for its peers, for a place as a spare, or to be taken into a running job) has its
    ranks' imports done meanwhile. The server ends with this process (multiprocessing's forkserver
    watches its parent's pipe)."""
    from multiprocessing import forkserver

    _fork_server_context(preload)
    forkserver.ensure_running()


class PreloadedContext(RankWatch, PContext):
    """Ranks forked from a fork server that imported ``preload``; ``entrypoint`` is a function
    (picklable by reference) called with each rank's arguments, its environment set first."""

    def __init__(self, name: str, entrypoint: Callable, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 logs_specs: LogsSpecs, *, preload: Sequence[str], release_failed: bool,
                 log_line_prefixes: dict[int, str] | None = None) -> None:
        super().__init__(name, entrypoint, args, envs, logs_specs, log_line_prefixes)
        self.preload = list(preload)
        self._procs: dict[int, BaseProcess] = {}
        self._init_watch(release_failed)

    def _start(self) -> None:
        if self._procs:
            raise ValueError("the preloaded ranks are already started; a context starts once")
        ctx = _fork_server_context(self.preload)
        for lr in range(self.nprocs):
            env = {**os.environ, **self.envs[lr]}  # as a fresh interpreter would inherit it
            self._procs[lr] = ctx.Process(target=_preloaded_rank, name=f"{self.name}-{lr}", args=(
                self.entrypoint, self.args[lr], env, self.stdouts[lr], self.stderrs[lr]))
        for p in self._procs.values():
            p.start()

    def exit_code(self, local_rank: int) -> int | None:
        return self._procs[local_rank].exitcode

    def rank_pid(self, local_rank: int) -> int:
        pid = self._procs[local_rank].pid
        if pid is None:
            raise RuntimeError(f"local rank {local_rank} was never started")
        return pid

    def pids(self) -> dict[int, int]:
        return {lr: self.rank_pid(lr) for lr in self._procs}

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        """``death_sig`` to every live rank's group; SIGKILL what is left after ``timeout``."""
        live = [lr for lr, p in self._procs.items() if p.exitcode is None]
        for lr in live:
            self.signal_rank(lr, death_sig)
        end = time.monotonic() + timeout
        for lr in live:
            self._procs[lr].join(max(0.0, end - time.monotonic()))
        for lr in live:
            if self._procs[lr].exitcode is None:
                self.signal_rank(lr, signal.SIGKILL)
                self._procs[lr].join(timeout)


def _preloaded_rank(entrypoint: Callable, args: tuple, env: dict[str, str], stdout: str, stderr: str) -> None:
    """A preloaded rank's first steps: its own session, death with the fork server (which exits
    with the agent), the agent's environment and log files, then the entrypoint."""
    from trainer.agent.child import die_with_parent

    os.setsid()
    die_with_parent(None)
    _let_go_of_the_fork_server()
    os.environ.update(env)
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path:
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
    record(entrypoint)(*args)


def _let_go_of_the_fork_server() -> None:
    """Close this rank's copy of the fork server's liveness pipe.

    The fork server exits when the last writer of that pipe closes it; multiprocessing hands
    every process the server forks a copy (so it could use the server too). Kept, the ranks
    would hold the server alive after the agent dies, and the server would hold them (they die
    with it): a SIGKILLed agent would leave both running. A rank that asks for a forkserver
    process later starts a server of its own."""
    from multiprocessing import forkserver

    state = vars(forkserver._forkserver)  # the only handle on the inherited descriptor (private)
    alive = state.get("_forkserver_alive_fd")
    if alive is not None:
        os.close(alive)
        state["_forkserver_alive_fd"] = None


@contextmanager
def agent_contexts(*, preload: Sequence[str], release_failed: bool,
                   extra_env: Mapping[str, str]) -> Iterator[None]:
    """While open, torch's agent starts its ranks in a :class:`PreloadedContext` (``preload``
    given) or a :class:`WatchedSubprocessContext`, each rank's environment extended by ``extra_env``.

    torch's ``LocalElasticAgent._start_workers`` builds every rank's environment and arguments and
    then calls its module's ``start_processes``, which can only make torch's two contexts; this
    swaps that one call for the duration of a start, so the rest of torch's start stays torch's."""
    original = local_elastic_agent.start_processes

    def start_processes(*, name: str, entrypoint: Callable | str, args: dict[int, tuple],
                        envs: dict[int, dict[str, str]], logs_specs: LogsSpecs,
                        log_line_prefixes: dict[int, str] | None = None, **kwargs: Any) -> PContext:
        envs = {lr: {**env, **extra_env} for lr, env in envs.items()}
        context: PContext
        if preload:
            if isinstance(entrypoint, str):
                raise ValueError(f"preloaded ranks run a Python function, not the program {entrypoint!r}")
            context = PreloadedContext(name, entrypoint, args, envs, logs_specs, preload=preload,
                                       release_failed=release_failed, log_line_prefixes=log_line_prefixes)
        elif isinstance(entrypoint, str):
            context = WatchedSubprocessContext(name, entrypoint, args, envs, logs_specs, log_line_prefixes,
                                               kwargs.get("numa_options"), kwargs.get("duplicate_stdout_filters"),
                                               kwargs.get("duplicate_stderr_filters"), release_failed=release_failed)
        else:
            raise ValueError("the node agent runs a program, or a function with preloaded modules; got a function "
                             "and no modules to preload")
        try:
            context.start()
        except BaseException:
            context.close()
            raise
        return context

    setattr(local_elastic_agent, "start_processes", start_processes)  # noqa: B010 - torch's one call site
    try:
        yield
    finally:
        setattr(local_elastic_agent, "start_processes", original)  # noqa: B010
