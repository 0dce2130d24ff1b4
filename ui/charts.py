"""Figures the pages draw, built from plain arrays so they can be tested without a browser.

Long series are downsampled before they reach the browser: a few hundred points per chart keep a
page responsive with hours of history (Vega-Lite slows to a crawl past ~10k marks). Buckets keep
the mean of the predicted series and both the mean and the worst of the observed one, so a short
excess is still visible after downsampling.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import altair as alt
import numpy as np
import pandas as pd

from collector.goodput import Goodput
from collector.events import RankHealthEntry, RankState
from collector.plan import Plan
from ui.read_model import Mark, Slot

MAX_POINTS = 600
MARK_COLOURS = {"incident": "#c8362f", "reshape": "#3b7dd8", "detector": "#e8a33d", "planner": "#8a4fbf",
                "recovery": "#2e9a5b", "outage": "#7a7a7a"}
TABLEAU20 = ["#4e79a7", "#a0cbe8", "#f28e2b", "#ffbe7d", "#59a14f", "#8cd17d", "#b6992d", "#f1ce63", "#499894",
             "#86bcb6", "#e15759", "#ff9d9a", "#79706e", "#bab0ac", "#d37295", "#fabfd2", "#b07aa1", "#d4a6c8",
             "#9d7660", "#d7b5a6"]
HEALTH_COLOURS = {"healthy": "#4c9a52", "slow": "#e8a33d", "dead": "#c8362f", "not_traced": "#9db4c9",
                  "unused": "#c9c9c9"}


def downsample(columns: dict[str, np.ndarray], max_points: int = MAX_POINTS, *, x: str = "iteration",
               worst: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """At most ``max_points`` rows: bucket means (x keeps each bucket's first value).

    For each name in ``worst`` a ``<name>_max`` column holds the bucket's maximum."""
    n = len(columns[x])
    if n <= max_points:
        out = dict(columns)
        for name in worst:
            out[f"{name}_max"] = columns[name]
        return out
    edges = np.linspace(0, n, max_points + 1).astype(int)
    starts = edges[:-1]
    counts = np.diff(edges)
    out = {x: columns[x][starts]}
    for name, values in columns.items():
        if name == x:
            continue
        out[name] = np.add.reduceat(values.astype(np.float64), starts) / counts
    for name in worst:
        out[f"{name}_max"] = np.maximum.reduceat(columns[name].astype(np.float64), starts)
    return out


def series_chart(columns: dict[str, np.ndarray], marks: Sequence[Mark], *, kind: str, height: int = 220) -> alt.Chart:
    """Observed against predicted over iterations, with incidents (red) and reshapes (blue) as rules.

    ``kind``: 'time' draws iteration time in seconds; 'throughput' draws tokens per second."""
    it = columns["iteration"]
    if kind == "time":
        obs, pred, title = columns["observed_s"], columns["predicted_s"], "iteration time (s)"
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            obs = np.where(columns["observed_s"] > 0, columns["tokens"] / columns["observed_s"], np.nan)
            pred = np.where(columns["predicted_s"] > 0, columns["tokens"] / columns["predicted_s"], np.nan)
        title = "throughput (tokens/s)"
    data = pd.DataFrame({
        "iteration": np.concatenate([it, it]),
        "value": np.concatenate([obs, pred]),
        "series": ["observed"] * len(it) + ["predicted"] * len(it),
    })
    lines = alt.Chart(data).mark_line(strokeWidth=1.5).encode(
        x=alt.X("iteration:Q", title="iteration"),
        y=alt.Y("value:Q", title=title, scale=alt.Scale(zero=False)),
        color=alt.Color("series:N", scale=alt.Scale(domain=["observed", "predicted"], range=["#1f5fa8", "#9a9a9a"]),
                        legend=alt.Legend(orient="top", title=None)),
        strokeDash=alt.StrokeDash("series:N", scale=alt.Scale(domain=["observed", "predicted"], range=[[1, 0], [5, 3]]),
                                  legend=None),
    )
    shown = [m for m in marks if m.iteration is not None and (len(it) == 0 or it[0] <= m.iteration <= it[-1])]
    if not shown:
        return lines.properties(height=height)
    kinds = {m.kind for m in shown}
    rules = alt.Chart(pd.DataFrame({
        "iteration": [m.iteration for m in shown], "mark": [m.kind for m in shown], "label": [m.label for m in shown],
    })).mark_rule(strokeWidth=2, opacity=0.7).encode(
        x="iteration:Q",
        color=alt.Color("mark:N", scale=alt.Scale(domain=[k for k in MARK_COLOURS if k in kinds],
                                                  range=[v for k, v in MARK_COLOURS.items() if k in kinds]),
                        legend=alt.Legend(orient="top", title=None)),
        tooltip=["mark:N", "iteration:Q", "label:N"],
    )
    return alt.layer(lines, rules).resolve_scale(color="independent").properties(height=height)


@dataclass(frozen=True)
class Cell:
    device: int
    node: int
    gpu: int
    replica: int | None
    stage: int | None
    tp_rank: int | None
    health: str
    factor: float


def plan_cells(plan: Plan | None, layout: dict[int, Slot], health: dict[int, RankHealthEntry],
               *, gpus_per_node: int = 8, devices: Sequence[int] | None = None) -> list[Cell]:
    """One cell per device: its role under ``plan`` (or, without a plan, under its telemetry's
    coordinates) and its health. ``devices`` adds devices the plan leaves unused (shown grey)."""
    roles: dict[int, tuple[int, int, int]] = {}
    if plan is not None:
        roles = {d: (r.replica, r.stage, r.tp_rank) for d, r in plan.roles.items()}
    else:
        roles = {d: (s.replica, s.stage, s.tp_rank) for d, s in layout.items()}
    all_devices = sorted(set(roles) | set(devices or ()) | set(layout))
    cells = []
    for d in all_devices:
        slot = layout.get(d)
        node = slot.node if slot is not None and slot.node is not None else d // gpus_per_node
        entry = health.get(d)
        role = roles.get(d)
        if role is None:
            state, factor = "unused", 1.0
        elif entry is None or entry.state == RankState.HEALTHY:
            state, factor = "healthy", 1.0
        else:
            state, factor = entry.state.value, entry.factor
        replica, stage, tp_rank = role if role is not None else (None, None, None)
        cells.append(Cell(d, node, d % gpus_per_node, replica, stage, tp_rank, state, factor))
    return cells


def _natural(label: str) -> list:
    """'r2·s10' before 'r10·s2': compare the numbers in a label as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]


def plan_grid_chart(cells: Sequence[Cell], colour_by: str, *, title: str = "") -> alt.LayerChart | alt.FacetChart:
    """Nodes (rows) × GPUs (columns), coloured by role or health; slow and dead cells are labelled."""
    def label(c: Cell) -> str:
        return "✕" if c.health == "dead" else (f"×{c.factor:.1f}" if c.health == "slow" else "")

    frame = pd.DataFrame({
        "node": [c.node for c in cells], "gpu": [c.gpu for c in cells], "device": [c.device for c in cells],
        "replica": [("unused" if c.replica is None else f"DP {c.replica}") for c in cells],
        "stage": [("unused" if c.stage is None else f"PP {c.stage}") for c in cells],
        "tp group": [("unused" if c.stage is None else f"r{c.replica}·s{c.stage}") for c in cells],
        "health": [c.health for c in cells], "label": [label(c) for c in cells],
        "tp rank": [(-1 if c.tp_rank is None else c.tp_rank) for c in cells],
    })
    nodes = frame["node"].nunique() if len(frame) else 1
    step = 22 if nodes <= 16 else (12 if nodes <= 64 else 6)
    field = {"TP group": "tp group", "PP stage": "stage", "DP replica": "replica", "health": "health"}[colour_by]
    if field == "health":
        colour = alt.Color("health:N", scale=alt.Scale(domain=list(HEALTH_COLOURS), range=list(HEALTH_COLOURS.values())))
    else:
        values = sorted((v for v in frame[field].unique() if v != "unused"), key=_natural)
        domain = values + (["unused"] if (frame[field] == "unused").any() else [])
        palette = [TABLEAU20[i % len(TABLEAU20)] for i in range(len(values))] + [HEALTH_COLOURS["unused"]]
        colour = alt.Color(f"{field}:N", scale=alt.Scale(domain=domain, range=palette[: len(domain)]),
                           legend=alt.Legend(columns=2 if frame[field].nunique() > 12 else 1, symbolLimit=40))
    base = alt.Chart(frame).encode(
        x=alt.X("gpu:O", title="GPU", scale=alt.Scale(paddingInner=0.08)),
        y=alt.Y("node:O", title="node", scale=alt.Scale(paddingInner=0.08)),
    )
    rects = base.mark_rect().encode(
        color=colour,
        stroke=alt.condition(alt.datum.health != "healthy", alt.value("#222"), alt.value(None)),
        tooltip=["device:Q", "node:Q", "gpu:Q", "replica:N", "stage:N", "tp rank:Q", "health:N", "label:N"],
    )
    texts = base.mark_text(fontSize=9 if step > 12 else 6, fontWeight="bold", color="#111").encode(text="label:N")
    return alt.layer(rects, texts).properties(
        title=title, width=alt.Step(max(step, 28) if nodes <= 16 else step * 2), height=alt.Step(step))


def slowdown_figure(iterations: np.ndarray, ranks: np.ndarray, matrix: np.ndarray, *,
                    suspects: dict[int, float] | None = None):
    """Per-rank slowdown heatmap (ranks × iterations): the detector's factor for each rank as
    ``analytics.rank_health`` published it, the suspects an incident locates labelled with their
    location's factor. matplotlib, since a 1,024-rank image is one raster rather than 100k vector marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=100)
    if matrix.size == 0:
        ax.text(0.5, 0.5, "no rank health from the detector in this window", ha="center", va="center")
        ax.set_axis_off()
        return fig
    vmax = max(2.0, float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 2.0)
    extent = (float(iterations[0]), float(iterations[-1]) + 1, matrix.shape[0] - 0.5, -0.5)
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=1.0, vmax=vmax, extent=extent)
    for rank, factor in (suspects or {}).items():
        row = int(np.searchsorted(ranks, rank))
        if row < len(ranks) and ranks[row] == rank:
            ax.annotate(f"rank {rank} ×{factor:.2f}", xy=(extent[0], row), xytext=(-4, 0), textcoords="offset points",
                        ha="right", va="center", fontsize=7, color="#c8362f")
    ax.set_xlabel("iteration")
    ax.set_ylabel("rank" if len(ranks) and ranks[-1] == len(ranks) - 1 else "rank (rows in rank order)")
    fig.colorbar(image, ax=ax, label="detector's slowdown factor")
    fig.tight_layout()
    return fig


