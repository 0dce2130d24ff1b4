"""A torchtitan rank's compute probe times its device, injected slowdown included
(trainer/torchtitan/probes.py). The probe run end to end — posted by the agent, run by every rank at
one step boundary, answered by the asked one — is in tests/test_torchtitan_failstop.py."""

from __future__ import annotations

import torch

from trainer.fault_spec import FaultSpec
from trainer.faults import FaultInjector
from trainer.torchtitan.probes import compute_seconds


def test_a_slowed_device_probes_slower_by_its_factor() -> None:
    cpu = torch.device("cpu")
    slowed = FaultInjector([FaultSpec(kind="slow_compute", device=0, factor=4.0, at_iteration=0)], device=0)
    slowed.begin_iteration(0)
    healthy = FaultInjector([FaultSpec(kind="slow_compute", device=1, factor=4.0, at_iteration=0)], device=0)
    healthy.begin_iteration(0)
    base = compute_seconds(5, healthy, cpu)
    slow = compute_seconds(5, slowed, cpu)
    assert base > 0 and compute_seconds(5, None, cpu) > 0
    assert slow / base > 2.0  # ×4 padding of each repeat's own compute; noise only lengthens the baseline's best
