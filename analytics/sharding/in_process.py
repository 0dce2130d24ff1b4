"""Sharded analytics in one process: the shards' and the merge's folds wired as the bus wires them.

Why: to tell whether N shards judge a recording as the single process does (tests, ``resihp bench
shards``) without a broker. The wiring is the bus's: rank reports and heartbeats go to the shard
holding their replica (replica mod N, as a keyed partition would), a tracing declaration to every
shard (``collector.topics.to_every_partition``), plans to every shard and the merge; every shard
reads the merge's fits; the merge applies liveness at the end of each shard's step, as its worker
does at the end of each poll."""

from __future__ import annotations

from analytics.sharding.merge import JobMerge
from analytics.sharding.shards import ReplicaShard
from collector.events import DetectorFits, Envelope, EventFactory, Heartbeat, Payload, RankIteration, ReplicaSummary, TracingDeclared


def run_sharded(events: list[Envelope], shards: int, *, replay: int = 0, job: str = "j",
                flush: bool = True) -> tuple[JobMerge, list[Payload]]:
    """The merge and what it published after ``events`` went through ``shards`` shards.
    ``replay``: shard 0 sends each summary that many more times (a successor rebuilding from the
    log). ``flush``: at the end of the events, shards and merge emit and judge what still waits
    (False: what a live run has done by then)."""
    workers = [ReplicaShard(job, f"s{i}") for i in range(shards)]
    merge = JobMerge(job)
    sf, mf = EventFactory(job, "shard"), EventFactory(job, "analytics-merge")
    out: list = []

    def to_merge(payloads: list) -> None:
        for s in payloads:
            for _ in range(1 + (replay if isinstance(s, ReplicaSummary) and s.shard == "s0" else 0)):
                published(merge.on_event(sf.make(s)))

    def published(got: list) -> None:
        out.extend(got)
        for p in got:
            if isinstance(p, DetectorFits):  # every shard reads the merge's fits
                to_merge([x for w in workers for x in w.on_event(mf.make(p))])

    replica_of = {e.payload.rank: e.payload.coords.dp for e in events if isinstance(e.payload, RankIteration)}
    for e in events:
        p = e.payload
        if isinstance(p, TracingDeclared):  # a copy in every partition (collector.topics.to_every_partition)
            for w in workers:
                got = w.on_event(e)
                heard = w.take_liveness()
                to_merge(([heard] if heard is not None else []) + got)
            published(merge.settle())
        elif isinstance(p, (RankIteration, Heartbeat)):
            w = workers[replica_of.get(getattr(p, "rank", 0), 0) % shards]
            got = w.on_event(e)
            heard = w.take_liveness()
            to_merge(([heard] if heard is not None else []) + got)
            published(merge.settle())  # as the merge worker does at the end of each poll
        elif e.kind.startswith("plan."):
            out.extend(merge.on_event(e))
            to_merge([x for w in workers for x in w.on_event(e)])
    if not flush:
        return merge, out
    to_merge([x for w in workers for x in w.flush()])
    return merge, out + merge.flush()
