"""After a native rank dies: who survived, and the plan they train on without it.

A SIGKILLed rank closes its sockets, so the gloo collectives its peers are in raise ("Connection
closed by peer"). Those peers do not tear the job down: each one closes a quorum in the job's
store the way trainer/agent/shrink.py's ``ShrinkingWorld.close`` does — it writes
``native/recover/<epoch>/join/<device>`` with the iterations it has committed, then waits until
every device of the running world has either joined or been marked lost by whoever supervises
the ranks — the node agent under ``--on-failure shrink``, which the native launcher runs too —
under the agent's one key, ``resihp/lost/<rank>`` (``mark_lost``; a device is its process's
global rank). The survivors, the same set on every
one of them, then reshape to :func:`survivor_plan` through the executor's own phases: a stage that
lost a device goes on at a smaller TP degree on its TP peers, and only a replica that cannot (its
stage's only device died) is dropped.

What can fail: a device that neither joins nor is marked lost (a peer blocked in a collective
with a live rank that itself left: gloo's ``abort`` in torch 2.15 does not wake a pending wait,
so that peer joins only once the group's timeout fires; or a supervisor that never marks the
dead) — ``close_quorum`` raises after twice ``timeout_s``, naming it. Survivors that committed different
iteration counts (a rank died inside the loss all-reduce that commits an iteration, after some
peers got its result) are refused: nothing here can tell which update is the right one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from collector.plan import PipelinePlan, Plan
from trainer.agent.shrink import is_lost
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.agent.wake import PeerLost

POLL_S = 0.01

__all__ = ["Quorum", "close_quorum", "peer_failure", "survivor_plan"]

# What gloo says when a peer's process is gone, or a peer never answered within the group timeout.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")


def peer_failure(exc: BaseException) -> bool:
    """Whether a failed step looks like a lost peer (worth a recovery) rather than this rank's own
    error (re-raised at once, so a bug is not mistaken for a death and retried). The whole chain
    is read: pipelining re-raises a chunk's failure as its own ``RuntimeError``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dist.DistError | PeerLost) or any(s in str(seen) for s in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True)
class Quorum:
    """The devices that go on, those lost, and the iterations every survivor has committed."""

    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    committed: int


def close_quorum(store: SignedStore, epoch: int, world: tuple[int, ...], device: int, committed: int,
                 timeout_s: float) -> Quorum:
    """Join the recovery to ``epoch`` and wait until every device of ``world`` joined or was
    marked lost (``resihp/lost/<device>``: a device is its process's global rank, the one its
    node agent marks), for up to twice the
    collective timeout ``timeout_s``. Signed joins and marks only (trainer/agent/signed_store.py):
    a forged one is refused, reported, and waited past."""
    prefix = f"native/recover/{epoch}/join/"
    store.set(f"{prefix}{device}", {"committed": committed})
    # A survivor blocked on a live peer that already left only joins once its collective times
    # out (``timeout_s``): wait for it twice that.
    deadline = time.monotonic() + 2 * timeout_s
    while True:
        counts = {d: c for d in world if (c := store.read(f"{prefix}{d}", _committed, RANK_WRITERS)) is not None}
        joined = [d for d in world if d in counts]
        lost = [d for d in world if d not in joined and is_lost(store, d)]
        if len(joined) + len(lost) == len(world):
            break
        if time.monotonic() > deadline:
            silent = sorted(set(world) - set(joined) - set(lost))
            raise TimeoutError(f"recovery to epoch {epoch}: devices {silent} neither rejoined nor were marked lost "
                               f"within {2 * timeout_s:g} s (a peer blocked on a live rank waits out the collective "
                               "timeout; lower --timeout or check that the launcher supervises every rank)")
        time.sleep(POLL_S)
    if not lost:
        raise RuntimeError(f"recovery to epoch {epoch}: every device of {list(world)} is alive; the failure was "
                           "not a lost rank")
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"recovery to epoch {epoch}: survivors committed different iteration counts {counts} "
                           "(a rank died inside the commit all-reduce); restart from a DCP checkpoint (--resume-dir)")
    return Quorum(tuple(joined), tuple(lost), committed)


def survivor_plan(plan: Plan, lost: tuple[int, ...], fits: Callable[[int], bool] = lambda tp: False) -> Plan:
    """``plan`` at the next epoch without the lost devices. A stage that lost some of its TP group
    goes on at a smaller degree on the rest (TP exclusion: its layers, its replica's micro-batches
    and every other stage unchanged) when ``fits(new degree)``; a replica whose stage cannot (its
    only device died, or the smaller degree cannot cut the model) is dropped, its micro-batches
    given, one at a time, to the surviving replica running fewest (the lowest replica among
    equals), so the global batch is kept. ``ValueError`` when no replica survives."""
    gone = set(lost)

    def excluded(p: PipelinePlan) -> PipelinePlan | None:
        stages = []
        for s in p.stages:
            rest = tuple(d for d in s.devices if d not in gone)
            if len(rest) < len(s.devices) and not (rest and fits(len(rest))):
                return None
            stages.append(s if len(rest) == len(s.devices) else s.model_copy(update={"devices": rest}))
        return p.model_copy(update={"stages": tuple(stages)})

    kept = [q for p in plan.pipelines if (q := excluded(p)) is not None]
    if not kept:
        raise ValueError(f"every replica of plan epoch {plan.epoch} lost a device ({sorted(gone)}) it cannot run "
                         "without: no pipeline survives to train on; restart from a DCP checkpoint (--resume-dir)")
    counts = [p.microbatches for p in kept]
    for _ in range(plan.global_microbatches - sum(counts)):
        counts[counts.index(min(counts))] += 1
    return Plan(epoch=plan.epoch + 1, schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                num_layers=plan.num_layers, pipelines=tuple(
                    PipelinePlan(replica=r, microbatches=n, stages=p.stages)
                    for r, (p, n) in enumerate(zip(kept, counts, strict=True))))


def _committed(body: Any) -> int:
    """A survivor's join: ``{"committed": N}``, the iterations it has committed."""
    committed = body["committed"]
    if type(committed) is not int:
        raise ValueError(f"committed {committed!r} is not a count")
    return committed
