"""When time lost outside the traced ranks counts (analytics/detection/untraced.py ``HiddenExcess``): a run of
late traced iterations opens an incident on its own only when the job's own healthy swing makes
such a run too unlikely; otherwise the excess must hold for ``UNTRACED_SUSTAIN`` traced iterations."""

from __future__ import annotations

import math

import numpy as np

from analytics.detection.untraced import UNTRACED_SUSTAIN, HiddenExcess
from bench import detect
from resihp.referee import detecting

RATE, H, FLOOR = 1e-5, math.log(1.06), 0.004


def swinging(seed: int = 0, n: int = 32) -> HiddenExcess:
    """A healthy job's excess as sampled tracing sees it: near zero most iterations, and now and
    then up to +0.25 when an untraced replica drew the heavier mix."""
    rng = np.random.default_rng(seed)
    hidden = HiddenExcess(window=8)
    for _ in range(n):
        e = float(rng.exponential(0.05)) if rng.random() < 0.4 else float(abs(rng.normal(0, 0.002)))
        hidden.add(e, 0, FLOOR)
        hidden.learn(e)
    return hidden


def test_two_traced_iterations_far_beyond_the_swing_are_a_run() -> None:
    hidden = swinging()
    for e in (0.45, 0.50):
        hidden.add(e, 0, FLOOR)
    assert hidden.unlikely_run(H, RATE, FLOOR) == 2
    assert abs(hidden.size_of(2) - 0.475) < 1e-9  # sized on the run, not on the iteration before it


def test_a_single_late_iteration_is_never_a_run() -> None:
    hidden = swinging()
    hidden.add(0.01, 0, FLOOR)
    hidden.add(5.0, 0, FLOOR)  # ×150 once: an untraced replica's stall, or the heaviest mix ever drawn
    assert hidden.unlikely_run(H, RATE, FLOOR) is None


def test_a_run_within_the_jobs_own_swing_waits_for_persistence() -> None:
    hidden = swinging()
    late = float(np.quantile(list(hidden.healthy), 0.9))  # as late as one healthy iteration in ten
    for _ in range(3):  # three in a row is not rare enough
        hidden.add(late, 0, FLOOR)
    assert hidden.unlikely_run(H, RATE, FLOOR) is None
    assert len(hidden.recent) == UNTRACED_SUSTAIN


def test_a_wider_swing_needs_a_later_run() -> None:
    """The same run counts in a quiet job and not in one whose untraced replicas swing widely:
    the tail is the job's own."""
    quiet, wide = HiddenExcess(window=8), HiddenExcess(window=8)
    rng = np.random.default_rng(1)
    for _ in range(32):
        e = float(rng.exponential(1.0))
        quiet.learn(0.02 * e)
        wide.learn(0.15 * e)
    for hidden in (quiet, wide):
        hidden.add(0.3, 0, FLOOR)
        hidden.add(0.3, 0, FLOOR)
    assert quiet.unlikely_run(H, RATE, FLOOR) == 2
    assert wide.unlikely_run(H, RATE, FLOOR) is None


def test_without_enough_healthy_history_no_tail_is_fitted() -> None:
    hidden = HiddenExcess(window=8)
    for e in (0.0, 0.01, 0.0):
        hidden.learn(e)
    hidden.add(0.9, 0, FLOOR)
    hidden.add(0.9, 0, FLOOR)
    assert hidden.unlikely_run(H, RATE, FLOOR) is None


def test_an_excess_below_the_smallest_alarm_is_no_run_however_quiet_the_job() -> None:
    hidden = HiddenExcess(window=8)
    for _ in range(32):
        hidden.learn(0.0)  # no spread at all: the tail's λ is the σ floor
    hidden.add(0.04, 0, FLOOR)
    hidden.add(0.04, 0, FLOOR)  # ×1.04: under the ×1.06 no incident opens below
    assert hidden.unlikely_run(H, RATE, FLOOR) is None


