"""Goodput (ETTR) as one fold over the event log: the share of a job's wall time spent on productive
training, and where the rest went.

Every reader imports this fold — the metrics exporter (``analytics/service/metrics.py``) and the console's
job view — so the figure an operator sees on a dashboard and on the console is one definition. It
lives in collector/ beside the plan and incident folds because it reads nothing but the contract:
the console folds it from the log itself rather than importing analytics.

Time is the job's event time (the trainer's and simulator's ``time_s``; the detector and the engine
stamp their events with the event time that caused them). The wall time of a job runs from its first
event to the newest event of its own clock; operators' decisions (``plan.decision``) carry the
operator's clock and never move it.
Wall time is cut into:

* **training**: each ``telemetry.summary`` covers ``[time_s − wall_s, time_s]``. Of that, the part an
  open fail-slow incident explains — observed minus predicted iteration time
  (``analytics.prediction``), from the first iteration of the incident's evidence until it is
  resolved — is **fail_slow** drag; the rest is productive.
* **gaps** between iterations, attributed by what was true meanwhile, first match wins:
  a plan waiting for an operator's decision → **approval**; an open fail-stop incident →
  **fail_stop** (a hang on a dead device is charged from the end of the last iteration, before the
  detector noticed); the reshape pause an acknowledgement reports → **reshape**; the rest of a gap
  after an applied reshape, or in which the trainer announced a restart → **restart**
  (checkpoint load, process restart); an open fail-slow incident → **fail_slow** (probing);
  anything else → **other**.

Drag while a plan waits for approval is charged to **approval** too: that is the loss an operator's
decision could have saved. The loss counters only grow: a gap is charged when its cause is known
(progressively while a fail-stop hang or a wait for approval lasts, otherwise when the next iteration
starts), and until then it is ``pending_s``: part of the wall time, not of any cause. Drag is kept as
a signed running sum per incident and the counter follows its maximum, so noise around a prediction
neither inflates the loss nor makes a counter go back. Each iteration's excess (observed / predicted
− 1) is taken less the median excess of recent healthy iterations (the prediction's own bias: the
truth it is graded on includes the job's usual noise), and capped at the incident's median + 4 MAD
(a stall in a slow window is noise, not the fault).

Which incidents are open, and what they say, is collector/incident_lifecycle.py's fold (one per
job), the one the engine and the console read; which plans still wait for a decision follows the
plan fold's rule of what supersedes a waiting plan (collector/plan_lifecycle.py's ``supersedes``).
Goodput keeps only its own figures on top: each open incident's drag, each waiting plan's time.

The state is plain data (:meth:`GoodputFold.to_state` / :meth:`GoodputFold.load_state`, the
incident fold's records included) so the analytics consumer stores it in the same DuckDB
transaction as its offsets (``analytics/projections/goodput_projection.py``): a restart resumes the counters
where they were.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from collector import incident_lifecycle
from collector.events import (
    AckStatus, CommandAck, Envelope, FaultCategory, Heartbeat, IncidentConfirmed, IncidentOpened, IncidentResolved,
    IncidentUpdated, IterationPrediction, IterationSummary, PlanCurrent, PlanDecision, PlanProposed, Severity,
)
from collector.incident_lifecycle import IncidentLifecycle, IncidentRecord
from collector.plan_lifecycle import supersedes

CAUSES: tuple[str, ...] = ("fail_stop", "fail_slow", "reshape", "restart", "approval", "other")
_WINDOW_ITERATIONS = 4096  # predictions kept for back-dating drag to an incident's first evidence
_EXCESS_WINDOW = 64  # iterations of an incident whose excess sets the cap on one iteration's drag
_BASELINE_WINDOW = 256  # healthy iterations whose median excess is the prediction's own bias
_JOB_PREFIXES = ("telemetry.", "analytics.", "incident.", "probe.", "plan.", "command.")
_CLOCK_KINDS = frozenset({IterationSummary.KIND, Heartbeat.KIND, CommandAck.KIND, PlanCurrent.KIND})


@dataclass(frozen=True)
class Goodput:
    """One job's goodput now. ``loss_s`` are the committed counters; ``pending_s`` is gap time whose
    cause is not known yet. ``wall_s = productive_s + sum(loss_s) + pending_s``."""

    job: str
    wall_s: float
    productive_s: float
    loss_s: dict[str, float]
    pending_s: float

    @property
    def ratio(self) -> float:
        """Productive share of wall time (1.0 before the job has run at all)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0