def seq_len_chart(q: dict[str, np.ndarray], *, height: int = 180) -> alt.LayerChart | alt.FacetChart:
    """Spread of the packed sequence lengths per iteration: p5–p95 band, median and max."""
    frame = pd.DataFrame({k: v for k, v in q.items()})
    base = alt.Chart(frame).encode(x=alt.X("iteration:Q"))
    band = base.mark_area(opacity=0.3, color="#7a9cc6").encode(y=alt.Y("p5:Q", title="sequence length (tokens)"), y2="p95:Q")
    median = base.mark_line(color="#1f5fa8").encode(y="p50:Q")
    top = base.mark_line(color="#999", strokeDash=[3, 3]).encode(y="max:Q")
    return alt.layer(band, median, top).properties(height=height)


GOODPUT_COLOURS = {"productive": "#4c9a52", "fail_stop": "#c8362f", "fail_slow": "#e8a33d", "reshape": "#3b7dd8",
                   "restart": "#8a4fbf", "approval": "#d37295", "other": "#79706e", "not yet attributed": "#c9c9c9"}


def goodput_parts(g: Goodput) -> pd.DataFrame:
    """The job's wall time as parts that add up to it: productive, each cause of loss, pending."""
    parts = {"productive": g.productive_s, **g.loss_s, "not yet attributed": g.pending_s}
    wall = g.wall_s or 1.0
    return pd.DataFrame({"part": list(parts), "seconds": list(parts.values()),
                         "share": [s / wall for s in parts.values()], "order": range(len(parts))})


def goodput_bar(g: Goodput, *, height: int = 60) -> alt.Chart:
    """One stacked bar: where the job's wall time went (the breakdown behind its goodput)."""
    data = goodput_parts(g)
    return alt.Chart(data[data["seconds"] > 0]).mark_bar().encode(
        x=alt.X("share:Q", stack="zero", axis=alt.Axis(format="%", title="share of wall time")),
        color=alt.Color("part:N", scale=alt.Scale(domain=list(GOODPUT_COLOURS), range=list(GOODPUT_COLOURS.values())),
                        legend=alt.Legend(orient="bottom", title=None)),
        order=alt.Order("order:Q"),
        tooltip=["part:N", alt.Tooltip("seconds:Q", format=",.0f"), alt.Tooltip("share:Q", format=".1%")],
    ).properties(height=height)
