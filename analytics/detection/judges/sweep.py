"""The sweep of untraced ranks: their compute, probed now and then, and at once when an
iteration is later than the job runs healthy (analytics/detection/untraced.py ``UntracedSweep``)."""

from __future__ import annotations

import math

from analytics.detection.calibration import PROBE
from analytics.detection.judges.base import FrameView, JobContext
from analytics.detection.incident_keys import COMM_KEY, UNTRACED_KEY
from analytics.detection.incident_keys import IncidentKey
from analytics.detection.open_incident import Suspect
from analytics.detection.untraced import HiddenExcess, UntracedSweep
from collector.events import Payload, ProbeResult


class SweepJudge:
    """The sweep in progress; ``excess`` is the communication judge's record of the hidden
    replicas' lateness (``CommExcess.hidden``), which brings a sweep forward."""

    def __init__(self, excess: HiddenExcess) -> None:
        self.sweep = UntracedSweep()
        self.excess = excess

    def new_epoch(self, job: JobContext) -> None:
        self.sweep.drop()

    def judge(self, view: FrameView, job: JobContext) -> list[Payload]:
        """A traced iteration of a job with ranks nobody traces (``view.hidden``): probe their
        compute if a sweep is due, or judge one whose last answers can no longer come (their ranks died)."""
        config, frame = job.config, view.frame
        if not config.probes:
            return []
        if self.sweep.probe_id is not None:
            return self.result(job)
        # A late iteration brings the sweep forward: a GPU nobody traces that makes the job later than
        # it runs healthy is named (and sized by its probe) at once, not after the runs that would
        # prove it from the lateness alone. Not while an open incident explains the lateness (a slow
        # rank) or probes for it anyway (the lateness's own).
        rate = config.untraced_suspicion_rate
        book = job.book
        accounted = book.open_compute_ranks() or UNTRACED_KEY in book.open or COMM_KEY in book.open
        least = math.log(config.min_alarm_factor)
        suspicious = rate > 0 and not accounted and self.excess.chance(frame.iteration, least) <= rate
        request = self.sweep.step(job.job, frame.epoch, frame.iteration, view.hidden[:4096],
                                  config.untraced_sweep_steps, suspicious)
        return [request] if request is not None else []

    def answer(self, p: ProbeResult, job: JobContext) -> list[Payload] | None:
        """A probe answer that belongs to the sweep (None: not the sweep's)."""
        return self.result(job) if self.sweep.claims(p) else None

    def result(self, job: JobContext) -> list[Payload]:
        """A sweep's answers, once complete: the slowest rank, if it stands out as a probe's naming
        must (``IncidentProbes.bar``) and passes the smallest alarm, opens a compute incident on
        itself, sized by the probe.

        Why the probe's size: the job's lateness, the only other measure of an untraced rank, is
        within the untraced replicas' swing for the slowdowns only a sweep finds, and sized through
        the schedule it is a few per cent off even far beyond that swing. The probe times compute
        alone, which is what the incident says it measured (``Location.measure``): the planner
        takes it as the GPU's compute slowdown as it stands. Telemetry never sees the rank, so the
        incident is health-probed until the rank measures healthy (``IncidentBook.open_unseen``)."""
        sweep, book = self.sweep, job.book
        ratios = sweep.done(job.dead)
        if not ratios:
            return []
        worst = max(ratios, key=lambda r: ratios[r])
        # Nothing else sees these ranks, so the sweep's one answer must pass the smallest alarm
        # (min_alarm_factor) too: the slowest of sixteen healthy answers read ×1.038 in the sampled
        # long-document bursts, under the four-σ bar of a spread that sixteen answers put too low.
        ratio, bar = ratios[worst], max(book.probes.bar(ratios), job.config.min_alarm_factor)
        epoch = sweep.epoch
        plan = job.plan(epoch)
        role = plan.roles.get(worst) if plan is not None else None
        if ratio < bar or book.names(worst) or role is None:
            return []
        table = ", ".join(f"{r}: ×{v:.2f}" for r, v in sorted(ratios.items()))
        return book.open_unseen(Suspect(
            key=IncidentKey.of_ranks((worst,)), target="compute", rank=worst, link=None, node=None, replica=role.replica,
            stage=role.stage, tp_group=job.tp_group_of(epoch, worst) or None, factor=ratio, place_confidence=1.0,
            iterations=[sweep.iteration], observed_s=[], predicted_s=[], rank_factors={worst: round(ratio, 4)},
            statistic=f"sweep probe of the {len(ratios)} ranks nobody traces: rank {worst} took ×{ratio:.2f} of "
                      f"the healthy reference, above the bar ×{bar:.3f} ({table})",
            note=f"rank {worst} is not traced; " + (
                f"iteration {sweep.iteration} was later than the job runs healthy, and a probe of the untraced ranks "
                f"asked then measured it" if sweep.late else
                "its slowdown is within what the job's lateness can show, and the periodic probe of the untraced "
                "ranks measured it"),
            ranks=(worst,), measure="compute", basis=PROBE,
            margin=math.log(ratio) / math.log(bar) if bar > 1 else 1.0), sweep.iteration)
