"""`resihp bench bus` measures the raw client on the same bytes beside the bus, so its ratio is ours over it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import bus as bench_bus

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py: the consumers run in processes of their own


def test_the_embedded_bus_and_its_raw_client_read_every_record_and_give_a_ratio(tmp_path: Path) -> None:
    args = argparse.Namespace(ranks=4, microbatches=2, iterations=3, latency_seconds=0.2, repeats=2, path=str(tmp_path))
    row = bench_bus.measure("embedded", args)
    assert row["records_per_s"] > 0 and row["raw_records_per_s"] > 0 and row["repeats"] == 2
    lo, hi = row["records_per_s_range"]
    assert lo <= row["records_per_s"] <= hi
    assert row["chunks_per_message"] == 4 and len(row["rounds"]) == 2
    ratios = [ours / raw for ours, raw in row["rounds"]]
    assert min(ratios) - 1e-3 <= row["ratio_to_raw"] <= max(ratios) + 1e-3
    # every phase wrote a log of its own: the warm-ups, two rounds of each side, the latency phase
    assert {p.name for p in tmp_path.glob("*.sqlite")} == {
        "warm.sqlite", "warm-raw.sqlite", "bus0.sqlite", "raw0.sqlite", "bus1.sqlite", "raw1.sqlite", "latency.sqlite"}
