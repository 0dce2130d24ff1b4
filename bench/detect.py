"""Detection accuracy: ours and the baselines on the simulator's scenario suite, scored per fault.

Each scenario runs the cluster simulator (trainer/sim) for a fixed number of iterations; every
detector sees the same events; ours may probe suspects, and the simulator answers. Ground truth is
the simulator's ``truth.fault`` events, which no detector reads.

Scoring, per detector, over the whole suite, is the referee's (resihp/referee.py: ``score``):
a fault is detected by the first incident of its category opened while it is active (from one
iteration before its onset to ``--grace`` iterations after it ends) that names a device it hits
(an incident that names no device also counts: raw-time baselines cannot localise); precision,
recall, exact localisation, delay p50 / p95 (the x1.2-and-more p95 apart) and false alarms per
10,000 healthy iterations follow from that match. Sizes: the last size of each slow GPU's
incident while the fault lasted (``sizing``) and the first size each detected fail-slow's incident
reported (``first_sizes``: median and p95 error per dialect, against the goal of 5 %). Ours's
p_real (how sure each incident is that its fault is real) against the share of its openings that
were real, per decile (``reliability``), per dialect, over every dialect and on the half its
calibration table was not fitted on; ``--fit-calibration`` fits that table on the other half
(analytics/detection/calibration.py).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from bench._detect_tuning import BaselineInputs, tune_and_hold_out
from resihp.referee import covers, detecting, fault_devices, score

if TYPE_CHECKING:
    from collector.events import FaultInjected
    from trainer.sim.engine import SimConfig, SimEngine

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"


@dataclass
class Case:
    name: str
    base: str  # a file under scenarios/
    faults: list[dict] | None = None  # replaces the file's faults when given
    iterations: int | None = None
    kind: str = "fault"  # healthy | fault
    family: str | None = None  # a class of runs scored apart as well (``FAMILY_BURSTS``)
    declares_waits: bool = True  # false: p2p timers that hold waits are recorded without saying so


# Healthy jobs whose packed lengths are imbalanced across replicas for a few iterations at a time
# (long-document bursts, scenarios/long_doc_bursts_*.yaml): what a Megatron job without lengths
# must stay silent on. Context parallel 2 is simulated as the plan's stage group of two lock-step
# devices, the way the profiler import lays a CP x TP stage out (collector/profiler_import.py).
FAMILY_BURSTS = "long-document bursts"


def suite(iterations: int) -> list[Case]:
    n = iterations
    cases = [
        Case("healthy short context", "healthy_short_context", iterations=n, kind="healthy"),
        Case("healthy long context", "healthy_long_context", iterations=n, kind="healthy"),
        Case("stage imbalance (not a fault)", "stage_imbalance", iterations=n, kind="healthy"),
        Case("zero-bubble healthy", "zero_bubble_healthy", iterations=n, kind="healthy"),
        Case("bursts PP2 CP2 DP32", "long_doc_bursts_pp2_cp2", iterations=n, kind="healthy", family=FAMILY_BURSTS),
        Case("bursts PP2 CP2 DP32 undeclared", "long_doc_bursts_pp2_cp2", iterations=n, kind="healthy",
             family=FAMILY_BURSTS, declares_waits=False),
        Case("bursts PP4 CP2 DP16", "long_doc_bursts_pp4_cp2", iterations=n, kind="healthy", family=FAMILY_BURSTS),
        Case("bursts PP4 DP8", "long_doc_bursts_pp4", iterations=n, kind="healthy", family=FAMILY_BURSTS),
        Case("slow from start x1.8", "slow_from_start", iterations=n),
        Case("interleaved compute x2", "interleaved_fail_slow", iterations=max(n, 170)),
        Case("fail-stop gpu", "fail_stop_gpu", iterations=n,
             faults=[{"kind": "stop_device", "device": 13, "at_iteration": n // 3}]),
        Case("fail-stop node", "fail_stop_node", iterations=n,
             faults=[{"kind": "stop_node", "node": 2, "at_iteration": n // 3}]),
    ]
    for i, factor in enumerate((1.05, 1.1, 1.2, 1.5, 2.0, 3.0)):
        device = (3, 10, 17, 24, 30, 9)[i]
        cases.append(Case(f"compute x{factor} (recovers)", "fail_slow_compute_x2", iterations=n, faults=[
            {"kind": "slow_compute", "device": device, "factor": factor, "at_iteration": n // 3,
             "duration_iterations": n // 3}]))
    for factor, link in ((1.5, (4, 6)), (3.0, (10, 12))):
        cases.append(Case(f"pipeline link x{factor}", "fail_slow_link", iterations=n, faults=[
            {"kind": "slow_link", "link": list(link), "factor": factor, "at_iteration": n // 3,
             "duration_iterations": n // 3}]))
    cases.append(Case("NIC x3 (DP all-reduce)", "fail_slow_link", iterations=n, faults=[
        {"kind": "slow_nic", "device": 22, "factor": 3.0, "at_iteration": n // 3, "duration_iterations": n // 3}]))
    return cases


def make_detectors(job: str) -> dict:
    from analytics.detection.baselines import ChangePointDetector, RawThresholdDetector, RelativeRankDetector
    from analytics.detection.detector import Detector
    from analytics.detection.config import DetectorConfig

    return {"ours": Detector(job, DetectorConfig(probes=True)), "raw_threshold": RawThresholdDetector(job),
            "greyhound_changepoint": ChangePointDetector(job), "nvrx_relative": RelativeRankDetector(job)}


@dataclass
class Tracked:
    opened: int
    category: str
    sized: list = field(default_factory=list)  # (simulator iteration, locations) of every opening, confirmation, update
    p_real: float | None = None  # what the opening said of how sure the fault is real (None: uncalibrated)
    basis: str = ""  # the evidence the opening rested on, and by how much it passed its bar (calibration.py)
    margin: float = float("nan")

    @property
    def locations(self) -> list:
        """Where the incident's latest event put it."""
        return self.sized[-1][1] if self.sized else []