@dataclass
class OpenIncident:
    """An open incident as goodput charges it: the incident fold's category, severity and factors,
    and the drag it has cost so far."""

    category: str
    severity: str
    factor: float
    p_real: float  # how sure the detector is that the fault is real (collector/incident_lifecycle.py)
    first_iteration: int
    drag_raw_s: float = 0.0  # signed sum of observed − predicted over its iterations (outliers capped)
    excess: list[float] = field(default_factory=list)  # recent observed / predicted − 1 of its iterations
    drag_charged_s: float = 0.0  # what the counters hold: the running maximum of drag_raw_s, never below 0


@dataclass
class JobGoodput:
    """The fold's state for one job (plain data: it round-trips through ``asdict``)."""

    t0_s: float | None = None
    now_s: float = float("-inf")
    committed_until_s: float | None = None  # every second before this is charged (training or a cause)
    training_s: float = 0.0
    drag_s: float = 0.0  # the part of training_s charged to fail_slow or approval
    loss_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    last_wall_s: float = 0.0
    last_iteration: int = -1
    restart_in_gap: bool = False
    incidents: dict[str, OpenIncident] = field(default_factory=dict)
    awaiting: dict[str, list[float]] = field(default_factory=dict)  # plan id -> [proposed at, base epoch]
    predictions: dict[int, list[float]] = field(default_factory=dict)  # iteration -> [observed, predicted]
    charged_iterations: dict[int, list[str]] = field(default_factory=dict)  # iteration -> incident ids charged
    acks: list[str] = field(default_factory=list)  # applied command ids (bounded), so a re-sent ack is charged once
    healthy_excess: list[list[float]] = field(default_factory=list)  # [iteration, observed / predicted − 1], no fail-slow open
    last_observed_s: float | None = None
    last_predicted_s: float | None = None
    last_stages: list[list[float]] = field(default_factory=list)  # [replica, stage, observed, predicted] (the newest)
    tokens: int = 0
    iterations: int = 0


def _cause_now(s: JobGoodput, *, closing: bool) -> str | None:
    """What a gap slice is charged to given the state now (None: not known yet, leave it pending)."""
    if s.awaiting:
        return "approval"
    if any(i.category == FaultCategory.FAIL_STOP for i in s.incidents.values()):
        return "fail_stop"
    if s.restart_in_gap:
        return "restart"
    if any(i.category == FaultCategory.FAIL_SLOW for i in s.incidents.values()):
        return "fail_slow"
    return "other" if closing else None


