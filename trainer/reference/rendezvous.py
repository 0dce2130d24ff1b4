"""The launcher ↔ ranks protocol over the launcher's TCPStore: posts, arrivals, outcomes.

The launcher (trainer/reference/intake.py) *posts* each plan it wants run; posts are numbered P = 0, 1, 2 …
(P = 0 is the plan the job starts with) and a post is never rewritten, so a rank can never read
half of one plan and half of another. An epoch that failed can be posted again under a new P.

Keys (every value a signed record, trainer/agent/signed_store.py, scoped to the launcher's run id:
the launcher signs posts, probes and aborts, the ranks their arrivals, outcomes and progress;
a record that does not verify is refused, reported, and read as absent):

* ``post/P``: ``{"epoch", "plan", "world"}`` — the plan and the live devices (world order) of post P;
* ``control/post``: ``{"newest": P}`` (written after ``post/P``); ranks read it at every commit;
* ``arrive/P/D``: device D reached post P's rendezvous (see :func:`await_arrivals`);
* ``abort/P``: the launcher gave up on post P (a device of its world died before everyone arrived);
* ``done/P/D`` / ``failed/P/D``: D's outcome of the reshape to post P (JSON report / reason);
* ``progress``: the last committed iteration (world rank 0 writes it);
* ``probe/Q`` / ``control/probe``: the detector's Q-th probe request (Q = 1, 2 …) and the newest Q
  (0: none yet); ranks read it at every commit and run it at that boundary (trainer/reference/probe.py);
* ``pg/P/…``: the torch.distributed rendezvous of post P's default process group (torch's own
  keys, unsigned: a stranger who writes there can make the group fail to form, which the ranks
  recover from like any failed rendezvous; docs/security.md, "The rendezvous store").

Why an arrival barrier before ``init_process_group``: c10d's rendezvous can only fail by its
timeout (minutes, so that a survivor noticing a failure late still finds the others waiting). If a
device named by the post dies before it arrives, the launcher writes ``abort/P`` and the waiting
ranks return at once (``PostAborted``) and wait for the next post instead of for a timeout.
A device dying *after* every device arrived — inside the few milliseconds of the c10d
rendezvous, or during the state transfer — is not reached by an abort: the ranks find out from a
failed collective, write ``failed/P/D``, go back to the running epoch and wait for the next post
(trainer/reference/executor.py). A post that only moves micro-batches between replicas (same world and
stages) needs no rendezvous at all: past the arrival barrier the ranks switch to its plan and
report ``source`` ``GROUPS_KEPT``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collector.events import ProbeRequest
from collector.plan import Plan
from trainer.agent.signed_store import RANK_WRITERS, RecordRefused, SignedStore
from trainer.protocol import store_key

CONTROL_POST = "control/post"
CONTROL_PROBE = "control/probe"
PROGRESS = "progress"
GROUPS_KEPT = "groups kept"  # a done report's source when only micro-batch counts changed


class PostAborted(RuntimeError):
    """The launcher aborted this post (a device of its world died); wait for the next one."""


class PostRefused(PostAborted):
    """What the store holds as this post is not the launcher's signed post (a stranger wrote or
    overwrote it): refused and reported; the rank says so (``failed/P/D``) and waits for the next."""


@dataclass(frozen=True)
class Post:
    number: int
    plan: Plan
    world: tuple[int, ...]


post_key = functools.partial(store_key, "post")  # (P): the plan and world of post P
done_key = functools.partial(store_key, "done")  # (P, D): D's report of the reshape to post P
failed_key = functools.partial(store_key, "failed")  # (P, D): why D's reshape to post P failed
arrive_key = functools.partial(store_key, "arrive")  # (P, D): D reached post P's rendezvous
abort_key = functools.partial(store_key, "abort")  # (P): the launcher gave up on post P


def pg_prefix(number: int) -> str:
    return f"pg/{number}/"


def write_post(records: SignedStore, number: int, plan: Plan, world: tuple[int, ...]) -> None:
    """Publish post ``number`` (the launcher only); ``control/post`` last, so it is complete."""
    records.set(post_key(number), {"epoch": plan.epoch, "plan": plan.model_dump(mode="json"), "world": list(world)})
    records.set(CONTROL_POST, {"newest": number})


def _post(number: int) -> Callable[[Any], Post]:
    def parse(body: Any) -> Post:
        return Post(number, Plan.model_validate(body["plan"]), tuple(int(d) for d in body["world"]))

    return parse


def read_post(records: SignedStore, number: int) -> Post:
    """Post ``number`` (waits for it, as ``store.get`` does); ``PostRefused`` when what the store
    holds there is not the launcher's signed post (reported)."""
    try:
        return records.get(post_key(number), _post(number))
    except RecordRefused as exc:
        raise PostRefused(f"post {number}: {exc.reason}") from None


