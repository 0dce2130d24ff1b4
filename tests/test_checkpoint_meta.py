"""A checkpoint's metadata is read without running code: ``meta.pt`` is unpickled with
``weights_only=True``, so a file that names a callable to run on load is refused, not executed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer.native.parallelize import build_optimizer
from trainer.native.state import read_meta


class _RunsCode:
    """What a tampered checkpoint could hold: unpickling it calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # the pickle protocol
        return (os.system, (f"touch {self.marker}",))


def test_the_metadata_the_trainer_writes_reads_back(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt, sched = build_optimizer(model, 1e-3, 0.0, 10)
    for _ in range(3):
        opt.step()
        sched.step()
    torch.save({"iteration": 3, "scheduler": sched.state_dict()}, tmp_path / "meta.pt")
    meta = read_meta(tmp_path)
    _, fresh = build_optimizer(torch.nn.Linear(4, 4), 1e-3, 0.0, 10)
    fresh.load_state_dict(meta["scheduler"])
    assert meta["iteration"] == 3 and fresh.last_epoch == sched.last_epoch


def test_metadata_carrying_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"iteration": 3, "scheduler": _RunsCode(marker)}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"meta\.pt holds more than tensors and plain values.*refusing to unpickle"):
        read_meta(tmp_path)
    assert not marker.exists()
