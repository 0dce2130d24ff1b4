"""Tokens trained under faults, per remediation strategy, relative to the oracle (closed loop).

For each scenario and strategy a fresh simulator (trainer.sim.SimEngine, noise on) runs a 7B job
(TP8·PP4·DP N/32, 1F1B). When a fault starts or ends the strategy learns of it after a detection
delay (fail-stop: at the second heartbeat the dead rank misses, 10–20 s with 10-s heartbeats;
fail-slow: 30 s — the order the detector needs), plans on the cluster it then knows, and its plan
is applied through ``SimEngine.reconfigure`` (the same epoch-fenced command the bus carries),
which pauses the job ``reshape_pause_s`` (20 s), or ``rebalance_pause_s`` (1 s) for a plan that
only moves micro-batches (the trainer keeps its groups for that). The oracle knows every fault at onset and
reshapes for free. Elastic restart also pays its restart and half a checkpoint interval of lost
work, as downtime in which faults still happen on time and live ranks keep their heartbeats
(``SimEngine.idle``); do-nothing hangs on a dead device.

This default ("direct") loop skips the bus and the analytics detector: strategies are given the
true fault factors after the delay, as a perfect detector would, which keeps 8,192 GPUs tractable
on a laptop and isolates the planners. With --loop bus each non-oracle run goes through the
platform instead (resihp.closed_loop): simulator → embedded bus → analytics detector (DuckDB,
probes, cost fits) → remediation engine under an auto-apply policy → command → simulator, and the
table below it gives each fault's measured detection delay. Both loops apply a plan only when it
gains the engine's ``min_gain_fraction`` over the horizon (the oracle: any gain).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from trainer.fault_spec import FaultKind
    from trainer.sim.engine import SimConfig

SCENARIOS = ("slow_x1.5", "slow_x2", "slow_x4", "slow_link_x4", "stop_gpu", "stop_node", "every_30min", "cascading")
STRATEGIES = ("oracle", "ours", "do_nothing", "drop_replica", "elastic_restart", "oobleck", "tp_only", "pp_only",
              "dp_only")
STOP_MISSED_HEARTBEATS = 2  # fail-stop is known at the second heartbeat a dead rank misses (≤ 20 s)
DETECT_SLOW_S = 30.0
RESHAPE_PAUSE_S = 20.0
REBALANCE_PAUSE_S = 1.0  # a plan that only moves micro-batches: the trainer keeps its groups (trainer.md)
HORIZON_S = 1800.0
SPREAD_ITERATIONS = 300  # healthy iterations the spread is calibrated on (~90 s; the first fault comes at 5 min)


class _Models:
    """Cost figures per (GPUs): built once, shared by every strategy of that size."""

    def __init__(self) -> None:
        self._exact: dict[int, object] = {}
        self._fitted: dict[int, object] = {}

    def exact(self, config):
        from resihp.planning_models import exact_model

        key = config.cluster.gpus
        if key not in self._exact:
            fitted = self.fitted(config)  # the oracle knows the spread as well as anyone
            self._exact[key] = exact_model(config.model, config.cluster, config.workload, fitted.makespan_cv,
                                           fitted.makespan_sd_s, fitted.microbatch_cv, fitted.tail_s)
        return self._exact[key]

    def fitted(self, config):
        from resihp.planning_models import fitted_model

        key = config.cluster.gpus
        if key not in self._fitted:
            self._fitted[key] = fitted_model(config, spread_iterations=SPREAD_ITERATIONS)
        return self._fitted[key]


models = _Models()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", default="256", help="comma-separated cluster sizes, multiples of 32 (default 256)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ", ".join(SCENARIOS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset (oracle always runs)")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="simulated seconds per run (default 1800; every_30min 7200, a 2-hour run: it needs "
                        "one to show three failures)")
    parser.add_argument("--plot", default="docs/remediation_recover.png", help="PNG of throughput over time ('' for none)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="runs in parallel, one process each (default 1); every run is seeded on its own, "
                        "so the figures do not depend on N. The bus loop takes ~10 min per 30-minute run on a core")
    parser.add_argument("--loop", choices=("direct", "bus"), default="direct",
                        help="direct: strategies learn each fault after a fixed detection delay and command the "
                        "simulator in-process (fast); bus: the whole loop, simulator → embedded bus → analytics "
                        "detector → remediation engine → simulator (minutes per run; the oracle stays direct)")


@dataclass
class Run:
    tokens: int = 0
    series: list[tuple[float, float]] = field(default_factory=list)  # (time_s, tokens/s)
    training_at_end: bool = False
    detections: list = field(default_factory=list)  # bus loop: resihp.closed_loop.Detection per fault
    false_incidents: int = 0
    plans_applied: int = 0  # bus loop: commands applied, roll-backs included
    rolled_back: int = 0  # bus loop: applied plans whose verification failed
    telemetry_lost: int = 0  # bus loop: telemetry the bus's retention deleted before analytics read it
    bus_bytes: int = 0  # bus loop: the embedded log on disk at the end
    wall_s: float = 0.0  # bus loop: wall seconds the loop took (the platform's cost, set-up aside)


def _faults(name: str, gpus: int, duration_s: float):
    from trainer.fault_spec import FaultSpec

    at = duration_s / 6
    d = 32 + 16 + 3  # replica 1, stage 2, TP rank 3
    if name.startswith("slow_x"):
        return [FaultSpec(kind="slow_compute", device=d, factor=float(name[6:]), at_s=at)]
    if name == "slow_link_x4":
        return [FaultSpec(kind="slow_link", link=(d, d + 8), factor=4.0, at_s=at)]
    if name == "stop_gpu":
        return [FaultSpec(kind="stop_device", device=d, at_s=at)]
    if name == "stop_node":
        return [FaultSpec(kind="stop_node", node=d // 8, at_s=at)]
    if name == "cascading":
        return [FaultSpec(kind="slow_compute", device=d, factor=1.5, at_s=at),
                FaultSpec(kind="slow_compute", device=d + 1, factor=2.0, at_s=at + 120),
                FaultSpec(kind="stop_device", device=d, at_s=at + 240),
                FaultSpec(kind="stop_node", node=(d + 64) // 8, at_s=at + 360)]
    if name == "every_30min":
        kinds: list[FaultKind] = ["slow_compute", "stop_device", "slow_compute", "stop_node"]
        out = []
        for i, t in enumerate(range(1800, int(duration_s), 1800)):
            dev = (97 * (i + 1) + 13) % gpus
            k = kinds[i % len(kinds)]
            if k == "stop_node":
                out.append(FaultSpec(kind=k, node=dev // 8, at_s=float(t)))
            elif k == "stop_device":
                out.append(FaultSpec(kind=k, device=dev, at_s=float(t)))
            else:
                out.append(FaultSpec(kind=k, device=dev, factor=2.0 + i % 3, at_s=float(t), duration_s=900.0))
        return out
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def _job(name: str, strategy_name: str, gpus: int, telemetry: Literal["all", "none"] = "none") -> SimConfig:
    """The simulated job of every run: 7B, TP8·PP4·DP gpus/32, 8 micro-batches per replica."""
    from collector.plan import Plan
    from trainer.sim.engine import SimConfig
    from trainer.sim.presets import MODEL_PRESETS, ClusterSpec
    from trainer.sim.workload import WORKLOAD_PRESETS

    sim_model = MODEL_PRESETS["7b"]
    plan = Plan.uniform(tp=8, pp=4, dp=gpus // 32, num_layers=sim_model.layers, microbatches_per_replica=8)
    free = strategy_name == "oracle"
    return SimConfig(model=sim_model, cluster=ClusterSpec(gpus=gpus), workload=WORKLOAD_PRESETS["pretrain"], plan=plan,
                     telemetry=telemetry, job=f"{name}-{strategy_name}", seed=11,
                     reshape_pause_s=0.0 if free else RESHAPE_PAUSE_S,
                     rebalance_pause_s=0.0 if free else REBALANCE_PAUSE_S)


def _run_bused(name: str, strategy_name: str, gpus: int, duration_s: float, progress: bool = False) -> Run:
    """One run with the platform in the loop (resihp.closed_loop): the detector decides what is known.
    ``progress`` draws the run's own bar in simulated seconds (one process only: workers stay quiet)."""
    from tqdm import tqdm

    from remediation.baselines import ElasticRestart
    from remediation.candidates import PlannerOptions
    from resihp.closed_loop import run_closed_loop
    from resihp.planning_models import hardware_of
    from trainer.sim.engine import SimEngine

    config = _job(name, strategy_name, gpus, telemetry="all")
    engine = SimEngine(config, _faults(name, gpus, duration_s))
    options = PlannerOptions(horizon_s=HORIZON_S, pause_s=config.reshape_pause_s,
                             rebalance_pause_s=config.rebalance_pause_s)
    restart = ElasticRestart(models.fitted(config))

    def pay_restart(sim) -> list:
        return sim.idle(restart.restart_s + restart.checkpoint_interval_s / 2)

    bar = tqdm(total=round(duration_s), desc=f"{name}@{gpus} {strategy_name}", unit="sim s", leave=False,
               disable=not progress)

    def advance(now_s: float) -> None:
        bar.update(round(now_s) - bar.n)

    started = time.perf_counter()
    with bar:
        loop = run_closed_loop(engine, models.fitted(config), strategy=strategy_name, duration_s=duration_s,
                               options=options, hardware=hardware_of(config.cluster),
                               on_applied=pay_restart if strategy_name == "elastic_restart" else None,
                               on_progress=advance)
    return Run(tokens=loop.tokens, series=loop.series, training_at_end=loop.training_at_end,
               detections=loop.detections, false_incidents=loop.false_incidents,
               plans_applied=loop.plans_applied, rolled_back=loop.rolled_back,
               telemetry_lost=loop.telemetry_lost, bus_bytes=loop.bus_bytes, wall_s=time.perf_counter() - started)