def test_a_x5_gpu_nobody_traces_is_named_two_traced_iterations_after_its_first_whole_one() -> None:
    """Sampled: a ×5 GPU on replica 1, which nobody traces, from iteration 40 (partway through it:
    iteration 40 is only partly slow). Held for four traced iterations it opened at 48; its
    excess is far beyond anything the job's healthy swing makes likely twice in a row, so the
    run of iterations 42 and 44 names it."""
    case = detect.Case("x5 untraced", "fail_slow_compute_x2", iterations=80, faults=[
        {"kind": "slow_compute", "device": 9, "factor": 5.0, "at_iteration": 40, "duration_iterations": 30}])
    faults, incidents, iterations, _, config, *_ = detect.run_case(case, "sampled")
    (fault,) = faults
    hits = detecting(fault, incidents["ours"], gpus_per_node=config.cluster.gpus_per_node, iterations=iterations,
                     grace=5)
    assert hits and hits[0][0] - fault.start_iteration <= 4, hits


def _false_runs(draw, steps: int = 20_000, seed: int = 0) -> int:
    """Runs the default rate lets through on a healthy swing drawn by ``draw`` (one per traced step)."""
    from analytics.detection.config import DetectorConfig

    rate = DetectorConfig().untraced_run_rate
    rng = np.random.default_rng(seed)
    hidden, runs = HiddenExcess(window=8), 0
    for _ in range(steps):
        e = draw(rng)
        hidden.add(e, 0, FLOOR)
        if hidden.unlikely_run(H, rate, FLOOR):
            runs += 1
            hidden.recent.clear()
        else:
            hidden.learn(e)
    return runs


def test_a_heavy_tailed_healthy_swing_passes_almost_no_run() -> None:
    """The tail is fitted to a few dozen values, and a real job's swing need not be exponential.
    The chance of a run is read from the predictive tail (a Lomax: the exponential with its
    scale's uncertainty), which is heavier. Fitted as a plain exponential at a rate of 10⁻⁵,
    a Pareto(2.5) swing passed 8 runs in 20,000 healthy traced steps and the suite's kind of
    mixture 3."""
    def pareto(rng):
        return float(rng.pareto(2.5) * 0.05) if rng.random() < 0.45 else abs(float(rng.normal(0, 0.002)))

    def mixture(rng):
        return float(rng.exponential(0.05)) if rng.random() < 0.45 else abs(float(rng.normal(0, 0.002)))

    assert _false_runs(pareto) <= 2
    assert _false_runs(mixture) == 0


# ---- the sweep: a probe of the untraced ranks' compute now and then -----------------------------

def _answer(probe_id: str, rank: int, ratio: float):
    from collector.events import ProbeResult

    return ProbeResult(probe_id=probe_id, rank=rank, duration_s=ratio * 0.1, reference_s=0.1)


def test_a_sweep_is_asked_every_n_traced_iterations_and_one_at_a_time() -> None:
    from analytics.detection.untraced import UntracedSweep

    sweep = UntracedSweep()
    asked = [it for it in range(0, 40, 2) if sweep.step("job", 0, it, [8, 9], every=4) is not None]
    assert asked == [6]  # the 4th traced iteration; the next waits for this one's answers
    assert sweep.probe_id is not None
    assert sweep.claims(_answer(sweep.probe_id, 8, 1.0)) and sweep.done(set()) is None
    assert not sweep.claims(_answer("probe-other", 9, 1.0))
    assert sweep.claims(_answer(sweep.probe_id, 9, 1.2)) and sweep.done(set()) == {8: 1.0, 9: 1.2}
    # answered long after it was asked: the next is due at once
    assert [it for it in range(40, 60, 2) if sweep.step("job", 0, it, [8, 9], every=4) is not None][:1] == [40]


def test_a_sweep_whose_missing_answers_are_from_dead_ranks_ends() -> None:
    from analytics.detection.untraced import UntracedSweep

    sweep = UntracedSweep()
    for it in range(4):
        sweep.step("job", 0, it, [8, 9, 10], every=4)
    assert sweep.probe_id is not None
    sweep.claims(_answer(sweep.probe_id, 8, 1.0))
    assert sweep.done({9}) is None
    assert sweep.done({9, 10}) == {8: 1.0}
    assert sweep.step("job", 0, 5, [8], every=0) is None  # 0: never


