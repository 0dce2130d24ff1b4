"""Fail-stop in a torchtitan job: which devices are gone, told from the ranks that keep dying on them.

When a rank dies, torch's agent restarts the whole group at the same layout from the last periodic
checkpoint (``--max-restarts``). That is right for a crash that will not recur, and wrong for a
device that is gone: its rank dies again in the restarted world, and every restart is spent on it.
A process cannot tell the two apart by itself, so the agent judges by repetition, the rule
operators apply to a crash-looping host: a device whose rank ended the group in two rounds in a
row, with no failure elsewhere between, is lost. The agent (trainer/torchtitan/controller.py) then
restarts the job from the same checkpoint at the largest uniform layout on the devices left
(layout.py's :func:`fallback_layout`), as a new plan epoch that it announces like any reshape.

Which rank "ended the group" is the agent's :meth:`RankWatch.culprits`: the ranks that failed by
themselves, not the peers the agent then stopped. Pure bookkeeping; no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

STRIKES = 2  # rounds in a row a device's rank must end the group in before the device is judged lost


class LostDevices:
    """The devices a job has lost, judged by their ranks' failures round after round."""

    def __init__(self, strikes: int = STRIKES) -> None:
        if strikes < 1:
            raise ValueError("a device is judged lost after at least one failure")
        self.strikes = strikes
        self.lost: set[int] = set()
        self._in_a_row: dict[int, int] = {}

    def failed(self, devices: Iterable[int]) -> set[int]:
        """One round ended by the ranks on ``devices``; returns the devices judged lost by it. A
        device that did not fail in this round starts counting again."""
        named = set(devices)
        self._in_a_row = {d: self._in_a_row.get(d, 0) + 1 for d in named}
        newly = {d for d, n in self._in_a_row.items() if n >= self.strikes} - self.lost
        self.lost |= newly
        return newly

    def forgive(self) -> None:
        """The failures counted so far were another node's doing (it left the job: its peers' ranks
        fail when it goes), so no device here has a failure in a row to its name."""
        self._in_a_row.clear()

    def healthy(self, devices: Iterable[int]) -> list[int]:
        """``devices`` less the lost ones, in their order."""
        return [d for d in devices if d not in self.lost]