def _detected(fault, now_s: float, heartbeat_s: float) -> bool:
    """Whether a perfect detector knows ``fault`` at ``now_s``: a fail-stop once the dead rank has
    missed two heartbeats (heartbeats go out every ``heartbeat_s`` on the job's clock, so that is
    10–20 s after the onset), a fail-slow ``DETECT_SLOW_S`` after it."""
    if fault.spec.kind.startswith("stop"):
        return int(now_s // heartbeat_s) - int(fault.start_s // heartbeat_s) >= STOP_MISSED_HEARTBEATS
    return now_s - fault.start_s >= DETECT_SLOW_S


def _run_one(name: str, strategy_name: str, gpus: int, duration_s: float) -> Run:
    from collector.events import IterationSummary, ReconfigureCommand
    from collector.plan import Plan
    from resihp.planning_models import hardware_of
    from remediation.baselines import ElasticRestart, PlannerStrategy, make_strategy
    from remediation.cluster import ClusterState, DeviceState
    from remediation.engine import EngineConfig
    from remediation.horizon import HorizonEstimator
    from remediation.plan_result import PlanRefused
    from resihp.closed_loop import ThroughputSeries
    from trainer.sim.engine import SimEngine
    from trainer.sim.faults import devices_of

    oracle = strategy_name == "oracle"
    config = _job(name, strategy_name, gpus)
    cluster_spec = config.cluster
    engine = SimEngine(config, _faults(name, gpus, duration_s))
    # The oracle scores with the simulator's own cost figures; everyone else with the figures the
    # analytics cost model fits on the job's telemetry (the production path).
    model = models.exact(config) if oracle else models.fitted(config)
    hardware = hardware_of(cluster_spec)
    strategy = make_strategy(strategy_name, model, horizon_s=HORIZON_S)
    if isinstance(strategy, PlannerStrategy):
        # The planner weighs the pauses the simulated job pays: a reshape's, or a micro-batch-only
        # rebalance's (the trainer keeps its groups for that one).
        strategy = PlannerStrategy(model, strategy.name, replace(
            strategy.options, pause_s=config.reshape_pause_s, rebalance_pause_s=config.rebalance_pause_s,
            free_reshape=oracle))
    horizon = HorizonEstimator(default_s=HORIZON_S)
    run = Run()
    series = ThroughputSeries()
    known_faults: tuple = ()
    planned_key = (known_faults, horizon.band())
    commands = 0
    while engine.now_s < duration_s and not engine.finished:
        # What the strategy knows now: the faults a perfect detector has found by now.
        known = [f for f in engine.active if oracle or _detected(f, engine.now_s, config.heartbeat_interval_s)]
        version = tuple(sorted(f.fault_id for f in known))
        if version != known_faults:
            known_faults = version
            horizon.change(engine.now_s)
        # Plan when the known faults change, and when a calm doubles the horizon (as the engine does).
        if (version, horizon.band(engine.now_s)) != planned_key:
            planned_key = (version, horizon.band(engine.now_s))
            if isinstance(strategy, PlannerStrategy) and not oracle:
                strategy = PlannerStrategy(model, strategy.name,
                                           replace(strategy.options, horizon_s=horizon.horizon_s(engine.now_s)))
            cluster = ClusterState(gpus, hardware)
            for f in known:
                s = f.spec
                if s.kind == "slow_link" and s.link is not None:
                    cluster = cluster.with_link(s.link[0], s.link[1], s.factor)
                    continue
                state = (DeviceState(dead=True) if s.kind in ("stop_node", "stop_device") else
                         DeviceState(compute_factor=s.factor) if s.kind == "slow_compute" else
                         DeviceState(link_factor=s.factor))  # slow_nic
                for dev in devices_of(s, cluster_spec):
                    cluster = cluster.with_device(dev, state)
            try:
                result = strategy.plan(cluster, engine.plan)
            except PlanRefused:
                result = None
            horizon_s = getattr(strategy, "options", None)
            horizon_s = horizon_s.horizon_s if horizon_s is not None else HORIZON_S
            min_gain = 0.0 if oracle else EngineConfig.min_gain_fraction
            chosen = result.to_apply(horizon_s, min_gain) if result is not None else None
            if chosen is not None:
                commands += 1
                new = chosen.plan.model_copy(update={"epoch": engine.plan.epoch + 1})
                cmd = ReconfigureCommand(command_id=f"c{commands}", plan_id=f"p{commands}",
                                         plan=Plan.model_validate(new.model_dump()))
                engine.reconfigure(cmd)
                if isinstance(strategy, ElasticRestart):
                    series.close(engine.now_s)
                    engine.idle(strategy.restart_s + strategy.checkpoint_interval_s / 2)
                    series.close(engine.now_s)
        before = engine.now_s
        for e in engine.step():
            if isinstance(e.payload, IterationSummary) and engine.now_s <= duration_s:
                run.tokens += e.payload.tokens
                series.add(e.payload.tokens)
        series.tick(engine.now_s)
        run.training_at_end = engine.now_s > before and engine.hanging_for_s == 0.0
    run.series = series.points
    return run


def _call(job: tuple[int, str, str], loop: str, duration_s: float | None):
    """The function and arguments of one (GPUs, scenario, strategy) run; ``duration_s`` None is the
    scenario's own length (2 h for every_30min, 30 min for the others)."""
    g, s, st = job
    duration = duration_s if duration_s is not None else (7200.0 if s == "every_30min" else 1800.0)
    bused = loop == "bus" and st != "oracle"
    return (_run_bused if bused else _run_one), (s, st, g, duration)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    sizes = [int(x) for x in args.gpus.split(",") if x]
    scenarios = [s for s in args.scenarios.split(",") if s]
    strategies = ["oracle"] + [s for s in args.strategies.split(",") if s and s != "oracle"]
    results: dict[str, dict[str, float]] = {}
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    alive: dict[str, str] = {}
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    jobs = [(g, s, st) for g in sizes for s in scenarios for st in strategies]
    runs: dict[tuple[int, str, str], Run] = {}
    calls = {job: _call(job, args.loop, args.duration_s) for job in jobs}
    if args.jobs == 1:
        for job in tqdm(jobs, desc="recover", unit="run"):
            fn, fn_args = calls[job]
            runs[job] = _run_bused(*fn_args, progress=True) if fn is _run_bused else fn(*fn_args)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        from collector.gc_policy import tune_for_streaming

        # spawn: each worker starts clean (no inherited SQLite or DuckDB handles, no threads); it does
        # not go through the command line's main, so it takes the streaming GC setting here
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=tune_for_streaming) as pool:
            futures = {pool.submit(fn, *fn_args): job for job, (fn, fn_args) in calls.items()}
            for future in tqdm(as_completed(futures), total=len(futures), desc="recover", unit="run"):
                runs[futures[future]] = future.result()
    for g in sizes:
        for s in scenarios:
            key = f"{s}@{g}"
            oracle = runs[(g, s, "oracle")].tokens
            results[key] = {st: runs[(g, s, st)].tokens / oracle for st in strategies}
            series[key] = {st: runs[(g, s, st)].series for st in strategies}
            alive[key] = str(runs[(g, s, "ours")].training_at_end) if "ours" in strategies else "— (not run)"
    cols = strategies
    print(f"{'scenario':<22}" + "".join(f"{c:>16}" for c in cols) + "  ours training at end")
    for key, row in results.items():
        print(f"{key:<22}" + "".join(f"{row[c]:>16.3f}" for c in cols) + f"  {alive[key]}")
    if args.loop == "bus":
        _print_detections(runs)
    if args.plot:
        _plot(series, args.plot, {f"{s}@{g}": calls[(g, s, "oracle")][1][3] for g in sizes for s in scenarios})
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"scenarios": {k: {c: round(v, 4) for c, v in row.items()} for k, row in results.items()}}))
    return 0