def _sampled_run(case_name: str, **config):
    """A suite case in the sampled dialect through a detector with probes, answered by the simulator."""
    from analytics.detection.detector import Detector
    from analytics.detection.config import DetectorConfig
    from collector.events import IncidentConfirmed, IncidentOpened, IncidentResolved, ProbeRequest

    (case,) = [c for c in detect.suite(120) if c.name == case_name]
    engine, target = detect.case_engine(case, "sampled")
    det = Detector(engine.config.job, DetectorConfig(probes=True, **config))
    out, sweeps = [], 0
    while engine.iteration < target:
        for e in engine.step():
            new = det.on_event(e)
            while new:
                out += [p for p in new if isinstance(p, (IncidentOpened, IncidentConfirmed, IncidentResolved))]
                asked = [p for p in new if isinstance(p, ProbeRequest)]
                sweeps += sum(p.probe_id.startswith("sweep-") for p in asked)
                new = [q for p in asked for a in engine.probe(p) for q in det.on_event(a)]
    return out, sweeps


def test_a_x1_1_gpu_nobody_traces_is_found_by_a_sweep_and_resolved_by_a_later_probe() -> None:
    """Device 10 (replica 1, untraced) ×1.1 from iteration 40 to 80: the job's lateness is within
    the untraced replicas' swing, so only a probe of the untraced ranks finds it. Telemetry never
    sees the rank, so a probe, not persistence, also sees it healthy again."""
    from collector.events import IncidentOpened, IncidentResolved

    out, sweeps = _sampled_run("compute x1.1 (recovers)", excluded_probe_iterations=20)
    opened = [p for p in out if isinstance(p, IncidentOpened)]
    assert len(opened) == 1 and sweeps >= 3, (opened, sweeps)
    (inc,) = opened
    loc = inc.locations[0]
    assert loc.rank == 10 and 40 <= inc.iteration < 80 and abs(loc.factor / 1.1 - 1) < 0.03, inc
    assert "periodic probe" in inc.evidence.note, inc.evidence
    resolved = [p for p in out if isinstance(p, IncidentResolved) and p.incident_id == inc.incident_id]
    assert resolved and resolved[0].iteration >= 80 and "probed healthy" in resolved[0].reason, resolved


def test_sweeps_of_a_healthy_sampled_job_open_nothing_and_late_steps_add_few() -> None:
    """60 traced steps: 3 periodic sweeps, and one more for each step later than the healthy
    swing makes likely 1 time in 50 (2 in this run): a probe's pause is the price of each."""
    out, sweeps = _sampled_run("healthy long context")
    assert 3 <= sweeps <= 6 and out == [], (sweeps, out)


def test_without_sweeps_the_x1_1_gpu_nobody_traces_passes_unseen() -> None:
    out, sweeps = _sampled_run("compute x1.1 (recovers)", untraced_sweep_steps=0, untraced_suspicion_rate=0)
    assert sweeps == 0 and out == [], out


# ---- a late iteration brings the sweep forward ---------------------------------------------------

def test_the_chance_of_an_iteration_is_read_before_it_joins_the_healthy_ones() -> None:
    hidden = swinging()
    hidden.add(0.5, 41, FLOOR)  # far beyond a swing of exponential(0.05) spikes
    assert hidden.chance(41, H) < 1e-3
    assert hidden.chance(43, H) == 1.0  # no excess was taken at 43: nothing to say of it
    hidden.add(float(np.median(list(hidden.healthy))), 43, FLOOR)
    assert hidden.chance(43, H) == 1.0  # at the healthy median: as likely as can be
    assert HiddenExcess(window=8).chance(0, H) == 1.0  # no history: no tail, nothing is unlikely


def test_in_a_job_that_barely_swings_an_excess_no_incident_would_open_on_is_not_suspicious() -> None:
    hidden = HiddenExcess(window=8)
    for _ in range(32):
        hidden.learn(0.0)  # the tail's λ is the σ floor: +0.03 is far out in it
    hidden.add(0.03, 7, FLOOR)
    assert hidden.chance(7, 0.0) < 0.02 and hidden.chance(7, H) == 1.0  # but ×1.03 never opens one


