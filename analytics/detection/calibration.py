"""How sure the detector is that an incident's fault is real: ``p_real``, read from a table fitted
on the detection suite, never fitted while a job runs.

Every opening rests on one kind of evidence (its *basis*: a rank's CUSUM, a link's, the
iteration's excess, a sweep probe, missing heartbeats …) that passed its alarm bar by some
*margin* in the basis's own units (σ past the CUSUM allowance, the probe's factor over its bar).
``p_real`` is the share of the suite's incidents of that basis and margin band that were real
(the referee's match, resihp/referee.py), shrunk toward the share over every basis by one
pseudo-incident, so a band the suite saw twice does not claim 1.0, and made non-decreasing in
the margin (pool-adjacent-violators) so a stronger signal never reads less sure. A basis the
table does not hold reads the pooled share; with no table at all every incident reads 0.5, which
says "uncalibrated".

Why a table and not the judges' own statistics: a z-score transform, a 0.9 for a probe's find or
1/n for n suspects are numbers on different scales that no reader can compare, and an operator's
"auto-apply above 0.9" must mean the same for every judge. ``fit`` turns the suite's labelled
openings into the table; ``resihp bench detect --dialect all --fit-calibration`` runs it on one
half of the suite (the cases at even places, in every dialect) and writes ``calibration_table.json``
beside this module; the other half checks it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("calibration_table.json")
FIT_COMMAND = "resihp bench detect --dialect all --fit-calibration"

# The evidence an opening can rest on (Evidence.basis on the wire).
COMPUTE_CUSUM = "compute_cusum"  # a rank's (or lock-step TP group's) own time against prediction
LINK_CUSUM = "link_cusum"  # a p2p link's own timers against the same stage pair elsewhere
COMM_EXCESS = "comm_excess"  # the iteration slower than its compute explains
UNTRACED_EXCESS = "untraced_excess"  # time lost outside the traced ranks
PROBE = "probe"  # a probe measured the rank slow (a sweep of the ranks nobody traces, a TP group's re-probe)
HEARTBEAT = "heartbeat"  # a rank stopped: heartbeats and telemetry missing
HIDDEN_STOP = "hidden_stop"  # the job stalled while every traced rank lives
BASES = (COMPUTE_CUSUM, LINK_CUSUM, COMM_EXCESS, UNTRACED_EXCESS, PROBE, HEARTBEAT, HIDDEN_STOP)

MARGIN_EDGES = (1.0, 3.0)  # margin bands: under 1, 1 to 3, 3 and over (the basis's units)
PRIOR_WEIGHT = 1.0  # pseudo-incidents at the pooled share added to every band
UNCALIBRATED = 0.5


def band(margin: float) -> int:
    """The margin band of a margin (NaN reads as the lowest: no evidence of strength)."""
    if not math.isfinite(margin):
        return len(MARGIN_EDGES) if margin > 0 else 0
    return sum(margin >= e for e in MARGIN_EDGES)


def _monotone(values: list[float], weights: list[float]) -> list[float]:
    """Pool-adjacent-violators: the weighted non-decreasing sequence nearest ``values``."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


def fit(rows: Iterable[tuple[str, float, bool]], fitted_on: str = "") -> dict:
    """The table for labelled openings ``rows`` (basis, margin, real). Raises on an unknown basis
    (an opening the detector can make but this module does not name is a bug to fix here)."""
    cells: dict[str, list[list[int]]] = {}
    real_all = n_all = 0
    for basis, margin, real in rows:
        if basis not in BASES:
            raise ValueError(f"unknown evidence basis {basis!r}; the detector's bases are {', '.join(BASES)}")
        cell = cells.setdefault(basis, [[0, 0] for _ in range(len(MARGIN_EDGES) + 1)])[band(margin)]
        cell[0] += int(real)
        cell[1] += 1
        real_all += int(real)
        n_all += 1
    pooled = (real_all + 1) / (n_all + 2)  # one real and one false pseudo-incident: 0.5 with no data
    p_real = {}
    for basis, bands in cells.items():
        seen = [i for i, (_, n) in enumerate(bands) if n]
        shrunk = _monotone([(bands[i][0] + PRIOR_WEIGHT * pooled) / (bands[i][1] + PRIOR_WEIGHT) for i in seen],
                           [bands[i][1] + PRIOR_WEIGHT for i in seen])
        # a band the suite never saw takes the nearest seen band below it (none below: the pooled
        # share, no more than the first seen band's), so the row stays non-decreasing
        row, last = [], min(pooled, shrunk[0])
        for i in range(len(bands)):
            if i in seen:
                last = shrunk[seen.index(i)]
            row.append(round(last, 4))
        p_real[basis] = row
    return {"command": FIT_COMMAND, "fitted_on": fitted_on, "margin_edges": list(MARGIN_EDGES),
            "prior_weight": PRIOR_WEIGHT, "pooled": {"real": real_all, "incidents": n_all, "p_real": round(pooled, 4)},
            "cells": {b: [{"real": r, "incidents": n} for r, n in bands] for b, bands in sorted(cells.items())},
            "p_real": dict(sorted(p_real.items()))}


def read_table(path: Path = TABLE_PATH) -> dict | None:
    """The committed table, checked; None when there is none (every incident reads uncalibrated)."""
    if not path.exists():
        return None
    table = json.loads(path.read_text())
    edges = table.get("margin_edges")
    if edges != list(MARGIN_EDGES):
        raise ValueError(f"{path} was fitted for margin bands {edges}, this build reads {list(MARGIN_EDGES)}; "
                         f"regenerate it with `{FIT_COMMAND}`")
    for basis, ps in table.get("p_real", {}).items():
        if basis not in BASES or len(ps) != len(MARGIN_EDGES) + 1 or not all(0 <= p <= 1 for p in ps):
            raise ValueError(f"{path}: bad row for basis {basis!r} ({ps}); regenerate it with `{FIT_COMMAND}`")
    return table


@lru_cache(maxsize=1)
def _committed() -> dict | None:
    return read_table()


def p_real(basis: str, margin: float, table: dict | None = None) -> float:
    """How sure an opening on ``basis`` that passed its bar by ``margin`` is that its fault is real,
    per ``table`` (default: the committed one)."""
    table = _committed() if table is None else table
    if table is None:
        return UNCALIBRATED
    row = table["p_real"].get(basis)
    return float(row[band(margin)]) if row is not None else float(table["pooled"]["p_real"])


def write_table(table: dict, path: Path = TABLE_PATH) -> None:
    path.write_text(json.dumps(table, indent=1) + "\n")
    _committed.cache_clear()
