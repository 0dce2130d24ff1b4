"""The launcher ↔ ranks protocol over the launcher's TCPStore: posts, arrivals, outcomes.

The launcher (trainer/intake.py) *posts* each plan it wants run; posts are numbered P = 0, 1, 2 …
(P = 0 is the plan the job starts with) and a post is never rewritten, so a rank can never read
half of one plan and half of another. An epoch that failed can be posted again under a new P.

Keys:

* ``post/P``: ``{"epoch", "plan", "world"}`` — the plan and the live devices (world order) of post P;
* ``control/post``: the newest P (written after ``post/P``); ranks read it at every commit;
* ``arrive/P/D``: device D reached post P's rendezvous (see :func:`await_arrivals`);
* ``abort/P``: the launcher gave up on post P (a device of its world died before everyone arrived);
* ``done/P/D`` / ``failed/P/D``: D's outcome of the reshape to post P (JSON report / reason);
* ``progress``: the last committed iteration (world rank 0 writes it);
* ``probe/Q`` / ``control/probe``: the detector's Q-th probe request (Q = 1, 2 …) and the newest Q
  (0: none yet); ranks read it at every commit and run it at that boundary (trainer/probe.py);
* ``pg/P/…``: the torch.distributed rendezvous of post P's default process group.

Why an arrival barrier before ``init_process_group``: c10d's rendezvous can only fail by its
timeout (minutes, so that a survivor noticing a failure late still finds the others waiting). If a
device named by the post dies before it arrives, the launcher writes ``abort/P`` and the waiting
ranks return at once (``PostAborted``) and wait for the next post instead of for a timeout.
A device dying *after* every device arrived — inside the few milliseconds of the c10d
rendezvous, or during the state transfer — is not reached by an abort: the ranks find out from a
failed collective, write ``failed/P/D``, go back to the running epoch and wait for the next post
(trainer/executor.py). A post that only moves micro-batches between replicas (same world and
stages) needs no rendezvous at all: past the arrival barrier the ranks switch to its plan and
report ``source`` ``GROUPS_KEPT``.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

from collector.events import ProbeRequest
from collector.plan import Plan

CONTROL_POST = "control/post"
CONTROL_PROBE = "control/probe"
PROGRESS = "progress"
GROUPS_KEPT = "groups kept"  # a done report's source when only micro-batch counts changed


class PostAborted(RuntimeError):
    """The launcher aborted this post (a device of its world died); wait for the next one."""


@dataclass(frozen=True)
class Post:
    number: int
    plan: Plan
    world: tuple[int, ...]


def store_key(what: str, *numbers: int) -> str:
    """A protocol's key in the launcher's store: what it holds, then the post's number (and the
    device's, for one device's answer), slash-separated: ``done/3/5``. Every key of this module and
    of the native executor's command posts (trainer/native/intake.py) is made here."""
    return "/".join((what, *map(str, numbers)))


post_key = functools.partial(store_key, "post")  # (P): the plan and world of post P
done_key = functools.partial(store_key, "done")  # (P, D): D's report of the reshape to post P
failed_key = functools.partial(store_key, "failed")  # (P, D): why D's reshape to post P failed
arrive_key = functools.partial(store_key, "arrive")  # (P, D): D reached post P's rendezvous
abort_key = functools.partial(store_key, "abort")  # (P): the launcher gave up on post P


def pg_prefix(number: int) -> str:
    return f"pg/{number}/"


def write_post(store, number: int, plan: Plan, world: tuple[int, ...]) -> None:
    """Publish post ``number`` (the launcher only); ``control/post`` last, so it is complete."""
    store.set(post_key(number), json.dumps({"epoch": plan.epoch, "plan": plan.model_dump(mode="json"),
                                            "world": list(world)}))
    store.set(CONTROL_POST, str(number))


def read_post(store, number: int) -> Post:
    data = json.loads(store.get(post_key(number)))
    return Post(number, Plan.model_validate(data["plan"]), tuple(data["world"]))


def newest_post(store) -> int:
    return int(store.get(CONTROL_POST))


def write_probe(store, number: int, request: ProbeRequest) -> None:
    """Publish probe request ``number`` (the launcher only; ``control/probe`` last)."""
    store.set(f"probe/{number}", request.model_dump_json())
    store.set(CONTROL_PROBE, str(number))


def read_probe(store, number: int) -> ProbeRequest:
    return ProbeRequest.model_validate_json(store.get(f"probe/{number}"))


def newest_post_and_probe(store) -> tuple[int, int]:
    """The newest post and probe numbers, in one round trip (every rank asks at every commit)."""
    post, probe = store.multi_get([CONTROL_POST, CONTROL_PROBE])
    return int(post), int(probe)


def await_arrivals(store, number: int, world: tuple[int, ...], device: int, timeout_s: float,
                   poll_s: float = 0.01) -> None:
    """Mark ``device`` arrived at post ``number`` and wait for the whole world.

    Raises ``PostAborted`` as soon as the launcher aborts the post (unless everyone had already
    arrived: then every rank goes on, so they all decide alike), ``TimeoutError`` after ``timeout_s``.
    """
    store.set(arrive_key(number, device), "1")
    keys = [arrive_key(number, d) for d in world]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if store.check([abort_key(number)]):
            raise PostAborted(f"post {number}: {store.get(abort_key(number)).decode()}")
        if time.monotonic() > deadline:
            missing = [d for d in world if not store.check([arrive_key(number, d)])]
            raise TimeoutError(f"post {number}: devices {missing} did not arrive within {timeout_s:.0f} s")
        time.sleep(poll_s)