class GoodputFold:
    """Goodput of every job on the log. ``apply`` one event at a time, in log order."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobGoodput] = {}
        self.incident_folds: dict[str, IncidentLifecycle] = {}  # job -> its open incidents, as the fold says

    # ---- reading -------------------------------------------------------------------------------

    def breakdown(self, job: str) -> Goodput | None:
        s = self.jobs.get(job)
        if s is None or s.t0_s is None:
            return None
        wall = max(s.now_s - s.t0_s, 0.0)
        committed = s.committed_until_s if s.committed_until_s is not None else s.t0_s
        pending = max(s.now_s - committed, 0.0)
        return Goodput(job=job, wall_s=wall, productive_s=max(s.training_s - s.drag_s, 0.0), loss_s=dict(s.loss_s),
                       pending_s=pending)

    # ---- folding -------------------------------------------------------------------------------

    def apply_all(self, events: Iterable[Envelope]) -> None:
        for e in events:
            self.apply(e)

    def apply(self, event: Envelope) -> None:
        p = event.payload
        kind = event.kind
        if kind == "telemetry.iteration" or not kind.startswith(_JOB_PREFIXES):
            return  # per-rank telemetry (the summary says it once), or no part of a job's time (ui.*, truth.*)
        s = self.jobs.get(event.job)
        if s is None:
            s = self.jobs[event.job] = JobGoodput()
        if kind in _CLOCK_KINDS:
            if isinstance(p, CommandAck) and p.status == AckStatus.APPLIED and p.command_id not in s.acks:
                self._ack(s, event.time_s, p)
                return
            if isinstance(p, IterationSummary):
                self._iteration(s, event.time_s, p)
                return
            if s.t0_s is None and isinstance(p, PlanCurrent):
                s.t0_s = s.committed_until_s = event.time_s
            self._advance(s, event.time_s)
            if isinstance(p, PlanCurrent) and p.reason == "restart":
                s.restart_in_gap = True
            return
        if not isinstance(p, PlanDecision):  # an operator's decision carries the operator's clock
            self._advance(s, event.time_s)
        if isinstance(p, IncidentOpened | IncidentConfirmed | IncidentUpdated | IncidentResolved):
            self._incident(s, event)
        elif isinstance(p, IterationPrediction):
            self._prediction(s, p)
        elif isinstance(p, PlanProposed):
            self._charge_gap(s, closing=False)
            for pid, (_, base) in list(s.awaiting.items()):
                if supersedes(p, int(base)):
                    del s.awaiting[pid]
            s.awaiting[p.plan_id] = [event.time_s, float(p.base_epoch)]
        elif isinstance(p, PlanDecision):
            self._charge_gap(s, closing=False)
            s.awaiting.pop(p.plan_id, None)

    def _advance(self, s: JobGoodput, t: float) -> None:
        if s.t0_s is None:
            s.t0_s = s.committed_until_s = t
        if t > s.now_s:
            s.now_s = t
            self._charge_gap(s, closing=False)

    def _charge(self, s: JobGoodput, cause: str, until_s: float) -> None:
        start = s.committed_until_s if s.committed_until_s is not None else until_s
        if until_s > start:
            s.loss_s[cause] += until_s - start
            s.committed_until_s = until_s

    def _charge_gap(self, s: JobGoodput, *, closing: bool, until_s: float | None = None) -> None:
        """Charge the uncharged gap up to ``until_s`` (default: now) if its cause is known. Before the
        gap closes only a hang (fail-stop) or a wait for approval is charged, and the last iteration's
        length stays pending: the job may be in the middle of an iteration whose summary has not come."""
        end = s.now_s if until_s is None else until_s
        cause = _cause_now(s, closing=closing)
        if cause is None:
            return
        if not closing:
            if cause not in ("approval", "fail_stop"):
                return  # charged when the gap closes: until then the job may be mid-iteration
            end -= s.last_wall_s
        self._charge(s, cause, end)

    def _iteration(self, s: JobGoodput, t: float, p: IterationSummary) -> None:
        start = t - p.wall_s
        if s.t0_s is None:
            s.t0_s = s.committed_until_s = start
        s.now_s = max(s.now_s, t)
        self._charge_gap(s, closing=True, until_s=start)
        begin = max(start, s.committed_until_s if s.committed_until_s is not None else start)
        if t > begin:
            s.training_s += t - begin
            s.committed_until_s = t
        s.last_wall_s = p.wall_s
        s.restart_in_gap = False
        if p.iteration > s.last_iteration:
            s.last_iteration = p.iteration
            s.tokens += p.tokens
            s.iterations += 1

    def _ack(self, s: JobGoodput, t: float, p: CommandAck) -> None:
        s.acks = (s.acks + [p.command_id])[-64:]
        pause_from = t - p.pause_s
        if pause_from > s.now_s:
            s.now_s = pause_from
        self._charge_gap(s, closing=True, until_s=pause_from)
        s.now_s = max(s.now_s, t)
        self._charge(s, "reshape", t)
        s.restart_in_gap = True  # what the gap still holds after the pause is the restart into the new plan

    def _incident(self, s: JobGoodput, event: Envelope) -> None:
        """Fold an incident event (its signature was checked by whoever reads the bus for this fold)
        and follow what the fold now says of the incident it changed."""
        book = self.incident_folds.setdefault(event.job, IncidentLifecycle(job=event.job))
        record = incident_lifecycle.transition(book, event)
        if record is None:
            return
        if not record.is_open:
            s.incidents.pop(record.incident_id, None)
            del book.incidents[record.incident_id]  # goodput keeps open incidents only, as its state does
            return
        inc = s.incidents.get(record.incident_id)
        if inc is None:
            self._incident_opened(s, record)
        else:
            inc.severity, inc.factor, inc.p_real = record.severity.value, record.factor, record.p_real

    def _incident_opened(self, s: JobGoodput, record: IncidentRecord) -> None:
        first = record.evidence_from_iteration
        s.incidents[record.incident_id] = OpenIncident(
            category=record.category.value, severity=record.severity.value, factor=record.factor,
            p_real=record.p_real, first_iteration=first)
        s.healthy_excess = [h for h in s.healthy_excess if h[0] < first]  # they were slow, not healthy
        if record.category == FaultCategory.FAIL_STOP:
            self._charge_gap(s, closing=False)  # the hang began at the last iteration's end: charge it now
        else:
            for it in sorted(k for k in s.predictions if k >= first):
                self._drag(s, it)

    def _prediction(self, s: JobGoodput, p: IterationPrediction) -> None:
        if p.stages:
            s.last_stages = [[st.replica, st.stage, st.observed_s, st.predicted_s] for st in p.stages]
        if p.predicted_s <= 0:
            return  # the detector could not predict this iteration: nothing to compare
        s.last_observed_s, s.last_predicted_s = p.observed_s, p.predicted_s
        s.predictions[p.iteration] = [p.observed_s, p.predicted_s]
        if not any(i.category == FaultCategory.FAIL_SLOW for i in s.incidents.values()):
            s.healthy_excess = s.healthy_excess[-(_BASELINE_WINDOW - 1):] + [[p.iteration, p.observed_s / p.predicted_s - 1]]
        if len(s.predictions) > _WINDOW_ITERATIONS:
            for it in sorted(s.predictions)[: len(s.predictions) - _WINDOW_ITERATIONS]:
                del s.predictions[it]
                s.charged_iterations.pop(it, None)
        self._drag(s, p.iteration)

    def _drag(self, s: JobGoodput, iteration: int) -> None:
        """Charge iteration ``iteration``'s observed − predicted to each open fail-slow incident it
        falls in (once per incident), and the counters by the running maximum of each one's sum."""
        obs, pred = s.predictions[iteration]
        charged = s.charged_iterations.setdefault(iteration, [])
        for iid, inc in s.incidents.items():
            if inc.category != FaultCategory.FAIL_SLOW or iteration < inc.first_iteration or iid in charged:
                continue
            charged.append(iid)
            inc.drag_raw_s += pred * (_capped_excess(inc, obs / pred - 1.0) - _median([x for _, x in s.healthy_excess]))
            grow = inc.drag_raw_s - inc.drag_charged_s
            if grow > 0:
                inc.drag_charged_s = inc.drag_raw_s
                s.loss_s["approval" if s.awaiting else "fail_slow"] += grow
                s.drag_s += grow
            break  # one iteration's drag is charged to one incident only

    # ---- state ---------------------------------------------------------------------------------

    def to_state(self, job: str) -> dict[str, Any]:
        book = self.incident_folds.get(job)
        records = [r.to_state() for r in book.incidents.values()] if book is not None else []
        return {**asdict(self.jobs[job]), "incident_records": records}

    def load_state(self, job: str, state: dict[str, Any]) -> None:
        st = dict(state)
        records = [IncidentRecord.from_state(r) for r in st.pop("incident_records", [])]
        if not records:  # a state stored before it kept the fold's records: what goodput knew of each
            records = [IncidentRecord(iid, FaultCategory(v["category"]), Severity(v["severity"]), [], "",
                                      v["first_iteration"], evidence_from_iteration=v["first_iteration"])
                       for iid, v in st.get("incidents", {}).items()]
        book = self.incident_folds[job] = IncidentLifecycle(job=job)
        book.incidents = {r.incident_id: r for r in records}
        st["incidents"] = {k: OpenIncident(**_p_real_of(v)) for k, v in st.get("incidents", {}).items()}
        st["predictions"] = {int(k): v for k, v in st.get("predictions", {}).items()}
        st["charged_iterations"] = {int(k): v for k, v in st.get("charged_iterations", {}).items()}
        st["loss_s"] = {**dict.fromkeys(CAUSES, 0.0), **st.get("loss_s", {})}
        self.jobs[job] = JobGoodput(**st)


def _p_real_of(stored: dict) -> dict:
    """A stored open incident's fields; one stored before p_real held the detector's mixed
    ``confidence``, which says nothing calibrated: it reads as uncalibrated until its next event."""
    fields = {k: v for k, v in stored.items() if k != "confidence"}
    fields.setdefault("p_real", incident_lifecycle.UNCALIBRATED)
    return fields


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _capped_excess(inc: OpenIncident, excess: float) -> float:
    """``excess`` capped at the incident's recent median + 4 MAD: a stall (a GC pause, a slow data
    load) that lands in a fail-slow window is the job's own noise, not the fault's drag, and one of
    them can weigh as much as a hundred slow iterations. The first few iterations are taken as they are."""
    recent = inc.excess[-_EXCESS_WINDOW:]
    inc.excess = recent[-(_EXCESS_WINDOW - 1):] + [excess]
    if len(recent) < 8:
        return excess
    ordered = sorted(recent)
    median = ordered[len(ordered) // 2]
    mad = sorted(abs(x - median) for x in recent)[len(recent) // 2]
    return min(excess, median + 4.0 * max(mad, 0.01))