def case_engine(case: Case, dialect: str) -> tuple[SimEngine, int]:
    """The simulator set up for ``case`` recording in ``dialect``, and the iterations to run."""
    from trainer.fault_spec import FaultSpec
    from trainer.sim.engine import SimEngine
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(SCENARIO_DIR / f"{case.base}.yaml")
    update: dict = {"iterations": case.iterations or sc.iterations, "dialect": dialect,
                    "declares_waits": case.declares_waits}
    if case.faults is not None:
        update["faults"] = [FaultSpec(**f) for f in case.faults]
    sc = sc.model_copy(update=update)
    return SimEngine(sc.sim_config(), sc.all_faults()), update["iterations"]


class CaseRun(NamedTuple):
    """One simulated case: the truth, what each detector opened, and what ours's probes cost."""

    faults: list[FaultInjected]
    incidents: dict[str, dict[str, Tracked]]  # per detector, by incident id
    iterations: int
    healthy: int  # iterations no fault touched
    config: SimConfig
    probe_pause_s: float  # training time ours's probes paused (each probe holds the job for its longest answer)
    run_s: float  # the simulated job's time, probe pauses included
    baseline_inputs: BaselineInputs  # what the baselines read, for tuning them on a replay


def run_case(case: Case, dialect: str = "ours") -> CaseRun:
    """Simulate one case, its ranks recording in ``dialect`` (docs/dialects.md: the same timeline and
    faults in every dialect, only what the ranks report differs). Only ours asks probes; the
    simulator answers each in place, the job paused for as long as the longest answer took."""
    from collector.events import (
        FaultInjected, IncidentConfirmed, IncidentOpened, IncidentUpdated, IterationSummary, ProbeRequest, RankIteration,
    )

    engine, target = case_engine(case, dialect)
    job = engine.config.job
    detectors = make_detectors(job)
    incidents: dict[str, dict[str, Tracked]] = {name: {} for name in detectors}
    truth: dict[str, FaultInjected] = {}

    def absorb(name: str, payloads: list) -> list:
        probes = []
        for p in payloads:
            if isinstance(p, IncidentOpened):
                margin = p.evidence.margin
                incidents[name][p.incident_id] = Tracked(p.iteration, p.category.value,
                                                         [(engine.iteration, list(p.locations))], p.p_real,
                                                         p.evidence.basis, float("nan") if margin is None else margin)
            elif isinstance(p, (IncidentConfirmed, IncidentUpdated)) and p.locations:
                if p.incident_id in incidents[name]:
                    incidents[name][p.incident_id].sized.append((engine.iteration, list(p.locations)))
            elif isinstance(p, ProbeRequest):
                probes.append(p)
        return probes

    pause_s = 0.0
    guard = 0
    inputs = BaselineInputs()
    while engine.iteration < target and not engine.finished and guard < 10 * target:
        guard += 1
        for e in engine.step():
            if isinstance(e.payload, FaultInjected):
                truth[e.payload.fault_id] = e.payload
                continue
            if isinstance(e.payload, IterationSummary):
                inputs.summaries.append((e.payload.iteration, e.payload.wall_s))
            elif isinstance(e.payload, RankIteration):
                r = e.payload
                inputs.ranks.append((r.iteration, r.rank, r.coords.dp, r.coords.pp, sum(r.chunk_table.duration_s)))
            for name, det in detectors.items():
                probes = absorb(name, det.on_event(e))
                while probes:  # an answer may ask for another probe (an untraced suspect's links)
                    probe = probes.pop(0)
                    before_s = engine.now_s
                    answers = engine.probe(probe)
                    pause_s += engine.now_s - before_s
                    for answer in answers:
                        probes += absorb(name, det.on_event(answer))
    for name, det in detectors.items():
        absorb(name, det.flush())
    faults = list(truth.values())
    iterations = engine.iteration
    faulty = set()
    for f in faults:
        faulty |= set(range(f.start_iteration, f.end_iteration if f.end_iteration is not None else iterations))
    healthy = sum(1 for i in range(iterations) if i not in faulty)
    return CaseRun(faults, incidents, iterations, healthy, engine.config, pause_s, engine.now_s, inputs)


