"""The merge step of sharded analytics: per-replica frames in, the job-level verdict out.

Shards (analytics/shards.py) each flatten whole DP replicas; this one process per job collects an
iteration's ``ReplicaFrame``s, concatenates them into the frame a single analytics process would
have built (rows sorted by rank, as ``build_frame`` sorts them), and hands it to the unchanged
``Detector.process_frame``: the cost-model fit, the centring across replicas, the CUSUMs and the
incident book all run once, on the whole job, so the incidents are those of the single process.

An iteration is judged once every replica of its epoch's plan (``plan.current`` or a reconfigure
command, read from the control topic) sent its frame, strictly in order. Without the plan the merge
cannot know how many replicas make the job, and judging the replicas that happened to arrive first
would centre the job on a part of it: it waits (``flush`` at the end of a recording judges what is
there). Trainers and the simulator announce their plan before their first iteration. The first
frame of each (epoch, iteration, replica) counts; a copy (a shard replaying after a rebalance) and a
frame of an iteration already judged are dropped and counted in ``duplicates``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from analytics.detector import Detector
from analytics.detector_config import DetectorConfig
from analytics.frame import IterationFrame, LayerLookup
from analytics.shards import CHUNK_COLUMNS, COMM_COLUMNS, INT_COLUMNS, RANK_COLUMNS
from collector.bus import Bus
from collector.auth import Gate, Signer
from collector.events import Envelope, Payload, PlanCurrent, ReconfigureCommand, ReplicaFrame


def concat_frames(epoch: int, iteration: int, parts: Iterable[ReplicaFrame],
                  layers: LayerLookup | None = None) -> IterationFrame:
    """One frame from replicas' columns, rows sorted by rank and row indices renumbered."""
    parts = list(parts)
    cols: dict[str, np.ndarray] = {}
    offsets = np.cumsum([0] + [p.ranks for p in parts[:-1]])
    for name in (*RANK_COLUMNS, *CHUNK_COLUMNS, *COMM_COLUMNS):
        dtype = np.int64 if name in INT_COLUMNS or name == "k_wait" else float
        arrs = []
        for off, p in zip(offsets.tolist(), parts):
            a = np.array(p.columns[name], dtype=float).astype(dtype)  # null -> NaN
            arrs.append(a + off if name in ("c_rank", "k_rank") else a)
        cols[name] = np.concatenate(arrs) if arrs else np.zeros(0, dtype)
    order = np.argsort(cols["rank"], kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    for name in RANK_COLUMNS:
        cols[name] = cols[name][order]
    c_order = np.argsort(inverse[cols["c_rank"]], kind="stable")
    for name in CHUNK_COLUMNS:
        cols[name] = cols[name][c_order]
    cols["c_rank"] = inverse[cols["c_rank"]]
    k_order = np.argsort(inverse[cols["k_rank"]], kind="stable")
    for name in COMM_COLUMNS:
        cols[name] = cols[name][k_order]
    cols["k_rank"] = inverse[cols["k_rank"]]
    n = len(cols["rank"])
    first, end = (np.full(n, -1, np.int64), np.full(n, -1, np.int64)) if layers is None else layers.ranges(cols["rank"])
    return IterationFrame(epoch=epoch, iteration=iteration, first_layer=first, end_layer=end,
                          **{k: (v > 0 if k == "k_wait" else v) for k, v in cols.items()})


@dataclass
class JobMerge:
    """The merge for one job: feed it the control events (plans) and the shards' ReplicaFrames."""

    job: str
    config: DetectorConfig = field(default_factory=DetectorConfig)
    duplicates: int = 0

    def __post_init__(self) -> None:
        self.detector = Detector(self.job, self.config)
        self._waiting: dict[tuple[int, int], dict[int, ReplicaFrame]] = {}
        self._judged: tuple[int, int] = (-1, -1)
        self._replicas: dict[int, set[int]] = {}  # epoch -> replicas of its plan
        self._lookup: dict[int, LayerLookup] = {}

    def on_event(self, event: Envelope) -> list[Payload]:
        p = event.payload
        if event.job != self.job:
            return []
        if isinstance(p, ReplicaFrame):
            key = (p.epoch, p.iteration)
            if key <= self._judged or p.replica in self._waiting.get(key, {}):
                self.duplicates += 1
                return []
            self._waiting.setdefault(key, {})[p.replica] = p
            return self._judge_ready(final=False)
        if isinstance(p, (PlanCurrent, ReconfigureCommand)):
            self._replicas[p.plan.epoch] = set(range(len(p.plan.pipelines)))
        return self.detector.on_event(event) + self._judge_ready(final=False)

    def _layers(self, epoch: int) -> LayerLookup | None:
        plan = self.detector.arrival.plans.get(epoch)
        if plan is None:
            return None
        if epoch not in self._lookup:
            self._lookup[epoch] = LayerLookup(plan)
        return self._lookup[epoch]

    def flush(self) -> list[Payload]:
        """Judge every iteration still waiting (end of a recording)."""
        return self._judge_ready(final=True)

    def _judge_ready(self, final: bool) -> list[Payload]:
        out: list[Payload] = []
        while self._waiting:
            key = min(self._waiting)
            have = self._waiting[key]
            want = self._replicas.get(key[0])
            if not final and (want is None or len(have) < len(want) or not want <= have.keys()):
                return out
            del self._waiting[key]
            self._judged = key
            frame = concat_frames(*key, (have[r] for r in sorted(have)), self._layers(key[0]))
            out += self.detector.process_frame(frame)
        return out


class MergeWorker:
    """The merge on the bus: reads the analytics topic (ReplicaFrames) and the control topic (plans)
    from their beginning as its own group, keeps one JobMerge per job, and publishes what they
    raise. It keeps no state of its own: restarted, it replays both topics and rebuilds it, and its
    publication is at-least-once (a restart republishes what the replay raises again; the
    single-process path's exactly-once outbox is analytics/detector_projection.py)."""

    def __init__(self, bus: Bus, group: str, config: DetectorConfig | None = None) -> None:
        from collector import topics
        from collector.stream import EventStream

        self.bus = bus
        self.config = config or DetectorConfig()
        self.merges: dict[str, JobMerge] = {}
        self.stream = EventStream(bus, group, [topics.ANALYTICS, topics.CONTROL])
        self.stream.seek_to_beginning()
        self.gate = Gate("analytics-merge")

    def step(self, max_records: int = 20_000, timeout_s: float = 0.5) -> int:
        from collector.events import EventFactory

        for d in self.stream.poll(max_records, timeout_s):
            e = d.event
            if not self.gate.admit(e, time_s=e.time_s):
                continue  # a forged plan.current or command must not reshape the judged job
            if not isinstance(e.payload, (ReplicaFrame, PlanCurrent, ReconfigureCommand)) and e.job not in self.merges:
                continue
            merge = self.merges.get(e.job)
            if merge is None:
                merge = self.merges[e.job] = JobMerge(e.job, self.config)
            out = merge.on_event(e)
            if out:
                f = Signer(EventFactory(e.job, "analytics-merge"), "analytics", self.gate.keyring)
                self.bus.publish([f.make(p, time_s=e.time_s) for p in out])
        if rejected := self.gate.take():
            self.bus.publish(rejected)
        return self.stream.last_polled

    def close(self) -> None:
        self.stream.close()
