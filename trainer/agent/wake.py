"""Waiting on a peer that may be gone: a wait that ends when the agent counts a lost rank.

A rank learns of a dead peer from gloo only when its own socket to that peer closes. A rank that
waits on a *live* peer which has itself given up (it left the collective to recover) gets no
error until the group's timeout: seconds, and longer on a loaded machine. Neither ``abort`` nor
``shutdown`` of a gloo group wakes it in torch 2.15 — they close no socket, so the peers of the
rank that calls them go on waiting too.

Whoever supervises the ranks knows of a death within its monitor interval, and counts it in the
ranks' store before it marks the rank (``resihp/lost-count`` then ``resihp/lost/<rank>``,
trainer/agent/shrink.py's ``mark_lost``: the node agent under ``--on-failure shrink``, the
reference trainer's and the native executor's controllers). So every wait that must end when a
peer is lost runs its collective with ``async_op=True`` and waits in slices of ``poll_s``, reading
the count between slices (:func:`wait_or_lost`): a collective that completes within the first
slice costs no store round trip, and a rank blocked on a lost world wakes within the agent's
monitor interval plus one slice. The count is only a wake-up (anyone who reaches the store can
add to it): a rank woken for nothing recovers into the same world, it is never dropped.

One rule, two users: ``ShrinkingWorld`` (trainer/agent/shrink.py) waits through it with its own
count, and an executor's rank installs one :class:`LossWatch` for its process
(:func:`watch_losses`), through which every wait of its own collectives then goes (:func:`wait`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

LOST_COUNT_KEY = "resihp/lost-count"  # the agent adds to it before it sets a rank's lost mark
POLL_S = 0.002
T = TypeVar("T")


class PeerLost(RuntimeError):
    """A rank of this world was lost while this rank waited in a collective."""


# Where waits that cannot be sliced run (call_or_lost); an abandoned one holds its thread until
# the group's timeout ends it, so there are several.
_callers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="resihp-wait")


def call_or_lost(fn: Callable[[], T], lost: Callable[[], bool], op: str, poll_s: float = POLL_S,
                 committed: Callable[[], bool] | None = None) -> T:
    """``fn()`` run on a thread of a pool while this thread polls ``lost()`` every ``poll_s``;
    ``PeerLost`` as soon as it says a peer was lost, leaving ``fn`` behind. For a wait inside
    code that is not ours (a torch pipelining schedule, DTensor's collectives): ``fn`` then stays
    blocked until its group's timeout ends it with an error nobody reads. Whatever ``fn`` still
    touches after that must not be what the caller recovers from (its groups are abandoned, and a
    step ``fn`` abandoned cannot commit: the commit needs the lost rank too).

    ``committed``: whether ``fn`` is past its last wait on a peer (a step past its commit
    all-reduce, with only local work left). A loss seen then is the next step's: ``fn`` is waited
    for to its end, since abandoning it would leave its commit half applied (every peer counts
    the step, this rank would not)."""
    future = _callers.submit(fn)
    while True:
        try:
            return future.result(timeout=poll_s)
        except FutureTimeout:
            if lost():
                if committed is not None and committed():
                    return future.result()
                raise PeerLost(f"{op}: a rank of this world was lost while this rank waited") from None


def wait_or_lost(work: Any, lost: Callable[[], bool], op: str, poll_s: float = POLL_S, p2p: bool = False) -> None:
    """Wait for ``work`` (started with ``async_op=True``, or an ``isend`` / ``irecv``) in slices of
    ``poll_s``; ``PeerLost`` as soon as ``lost()`` says a peer was lost between slices. The
    operation's own error (a peer's socket closed, its timeout) is raised as it is.

    A collective's work is waited on with a timeout, which leaves it pending when the slice ends.
    A gloo send or receive (``p2p``) cannot be: its timed wait closes the connection to the peer
    when the slice ends, and it never reports itself completed, so it is waited on whole by a
    thread of a pool while this thread polls (:func:`call_or_lost`)."""
    if p2p:
        call_or_lost(work.wait, lost, op, poll_s)
        return
    step = timedelta(seconds=poll_s)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # it ended within the slice: its own result or error
                return
        if lost():
            raise PeerLost(f"{op}: a rank of this world was lost while this rank waited")


class LossWatch:
    """The loss count of one world as this rank last saw it, in ``store`` (the ranks' store)."""

    def __init__(self, store: dist.Store, poll_s: float = POLL_S) -> None:
        self.store, self.poll_s = store, poll_s
        self.seen = self.count()

    def count(self) -> int:
        return self.store.add(LOST_COUNT_KEY, 0)

    def moved(self) -> bool:
        """Whether a loss was counted since :meth:`rearm` (or the watch began)."""
        return self.count() != self.seen

    def rearm(self) -> None:
        """The world this rank waits in now was formed after every loss counted so far: only a
        later one should wake it (call it once the new world's group exists)."""
        self.seen = self.count()

    def wait(self, work: Any, op: str, p2p: bool = False) -> None:
        wait_or_lost(work, self.moved, op, self.poll_s, p2p)

    def call(self, fn: Callable[[], T], op: str, committed: Callable[[], bool] | None = None) -> T:
        return call_or_lost(fn, self.moved, op, self.poll_s, committed)


_watch: LossWatch | None = None  # this process's, once its executor installed one


def watch_losses(store: dist.Store, poll_s: float = POLL_S) -> LossWatch:
    """Install this process's watch over ``store``'s loss count: from now on :func:`wait` wakes on
    a loss. One per rank process, since a rank waits in one world at a time."""
    global _watch
    _watch = LossWatch(store, poll_s)
    return _watch


def rearm() -> None:
    """The process's watch (if any) forgets the losses counted so far (:meth:`LossWatch.rearm`)."""
    if _watch is not None:
        _watch.rearm()


def wait(work: Any, op: str, p2p: bool = False) -> None:
    """Wait for ``work``: through the process's watch when one is installed (``PeerLost`` on a
    loss), else plainly (a rank run without a supervisor, an in-process test). ``None`` work (a
    collective this rank is outside of) is nothing to wait for."""
    if work is None:
        return
    if _watch is None:
        work.wait()
    else:
        _watch.wait(work, op, p2p)
