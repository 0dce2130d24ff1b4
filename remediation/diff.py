"""A diff of two plans a person can read in a console or an approval prompt:

    replica 2, stage 3: TP 8→4 on GPUs 16–19, layers 24–31 → 24–27
    replica 2, stage 3+ (new): TP 2 on GPUs 20–21, layers 28–29
    replica 2: 16 → 14 micro-batches
    replicas 0–1, 3–7: 16 → 17 micro-batches

Replica numbers are the *current* plan's (new plans renumber replicas 0..n-1 when one is
dropped, which would otherwise make every later line look changed). Layer ranges are inclusive,
as people write them. Micro-batch changes of untouched replicas are grouped so a 100,000-GPU
diff stays a few lines.
"""

from __future__ import annotations

from collections.abc import Sequence

from collector.plan import PipelinePlan, Plan, StagePlan
from remediation.cluster import ClusterState

MAX_LINES = 40


def ranges(ids: Sequence[int]) -> str:
    """[16, 17, 18, 19, 22] → '16–19, 22'."""
    xs = sorted(ids)
    if not xs:
        return "none"
    parts = []
    start = prev = xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}–{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


def _layers(st: StagePlan) -> str:
    return f"{st.first_layer}–{st.end_layer - 1}"


def _why(cluster: ClusterState | None, devices: Sequence[int]) -> str:
    if cluster is None:
        return ""
    notes = []
    for d in devices:
        s = cluster.state(d)
        if s.dead:
            notes.append(f"{d} dead")
        elif s.compute_factor > 1.0 or s.link_factor > 1.0:
            f = max(s.compute_factor, s.link_factor)
            notes.append(f"{d} slow ×{f:.1f}")
    return f" ({', '.join(notes)})" if notes else ""


def _pipeline_lines(old: PipelinePlan, new: PipelinePlan, cluster: ClusterState | None) -> list[str]:
    r = old.replica
    lines: list[str] = []
    used = {d for st in new.stages for d in st.devices}
    # Match new stages to old stages by the devices they share (a re-formed group keeps a subset).
    by_device = {d: s for s, st in enumerate(old.stages) for d in st.devices}
    seen_old: set[int] = set()
    for st in new.stages:
        src = by_device.get(st.devices[0])
        if src is None:
            lines.append(f"replica {r}, new stage: TP {st.tp} on GPUs {ranges(st.devices)}, layers {_layers(st)}")
            continue
        o = old.stages[src]
        if src in seen_old:  # a further group re-formed from the same old stage
            lines.append(f"replica {r}, stage {src}+ (new): TP {st.tp} on GPUs {ranges(st.devices)}, layers {_layers(st)}")
            continue
        seen_old.add(src)
        tag = f"replica {r}, stage {src}"
        parts = []
        if st.devices != o.devices:
            parts.append(f"TP {o.tp}→{st.tp} on GPUs {ranges(st.devices)}")
        if (st.first_layer, st.end_layer) != (o.first_layer, o.end_layer):
            parts.append(f"layers {_layers(o)} → {_layers(st)}")
        if parts:
            lines.append(f"{tag}: " + ", ".join(parts))
    for s, o in enumerate(old.stages):
        if s not in seen_old:
            lines.append(f"replica {r}, stage {s}: removed (GPUs {ranges(o.devices)}, layers {_layers(o)} go to the other stages)")
    idle = [d for st in old.stages for d in st.devices if d not in used]
    if idle:
        lines.append(f"replica {r}: GPUs {ranges(idle)} left out{_why(cluster, idle)}")
    if new.microbatches != old.microbatches:
        lines.append(f"replica {r}: {old.microbatches} → {new.microbatches} micro-batches")
    return lines


def plan_diff(old: Plan, new: Plan, sources: Sequence[int] | None = None, cluster: ClusterState | None = None) -> list[str]:
    """Lines describing how ``new`` differs from ``old``. ``sources[i]`` is the old replica new
    pipeline i came from (default: the same index)."""
    sources = list(sources) if sources is not None else list(range(new.dp))
    if len(sources) != new.dp:
        raise ValueError(f"sources names {len(sources)} replicas but the new plan has {new.dp}")
    old_by_replica = {p.replica: p for p in old.pipelines}
    lines: list[str] = []
    mb_only: dict[tuple[int, int], list[int]] = {}
    for pipe, src in zip(new.pipelines, sources):
        o = old_by_replica[src]
        same_structure = [(s.devices, s.first_layer, s.end_layer) for s in o.stages] == [
            (s.devices, s.first_layer, s.end_layer) for s in pipe.stages]
        if same_structure:
            if o.microbatches != pipe.microbatches:
                mb_only.setdefault((o.microbatches, pipe.microbatches), []).append(src)
            continue
        lines.extend(_pipeline_lines(o, pipe, cluster))
    structural, lines = lines, []
    for (a, b), reps in sorted(mb_only.items()):
        label = f"replica {reps[0]}" if len(reps) == 1 else f"replicas {ranges(reps)}"
        lines.append(f"{label}: {a} → {b} micro-batches")
    kept = set(sources)
    for p in old.pipelines:
        if p.replica not in kept:
            devs = [d for st in p.stages for d in st.devices]
            lines.append(f"replica {p.replica}: dropped, GPUs {ranges(devs)} idle{_why(cluster, devs)}; "
                         f"its {p.microbatches} micro-batches go to the others")
    if sources != list(range(len(sources))):
        lines.append("replicas renumbered " + ", ".join(f"{s}→{i}" for i, s in enumerate(sources) if s != i)
                     if len(sources) < 20 else "replicas after a dropped one are renumbered")
    room = max(1, MAX_LINES - len(lines))
    if len(structural) > room:
        structural = structural[:room - 1] + [f"… and {len(structural) - room + 1} more stage changes"]
    return structural + lines