def sizing(faults: list, incs: dict[str, Tracked], iterations: int, config, grace: int = 5
           ) -> list[tuple[float, float, float]]:
    """(true factor, the detecting incident's last factor while the fault lasted, that factor as the
    planner reads it) per slow-GPU fault whose incident named the GPU.

    The detector sizes a slow GPU by how much longer its chunks take than predicted: compute, TP
    communication and per-layer overhead together. The engine turns that into the GPU's compute
    factor (``compute_factor_of``, here with the simulator's exact cost figures; a probe's size of a
    rank nobody traces is a compute factor already), and the planner's gains follow from it: a ×2
    GPU read as ×1.9 can put a plan's gain under the engine's minimum. So sizing is scored on the
    compute factor, against the injected one."""
    from remediation.cluster import ClusterState
    from remediation.costs import compute_factor_of
    from resihp.planning_models import exact_model, hardware_of

    model = exact_model(config.model, config.cluster, config.workload)
    cluster = ClusterState(config.cluster.gpus, hardware_of(config.cluster))
    out = []
    for f in faults:
        if f.category.value != "fail_slow" or f.location.target != "compute" or f.location.rank is None:
            continue
        hits = detecting(f, incs, gpus_per_node=config.cluster.gpus_per_node, iterations=iterations,
                         grace=grace)
        end = f.end_iteration if f.end_iteration is not None else iterations
        # the last size published while the fault lasted: after a recovery the factor falls again
        during = [locs for it, locs in incs[hits[0][1]].sized if it <= end] if hits else []
        locs = during[-1] if during else []
        if not locs or locs[0].rank != f.location.rank:
            continue
        chunk = float(locs[0].factor)
        out.append((float(f.location.factor), chunk,
                    compute_factor_of(cluster, model, config.plan, f.location.rank, chunk, locs[0].measure)))
    return out