def _newest(body: Any) -> int:
    """A pointer's body: ``{"newest": N}``."""
    value = body["newest"]
    if type(value) is not int or value < 0:
        raise ValueError(f"newest is {value!r}, not a count")
    return value


def newest_post(records: SignedStore, known: int = 0) -> int:
    """The newest post number the launcher signed; ``known`` (the newest this rank already has)
    when the pointer is missing or refused: a forged pointer announces nothing."""
    newest = records.read(CONTROL_POST, _newest)
    return known if newest is None else max(newest, known)


def write_probe(records: SignedStore, number: int, request: ProbeRequest) -> None:
    """Publish probe request ``number`` (the launcher only; ``control/probe`` last)."""
    records.set(f"probe/{number}", request.model_dump(mode="json"))
    records.set(CONTROL_PROBE, {"newest": number})


def read_probe(records: SignedStore, number: int) -> ProbeRequest | None:
    """Probe request ``number``; None when the store holds no signed one there (refused, reported:
    every rank reads the same bytes, so every rank skips it alike)."""
    return records.read(f"probe/{number}", ProbeRequest.model_validate)


def newest_post_and_probe(records: SignedStore, known_post: int, known_probe: int) -> tuple[int, int]:
    """The newest post and probe numbers, in one round trip (every rank asks at every commit); a
    pointer that is refused reads as the ``known`` one."""
    post, probe = records.read_many([CONTROL_POST, CONTROL_PROBE], _newest)
    return max(known_post, -1 if post is None else post), max(known_probe, -1 if probe is None else probe)


def await_first_post(records: SignedStore, timeout_s: float, poll_s: float = 0.05) -> Post:
    """The post a starting rank joins: the newest one that verifies. A forged or overwritten post
    is refused (reported) and waited past, until ``timeout_s``: then ``PostRefused``."""
    deadline = time.monotonic() + timeout_s
    while True:
        number = newest_post(records)
        try:
            return read_post(records, number)
        except PostRefused:
            if time.monotonic() > deadline:
                raise
        time.sleep(poll_s)


def await_arrivals(records: SignedStore, number: int, world: tuple[int, ...], device: int, timeout_s: float,
                   poll_s: float = 0.01) -> None:
    """Mark ``device`` arrived at post ``number`` and wait for the whole world.

    Raises ``PostAborted`` as soon as the launcher aborts the post (unless everyone had already
    arrived: then every rank goes on, so they all decide alike), ``TimeoutError`` after ``timeout_s``.
    Only signed arrivals and aborts count: a forged one is refused (reported) and waited past.
    """
    records.set(arrive_key(number, device), {"device": device})
    arrived: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        arrived |= {d for d in world if d not in arrived and records.valid(arrive_key(number, d), RANK_WRITERS)}
        if len(arrived) == len(world):
            return
        reason = records.read(abort_key(number))
        if isinstance(reason, str):
            raise PostAborted(f"post {number}: {reason}")
        if time.monotonic() > deadline:
            missing = [d for d in world if d not in arrived]
            raise TimeoutError(f"post {number}: devices {missing} did not arrive within {timeout_s:.0f} s")
        time.sleep(poll_s)