def test_a_suspicious_iteration_asks_the_sweep_at_once_and_the_next_counts_from_it() -> None:
    from analytics.detection.untraced import UntracedSweep

    sweep = UntracedSweep()
    assert sweep.step("job", 0, 0, [8, 9], every=8) is None
    asked = sweep.step("job", 0, 2, [8, 9], every=8, suspicious=True)
    assert asked is not None and asked.ranks == [8, 9] and asked.target == "compute"
    assert sweep.step("job", 0, 4, [8, 9], every=8, suspicious=True) is None  # one at a time
    assert sweep.probe_id is not None
    sweep.claims(_answer(sweep.probe_id, 8, 1.0))
    sweep.claims(_answer(sweep.probe_id, 9, 1.0))
    assert sweep.done(set()) == {8: 1.0, 9: 1.0}
    periodic = [it for it in range(6, 40, 2) if sweep.step("job", 0, it, [8, 9], every=8) is not None]
    assert periodic[0] == 2 + 2 * 8, periodic  # 8 traced iterations after the suspicious one
    assert UntracedSweep().step("job", 0, 0, [8], every=0, suspicious=True) is not None  # even without periodic ones


def test_a_x2_gpu_nobody_traces_is_named_at_its_first_late_iteration_sized_by_its_probe() -> None:
    """Device 30 (replica 1, untraced) ×2 from iteration 40. Its first traced iteration is later
    than the job's swing makes likely (about 1 in 100): the sweep is asked then, its probe names
    the GPU and measures its compute (``Location.measure``), within 5 % of the truth. Left to
    the lateness it was named at 48, sized through the schedule."""
    from collector.events import IncidentOpened

    out, _ = _sampled_run("compute x2.0 (recovers)")
    opened = [p for p in out if isinstance(p, IncidentOpened)]
    assert opened, out
    loc = opened[0].locations[0]
    assert opened[0].iteration == 40 and loc.rank == 30 and loc.measure == "compute", opened[0]
    assert abs(loc.factor / 2.0 - 1) < 0.05, loc
    assert "iteration 40 was later than the job runs healthy" in opened[0].evidence.note, opened[0].evidence

    late, _ = _sampled_run("compute x2.0 (recovers)", untraced_suspicion_rate=0)
    first = [p for p in late if isinstance(p, IncidentOpened)][0]
    assert first.iteration > 42 and first.locations[0].measure == "chunks", first


def test_late_steps_of_healthy_swings_ask_a_probe_about_as_often_as_the_rate_says() -> None:
    """What the late-step sweeps cost: the share of healthy traced steps whose chance under the
    predictive tail is at most ``untraced_suspicion_rate`` (0.02). The tail is fitted to a few
    dozen values of a swing that need not be exponential; on the suite's kind of mixture and on a
    Pareto(2.5) one it asks on 3–4.5 % of steps, on a narrow normal one far fewer."""
    from analytics.detection.config import DetectorConfig

    rate = DetectorConfig().untraced_suspicion_rate
    swings = {
        "mixture": lambda r: float(r.exponential(0.05)) if r.random() < 0.45 else abs(float(r.normal(0, 0.002))),
        "pareto": lambda r: float(r.pareto(2.5) * 0.05) if r.random() < 0.45 else abs(float(r.normal(0, 0.002))),
        "normal": lambda r: float(r.normal(0, 0.05)),
    }
    shares = {}
    for name, draw in swings.items():
        rng, hidden, asked, steps = np.random.default_rng(0), HiddenExcess(window=8), 0, 5_000
        for i in range(steps):
            e = draw(rng)
            hidden.add(e, i, FLOOR)
            asked += hidden.chance(i, H) <= rate
            hidden.learn(e)
        shares[name] = asked / steps
    assert shares["mixture"] < 2.5 * rate and shares["pareto"] < 2.5 * rate, shares
    assert shares["normal"] < rate, shares