def first_sizes(faults: list, incs: dict[str, Tracked], iterations: int, config, grace: int = 5
                ) -> list[tuple[str, float, float]]:
    """(fault kind, injected factor, the size its detecting incident first reported) per detected
    fail-slow fault: what a planner acting at once would read. The first report is the incident's
    first event (opened, confirmed, updated) that places the fault: its locations name a device the
    fault hits (the referee's ``covers``, an unplaced incident covering nothing) — the rule of the
    closed loop, and the planner's (remediation/planning_view.py plans nothing around a location
    that names no device). Two kinds of incident open without a place: a communication incident
    on the iteration's excess, and time lost on one of the ranks nobody traces (sampled tracing);
    the probe that names the link, NIC or GPU, answered in the same iteration, first places and
    sizes each. An incident that is never placed counts its opening. A slow GPU's size is read as
    the engine reads it (its compute factor, ``compute_factor_of``, whether the incident names the
    GPU or its TP group: both are sized by the same chunks; a probe's size as it stands), a link's
    or NIC's as it stands. Later refinements do not count here; ``sizing`` scores the last size."""
    from remediation.cluster import ClusterState
    from remediation.costs import compute_factor_of
    from resihp.planning_models import exact_model, hardware_of

    model = exact_model(config.model, config.cluster, config.workload)
    cluster = ClusterState(config.cluster.gpus, hardware_of(config.cluster))
    out = []
    for f in faults:
        if f.category.value != "fail_slow":
            continue
        per_node = config.cluster.gpus_per_node
        hits = detecting(f, incs, gpus_per_node=per_node, iterations=iterations, grace=grace)
        reports = [locs for _, locs in incs[hits[0][1]].sized] if hits else []
        hit = fault_devices(f.location, per_node)
        placed = [locs for locs in reports if covers(hit, locs, per_node, unplaced_covers=False)]
        locs = (placed or reports or [[]])[0]
        if not locs:
            continue
        read = float(locs[0].factor)
        kind = "compute" if f.location.target == "compute" and f.location.rank is not None else "link"
        if kind == "compute":
            read = compute_factor_of(cluster, model, config.plan, f.location.rank, read, locs[0].measure)
        out.append((kind, float(f.location.factor), read))
    return out


class Opening(NamedTuple):
    """One of ours's openings on the suite, labelled by the referee: what calibration is fitted on."""

    dialect: str
    case: int  # its case's place in the suite (even: half A, the half the table is fitted on)
    basis: str
    margin: float
    p_real: float | None  # as the detector reported it (None: uncalibrated)
    real: bool  # it detected a fault (the referee's match, ``detecting``)


def openings(results: list, dialect: str, grace: int = 5) -> list[Opening]:
    """Ours's openings over the suite's runs (``score``'s input), each labelled real or not: real
    when it detects a fault as the referee matches them (its category, while the fault is active,
    naming a device the fault hits; an incident that names none also counts)."""
    out = []
    for case, (faults, incidents, iterations, _, cluster, _) in enumerate(results):
        incs = incidents["ours"]
        matched: set[str] = set()
        for f in faults:
            matched |= {iid for _, iid in detecting(f, incs, gpus_per_node=cluster.gpus_per_node,
                                                    iterations=iterations, grace=grace)}
        out += [Opening(dialect, case, t.basis, t.margin, t.p_real, iid in matched) for iid, t in incs.items()]
    return out


MIN_JUDGED = 20  # a decile with fewer incidents is printed but not judged against the calibration goal
CALIBRATION_GOAL = 0.05  # |mean p_real − share real| per judged decile


def reliability(rows: list[tuple[float, bool]], min_judged: int = MIN_JUDGED) -> list[dict]:
    """(p_real, real) pairs per decile of p_real: of the incidents reported at about p, the share
    that were real. A decile's gap is |mean p_real − share real|; it is judged only with
    ``min_judged`` incidents or more (fewer say little: one false incident in five is a gap of 0.2
    by chance). Empty deciles are left out; p = 1.0 falls in the top decile."""
    out = []
    for d in range(10):
        lo, hi = d / 10, (d + 1) / 10
        sel = [(p, real) for p, real in rows if lo <= p < hi or (d == 9 and p == 1.0)]
        if not sel:
            continue
        mean = float(np.mean([p for p, _ in sel]))
        share = float(np.mean([real for _, real in sel]))
        out.append({"decile": f"{lo:.1f}-{hi:.1f}", "incidents": len(sel), "mean_p_real": round(mean, 4),
                    "share_real": round(share, 4), "gap": round(abs(mean - share), 4),
                    "judged": len(sel) >= min_judged})
    return out


