"""`resihp bench bus` measures the raw client on the same bytes beside the bus, so its ratio is ours over it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import bus as bench_bus

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py: the consumers run in processes of their own


def test_the_embedded_bus_and_its_raw_client_read_every_record_and_give_a_ratio(tmp_path: Path) -> None:
    args = argparse.Namespace(ranks=4, microbatches=2, iterations=3, latency_seconds=0.2, path=str(tmp_path / "bus.sqlite"))
    row = bench_bus.measure("embedded", args)
    assert row["records_per_s"] > 0 and row["raw_records_per_s"] > 0
    assert row["ratio_to_raw"] == round(row["records_per_s"] / row["raw_records_per_s"], 3)
    assert row["chunks_per_message"] == 4 and (tmp_path / "raw.sqlite").exists()