def _print_detections(runs: dict[tuple[int, str, str], Run]) -> None:
    """Per bused run: how long each injected fault took to be named, and incidents matching none."""
    print(f"\n{'run':<34}{'fault delays s (onset → first incident naming its devices)':<64}false incidents"
          "  applied  rolled back  bus MB  telemetry lost  wall s")
    for (g, s, st), r in runs.items():
        if st == "oracle":
            continue
        delays = ", ".join(f"{d.category} {d.delay_s:.0f}" if d.delay_s is not None else f"{d.category} missed"
                           for d in sorted(r.detections, key=lambda d: d.onset_s))
        print(f"{f'{s}@{g} {st}':<34}{delays or '—':<64}{r.false_incidents:>15}{r.plans_applied:>9}"
              f"{r.rolled_back:>13}{r.bus_bytes / 1e6:>8.0f}"
              f"{r.telemetry_lost:>16}{r.wall_s:>8.0f}")


def _plot(series: dict[str, dict[str, list[tuple[float, float]]]], path: str, durations_s: dict[str, float]) -> None:
    """Throughput over time per scenario, each strategy's windows drawn as steps (a point is the
    rate over the window that ends there), up to the scenario's length (``durations_s``): a
    restart's downtime can run past it, and nothing after it counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(series)
    cols = 2
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for strategy, pts in series[key].items():
            if pts:
                pts = [(0.0, pts[0][1])] + pts  # the first window starts at 0
                ax.plot([t / 60 for t, _ in pts], [v / 1e3 for _, v in pts], label=strategy, drawstyle="steps-pre",
                        linewidth=2.2 if strategy in ("ours", "oracle") else 1.0)
        ax.set_xlim(0, durations_s[key] / 60)
        ax.set_title(key)
        ax.set_xlabel("minutes")
        ax.set_ylabel("k tokens/s")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