def worst_judged_gap(table: list[dict]) -> float | None:
    """The largest gap among a reliability table's judged deciles (None: none judged)."""
    gaps = [row["gap"] for row in table if row["judged"]]
    return max(gaps) if gaps else None


def print_reliability(title: str, table: list[dict]) -> None:
    print(f"\n{title:40} {'incidents':>9} {'mean p':>7} {'real':>6} {'gap':>6}")
    for row in table:
        print(f"{row['decile']:40} {row['incidents']:9d} {row['mean_p_real']:7.3f} {row['share_real']:6.3f} "
              f"{row['gap']:6.3f}" + ("" if row["judged"] else f"  (under {MIN_JUDGED}: not judged)"))
    worst = worst_judged_gap(table)
    print(f"{'worst judged gap':40} " + ("none judged" if worst is None else
                                          f"{worst:.3f} ({'within' if worst <= CALIBRATION_GOAL else 'over'} "
                                          f"the goal {CALIBRATION_GOAL})"))


def calibration_report(labelled: list[Opening], fit_table: bool) -> dict:
    """The reliability of p_real per dialect, over every dialect run, and over the held-back half
    (cases at odd places: the committed table is fitted on the even ones). With ``fit_table`` the
    table is fitted here on half A of ``labelled`` and written (analytics/detection/calibration.py),
    and every opening's p_real is read from the new table, as the detector will report it; else
    p_real is what the detector reported (uncalibrated as 0.5)."""
    from analytics.detection import calibration

    if fit_table:
        dialects = sorted({o.dialect for o in labelled})
        table = calibration.fit([(o.basis, o.margin, o.real) for o in labelled if o.case % 2 == 0],
                                fitted_on=f"the detection suite's cases at even places (half A), dialects "
                                          f"{', '.join(dialects)}")
        calibration.write_table(table)
        print(f"\ncalibration fitted on half A ({table['pooled']['incidents']} openings, "
              f"{table['pooled']['real']} real) and written to {calibration.TABLE_PATH}")

        def p_of(o: Opening) -> float:
            return calibration.p_real(o.basis, o.margin, table)
    else:
        def p_of(o: Opening) -> float:
            return calibration.UNCALIBRATED if o.p_real is None else o.p_real
    out: dict = {"per_dialect": {}}
    for dialect in dict.fromkeys(o.dialect for o in labelled):
        deciles = reliability([(p_of(o), o.real) for o in labelled if o.dialect == dialect])
        print_reliability(f"p_real of ours ({dialect})", deciles)
        out["per_dialect"][dialect] = deciles
    out["all"] = reliability([(p_of(o), o.real) for o in labelled])
    print_reliability("p_real of ours (every dialect run)", out["all"])
    out["held_back"] = reliability([(p_of(o), o.real) for o in labelled if o.case % 2 == 1])
    print_reliability("p_real of ours (held-back half B)", out["held_back"])
    out["false_openings"] = sum(not o.real for o in labelled)
    out["openings"] = len(labelled)
    return out


def _tracked(opened: list) -> dict[str, Tracked]:
    """Opened incidents as the referee's records (a replayed baseline's incidents)."""
    return {p.incident_id: Tracked(p.iteration, p.category.value, [(p.iteration, list(p.locations))]) for p in opened}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=120, help="iterations per scenario")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this text")
    parser.add_argument("--grace", type=int, default=5, help="iterations after a fault ends that still count")
    parser.add_argument("--no-tune", dest="tune", action="store_false",
                        help="skip tuning the baselines on one half of the suite and scoring every detector on the "
                        "other (a replay of what the baselines read: no simulation, a few seconds a dialect)")
    parser.add_argument("--fit-calibration", action="store_true",
                        help="fit p_real's calibration table on half A of the suite's openings (every dialect run) "
                        "and write analytics/detection/calibration_table.json; the reliability tables then read it")
    parser.add_argument("--dialect", action="append", default=None, metavar="NAME",
                        help="how the simulated ranks record: ours (default), megatron, profiler, sampled, or all; "
                        "repeat for several: one table per dialect, the same runs for every detector")


