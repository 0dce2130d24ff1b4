"""A hung job whose watched ranks all live on: a rank nobody traces stopped.

Megatron-style tracing records one rank per TP group, sampled tracing leaves whole replicas out,
and such untraced ranks send neither reports nor heartbeats: nothing of theirs can stop. When one
dies the job still hangs: its TP peer blocks in the group's collective, the rest of its pipeline in
p2p waits on it, the other replicas in the DP all-reduce; every traced rank keeps heartbeating and
no iteration completes. The stall is the evidence. Once the job has completed nothing for as long
as the hung-job rule gives a silent heartbeating rank (``hang_miss_intervals`` intervals into the
stall, analytics/detection/fail_stop.py) and no watched rank was judged dead, the rank that stopped is one
of those nobody watches, and a fail-stop opens on them (as a group: which one is not in the
telemetry).

Naming it: with probes enabled, the same incident asks the suspects for a one-repeat probe.
A dead rank never answers; once the answers had a heartbeat interval of the job's event time to
come in, the ranks that stayed silent are named and the others cleared. Without probes, or when
none answered (no agent runs them) or all did, the group stays the suspect: the planner then
plans around every member.

What can go wrong: a job that stalls for another reason (a checkpoint longer than the miss, a
filesystem hang) reads as a hidden death; the incident resolves as soon as an iteration of the
same epoch completes, since a dead rank would have prevented it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from analytics.detection.fail_stop import FailStopWatch
from collector.events import Payload

if TYPE_CHECKING:
    from analytics.detection.judges.base import JobContext


@dataclass
class HiddenStopWatch:
    """The suspicion raised for the current stall, and the liveness probe that narrows it."""

    suspects: tuple[int, ...] = ()  # the silent untraced ranks named for the current stall (empty: none raised)
    epoch: int = -1  # the epoch whose stall raised it
    top: int = -1  # that epoch's newest completed iteration when it was raised
    probe_id: str | None = None
    asked_s: float | None = None  # event time the probe was asked (None: no probe pending)
    answered: frozenset[int] = frozenset()
    next_check_s: float = float("-inf")  # judged at most twice per heartbeat interval of event time

    def suspect(self, watch: FailStopWatch, time_s: float) -> tuple[int, ...]:
        """The ranks to suspect now (empty: none, or already raised for this stall): the job is
        hung ``hang_miss_intervals`` intervals into its stall, no rank of the plan is dead, and
        some ranks of the plan send nothing that could say they stopped. Called per heartbeat,
        it judges at most twice per interval: the reference walks every watched rank."""
        if self.suspects or not watch.tracing or time_s < self.next_check_s:
            return ()
        interval = watch.interval_s()
        self.next_check_s = time_s + 0.5 * interval
        if watch.stalled_now() < watch.config.hang_miss_intervals * interval:
            return ()
        silent = watch.silent_untraced()
        if not silent or watch.dead & watch.planned():
            return ()
        epoch = watch.newest_epoch()
        self.suspects, self.epoch, self.top = tuple(sorted(silent)), epoch, watch.top_iteration(epoch)
        return self.suspects

    def judge_stall(self, time_s: float, job: JobContext) -> list[Payload]:
        """The hidden-stop judgement at event time ``time_s``: name the silent suspects once a
        liveness probe's answers are in, or raise the suspicion (and ask the probe). Judged on
        heartbeats, the only events a hung job sends, so it reads a time, not an iteration."""
        stops, book = job.fail_stop, job.book
        silent = self.silent(time_s, stops.interval_s())
        if silent:
            stops.dead.update(silent)
            return book.hidden_named(silent, f"ranks {list(silent)} did not answer a liveness probe that the "
                                             f"other {len(self.suspects) - len(silent)} suspects answered")
        ranks = self.suspect(stops, time_s)
        if not ranks:
            return []
        iteration = self.top + 1
        probe_id = f"liveness-{self.epoch}-{iteration}" if job.config.probes else None
        if probe_id is not None:
            self.ask(probe_id, time_s)
        reason = (f"the job completed nothing for {stops.stalled_now():.0f} s while every traced rank "
                  f"heartbeats: one of the {len(ranks)} ranks that are not traced (and send no heartbeats) stopped"
                  + ("; a liveness probe will tell which" if probe_id is not None else ""))
        return book.hidden_fail_stop(ranks, iteration, reason, probe_id)

    def ask(self, probe_id: str, time_s: float) -> None:
        self.probe_id, self.asked_s, self.answered = probe_id, time_s, frozenset()

    def answer(self, probe_id: str, rank: int) -> bool:
        """Count one probe answer; False when it is not this watch's probe."""
        if probe_id != self.probe_id or self.asked_s is None:
            return False
        self.answered |= {rank}
        return True

    def silent(self, time_s: float, interval_s: float) -> tuple[int, ...] | None:
        """Once the probe's answers had ``interval_s`` of event time: the suspects that did not
        answer, when some did and some did not (None: not yet, no probe, or nothing learned)."""
        if self.asked_s is None or time_s < self.asked_s + interval_s:
            return None
        self.asked_s = None
        quiet = tuple(r for r in self.suspects if r not in self.answered)
        return quiet if quiet and len(quiet) < len(self.suspects) else None

    def progressed(self, watch: FailStopWatch) -> bool:
        """An iteration of the suspicion's epoch completed after it was raised (or a newer epoch
        reported): the job was not held by a dead rank. Clears the suspicion."""
        if not self.suspects:
            return False
        moved = watch.newest_epoch() > self.epoch or watch.top_iteration(self.epoch) > self.top
        if moved:
            self.reset()
        return moved

    def reset(self) -> None:
        self.suspects, self.epoch, self.top, self.probe_id, self.asked_s = (), -1, -1, None, None
        self.answered, self.next_check_s = frozenset(), float("-inf")