def dialects_of(names: list[str] | None) -> list[str]:
    """``--dialect`` values to the dialects to run, in the simulator's order: none given is ours."""
    from trainer.sim.telemetry import DIALECTS

    wanted = set(DIALECTS) if names and "all" in names else set(names or ["ours"])
    unknown = sorted(wanted - set(DIALECTS))
    if unknown:
        raise SystemExit(f"unknown dialect {', '.join(unknown)}; choose from {', '.join(DIALECTS)} or all")
    return [d for d in DIALECTS if d in wanted]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trainer.sim.scenario import load_scenario

    cases = [c for c in suite(args.iterations) if args.only is None or args.only in c.name]
    dialects = dialects_of(getattr(args, "dialect", None))
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    labelled: list[Opening] = []
    for dialect in dialects:
        results = []
        rows = []
        sized: list[tuple[str, float, float, float]] = []
        first: list[tuple[str, str, float, float]] = []
        pause_s = run_s = 0.0  # over the healthy cases: what ours's probes cost a job with nothing wrong
        families: dict[str, dict] = {}  # family → its iterations and each detector's incidents (all false)
        jobs: list[str] = []
        inputs: list[BaselineInputs] = []
        for case in tqdm(cases, desc=f"scenarios ({dialect})", disable=args.json):
            faults, incidents, iterations, healthy, config, case_pause_s, case_run_s, case_inputs = run_case(case, dialect)
            jobs.append(config.job)
            inputs.append(case_inputs)
            if case.family is not None:
                fam = families.setdefault(case.family, {"iterations": 0, "incidents": dict.fromkeys(incidents, 0)})
                fam["iterations"] += healthy
                for n, i in incidents.items():
                    fam["incidents"][n] += len(i)
            if not faults:
                pause_s, run_s = pause_s + case_pause_s, run_s + case_run_s
            plan = load_scenario(SCENARIO_DIR / f"{case.base}.yaml").build_plan()
            tp_of = {d: plan.pipelines[r.replica].stages[r.stage].devices for d, r in plan.roles.items()}
            results.append((faults, incidents, iterations, healthy, config.cluster, tp_of))
            rows.append((case.name, iterations, len(faults), {n: len(i) for n, i in incidents.items()}))
            sized += [(case.name, *row) for row in sizing(faults, incidents["ours"], iterations, config, args.grace)]
            first += [(case.name, *row) for row in first_sizes(faults, incidents["ours"], iterations, config, args.grace)]
        scores = score(results, args.grace)
        names = list(scores)
        print(f"\n== dialect: {dialect} ==")
        print(f"{'case':34} {'iters':>5} {'faults':>6} " + " ".join(f"{n[:14]:>14}" for n in names))
        for name, iters, nf, counts in rows:
            print(f"{name:34} {iters:5d} {nf:6d} " + " ".join(f"{counts[n]:14d}" for n in names))
        print()
        cols = ("precision", "recall", "f1", "localisation", "delay_p50_iters", "delay_p95_iters",
                "delay_p95_iters_x1_2_plus", "false_alarms_per_10k")
        print(f"{'detector':22} " + " ".join(f"{c[:16]:>16}" for c in cols))
        for n in names:
            print(f"{n:22} " + " ".join(f"{scores[n][c]:16.3f}" for c in cols))
        family_rates = {}
        for fam_name, fam in families.items():
            rates = {n: 1e4 * c / max(fam["iterations"], 1) for n, c in fam["incidents"].items()}
            family_rates[fam_name] = {"iterations": fam["iterations"], "incidents": fam["incidents"],
                                      "false_alarms_per_10k": {n: round(r, 2) for n, r in rates.items()}}
            print(f"\n{fam_name} ({fam['iterations']} healthy iterations), false alarms per 10k: "
                  + ", ".join(f"{n} {r:.1f}" for n, r in rates.items()))
        labelled += openings(results, dialect, args.grace)
        if args.tune:
            entry_tuning = tune_and_hold_out(results, _tracked, score, jobs, inputs, args.grace)
            print("\nbaselines tuned on one half of the suite (best F1 there), every detector scored on the other "
                  "(halves: the suite's cases at even / odd places)")
            print(f"{'detector':22} {'half':>4} {'tuned on':>8} {'f1':>7} {'precision':>9} {'recall':>7} "
                  f"{'false/10k':>9}  setting")
            for name, tuned in entry_tuning.items():
                for half in ("A", "B"):
                    row = tuned["held_out"][half]
                    setting = row.get("setting")
                    on = "-" if setting is None else ("B" if half == "A" else "A")
                    print(f"{name:22} {half:>4} {on:>8} {row['f1']:7.3f} {row['precision']:9.3f} {row['recall']:7.3f} "
                          f"{row['false_alarms_per_10k']:9.1f}  "
                          + ("" if setting is None else ", ".join(f"{k}={v}" for k, v in setting.items())))
        pause_share = pause_s / run_s if run_s > 0 else 0.0
        print(f"\nprobe pauses of ours on the healthy runs: {pause_s:.2f} s of {run_s:.1f} s ({pause_share:.2%})")
        errors = [abs(read / true - 1) for _, true, _, read in sized]
        if sized:
            print(f"\n{'slow GPU sized by ours':34} {'true':>6} {'reported':>8} {'compute':>8} {'error':>7}")
            for (name, true, chunk, read), err in zip(sized, errors):
                print(f"{name:34} {true:6.2f} {chunk:8.3f} {read:8.3f} {err:7.1%}")
            print(f"{'median / worst error':34} {'':6} {'':8} {'':8} {np.median(errors):7.1%} / {max(errors):.1%}")
        first_errors = [abs(read / true - 1) for _, _, true, read in first]
        if first:
            print(f"\n{'first size reported by ours':34} {'kind':>8} {'true':>6} {'first':>8} {'error':>7}")
            for (name, kind, true, read), err in zip(first, first_errors):
                print(f"{name:34} {kind:>8} {true:6.2f} {read:8.3f} {err:7.1%}")
            print(f"{'median / p95 error':34} {'':8} {'':6} {'':8} {np.median(first_errors):7.1%} / "
                  f"{np.percentile(first_errors, 95):.1%}")
        entry: dict = {"detectors": {n: {k: scores[n][k] for k in (
            "precision", "recall", "f1", "localisation", "delay_p95_iters", "false_alarms_per_10k",
            "delay_p50_iters", "delay_p95_iters_x1_2_plus")} for n in names}}
        entry["probe_pause_share_healthy"] = round(pause_share, 5)
        entry["families"] = family_rates
        if args.tune:
            entry["tuned_baselines"] = {name: {"held_out": {h: {k: v for k, v in row.items() if k in (
                "setting", "f1", "precision", "recall", "false_alarms_per_10k")} for h, row in t["held_out"].items()}}
                for name, t in entry_tuning.items()}
        if sized:
            entry["sizing"] = {"median_error": round(float(np.median(errors)), 4), "worst_error": round(max(errors), 4),
                               "gpus": len(sized)}
        if first:
            entry["first_size"] = {"median_error": round(float(np.median(first_errors)), 4),
                                   "p95_error": round(float(np.percentile(first_errors, 95)), 4),
                                   "within_5_percent": round(float(np.mean(np.array(first_errors) <= 0.05)), 4),
                                   "faults": len(first)}
        out[dialect] = entry
    calibrated = calibration_report(labelled, getattr(args, "fit_calibration", False))
    for dialect, table in calibrated["per_dialect"].items():
        out[dialect]["reliability"] = table
    out["calibration"] = {k: v for k, v in calibrated.items() if k != "per_dialect"}
    print(f"\n{len(cases)} scenarios x {len(dialects)} dialect(s) in {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps(out))
    return 0
