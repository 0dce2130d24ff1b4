"""Live reshape on 8 CPU ranks: the pause of each kind of reshape, and tokens/s healthy, with one
rank slowed ×2, and after remediation — on the reference executor, and the same changes on the
PyTorch-native one (``--executor native|reference|both``, side by side by default).

The native run (trainer/native/) starts at the same TP1·PP2·DP4, paced (``--native-pace``: slower
emulated devices, since its raw CPU per chunk is several times the reference's), with the same
×2 slow rank 3; its remediation is the one a DeviceMesh can express — replica 1 hands micro-batches
to the others (5/2/5/4) on the same stages — and the share of the throughput won back is measured
as the reference's. Then it is given the reference's plans in the same order as scheduled
reshapes, three iterations apart; it refuses the ones a DeviceMesh cannot express (interleaved,
zero-bubble) before anything stops, and reports each applied reshape's phases.

A third launch measures TP exclusion on the native executor (``run_native_exclusion``): 8 CPU
ranks at TP4·PP1·DP2 (a 2-layer, 12-head model, so TP 3 gives whole heads), paced; device 1
(replica 0's TP group) computes at half speed from iteration 6 to the end; first the micro-batch-only remedy
(replica 0 runs 5 of the 16 micro-batches), then the exclusion (replica 0 re-formed at TP3 on
devices 0, 2, 3 beside replica 1's TP4, micro-batches back to 8/8, device 1 released), then the
exclusion with the micro-batches rebalanced to the TP3 replica's speed (7/9), as the planner's
joint search would propose. It prints
the exclusion's pause and phases, the first step against a steady one, and the share of the slow
GPU's throughput loss each remedy wins back; with ``--executor both`` the exclusion's pause is set
beside the reference trainer's TP change from the same run.

One launch of the real trainer (gloo, local processes), driven from here through the bus:
iterations run healthy on TP1·PP2·DP4; then rank 3 (replica 1, stage 1) computes at half speed;
a remediation command gives its stage fewer layers and its replica fewer micro-batches; the slow
fault ends; then one command per kind of reshape (micro-batches only — the ranks keep their
groups —, TP, PP, the schedule — the PP
layout switched to interleaved 1F1B with 2 chunks per stage, then to zero-bubble — and DP) is
published, each after a few iterations on the previous plan, and finally a rank is killed and the
launcher's drop-replica policy reshapes around it from live state. Tokens/s is the median of the
per-iteration rate within each phase (first iteration after a change skipped); the three
schedules are also compared on the same TP1·PP4·DP2 layout. Pauses are what the acknowledgements
state (largest per-rank pause; for fail-stop it includes survivors noticing the death at the
collective timeout).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

KINDS = ("remediate", "microbatches", "tp", "pp", "interleaved", "zero_bubble", "dp", "fail_stop")
SEQUENCE = ("microbatches", "tp", "pp", "interleaved", "zero_bubble", "dp")  # sent one by one after the slow phase
ITERATIONS_PER_KIND = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--executor", choices=["reference", "native", "both"], default="both",
                        help="which executor runs the changes: ours, the PyTorch-native one, or both side by side")
    parser.add_argument("--slow-factor", type=float, default=2.0)
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="collective timeout (fail-stop detection)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--pace", type=float, default=5e-5, help=(
        "emulated device seconds per layer-token (0: raw CPU speed; on a 2-core machine 8 ranks then "
        "share the cores and a sleeping slow rank frees CPU for the others)"))
    parser.add_argument("--exclusion-pace", type=float, default=2e-3, help=(
        "the TP-exclusion run's pace: its TP4 chunks carry DTensor's collectives on 8 ranks sharing the cores, so "
        "the emulated device time must stay above their CPU time for the slow GPU to show"))
    parser.add_argument("--exclusion-layers", type=int, default=2, help=(
        "the TP-exclusion run's layers: few, so its CPU time per chunk stays under the paced time"))
    parser.add_argument("--native-pace", type=float, default=2e-4, help=(
        "the native run's pace: its raw CPU per chunk (DTensor dispatch, FSDP and pipelining hooks) is several "
        "times the reference's, so at --pace a loaded 2-core machine's CPU time, not the emulated device, sets "
        "the chunk times and hides the slow rank"))


def _plans(layers: int):
    from collector.plan import PipelinePlan, Plan, StagePlan

    base = Plan.uniform(tp=1, pp=2, dp=4, num_layers=layers, microbatches_per_replica=4)
    half = layers // 2
    remediated = base.model_copy(update={"epoch": 1, "pipelines": tuple(
        p if p.replica != 1 else PipelinePlan(replica=1, microbatches=3, stages=(
            StagePlan(devices=(2,), first_layer=0, end_layer=half + 1),
            StagePlan(devices=(3,), first_layer=half + 1, end_layer=layers)))
        for p in base.pipelines)}).model_copy()
    counts = [5, 3, 4, 4]
    remediated = remediated.model_copy(update={"pipelines": tuple(
        p.model_copy(update={"microbatches": c}) for p, c in zip(remediated.pipelines, counts))})
    # The same stages, micro-batches back to 4/4/4/4: only counts change, so the ranks keep their groups.
    microbatches = remediated.model_copy(update={"epoch": 2, "pipelines": tuple(
        p.model_copy(update={"microbatches": 4}) for p in remediated.pipelines)})
    tp = Plan.uniform(tp=2, pp=2, dp=2, num_layers=layers, microbatches_per_replica=8, epoch=3)
    pp = Plan.uniform(tp=1, pp=4, dp=2, num_layers=layers, microbatches_per_replica=8, epoch=4)
    interleaved = Plan.uniform(tp=1, pp=4, dp=2, num_layers=layers, microbatches_per_replica=8, epoch=5,
                               schedule="interleaved", virtual_stages=2)
    zero_bubble = Plan.uniform(tp=1, pp=4, dp=2, num_layers=layers, microbatches_per_replica=8, epoch=6,
                               schedule="zero_bubble")
    dp = Plan.uniform(tp=2, pp=1, dp=4, num_layers=layers, microbatches_per_replica=4, epoch=7)
    return base, {"remediate": remediated, "microbatches": microbatches, "tp": tp, "pp": pp,
                  "interleaved": interleaved, "zero_bubble": zero_bubble, "dp": dp}


def run(args: argparse.Namespace) -> int:
    results = {}
    if args.executor in ("reference", "both"):
        results["reference"] = run_reference(args)
    if args.executor in ("native", "both"):
        results["native"] = run_native(args)
        results["native_tp_exclusion"] = run_native_exclusion(args)
    if args.executor == "both":
        ref, nat = results["reference"]["pause_s"], results["native"]["pause_s"]
        excl = results["native_tp_exclusion"]["pause_s"]
        print(f"{'side by side':<14} {'reference s':>12} {'native s':>9} {'ratio':>6}")
        rows = [(k, ref.get(k), nat.get(k)) for k in ("microbatches", "tp", "pp", "dp")]
        rows.append(("tp exclusion", ref.get("tp"), excl))  # against the reference trainer's TP change
        for k, r, n in rows:
            if r is not None and n is not None:
                print(f"{k:<14} {r:>12.3f} {n:>9.3f} {n / max(r, 1e-9):>6.1f}")
    if args.json:
        print(json.dumps(results))
    return 0


NATIVE_ORDER = ("remediate", "microbatches", "tp", "pp", "interleaved", "zero_bubble", "dp")


NATIVE_REMEDY_COUNTS = (5, 2, 5, 4)  # replica 1 holds the slow rank: it runs fewer of the 16 micro-batches


def _native_plans(layers: int, cfg):
    """The reference run's plans in its order, re-numbered for the native run (a plan the native
    executor refuses keeps the epoch, so the next one still is running + 1). The remediation is a
    DP micro-batch migration on the starting stages (the reference's gives the slow stage fewer
    layers in one replica only, which a DeviceMesh cannot express); the micro-batch-only change
    then moves the counts back to 4/4/4/4, as the reference's does."""
    from trainer.native.capabilities import refusal

    base, plans = _plans(layers)
    plans = dict(plans)
    plans["remediate"] = base.model_copy(update={"pipelines": tuple(
        p.model_copy(update={"microbatches": c}) for p, c in zip(base.pipelines, NATIVE_REMEDY_COUNTS))})
    plans["microbatches"] = base
    epoch, out = 0, []
    for kind in NATIVE_ORDER:
        plan = plans[kind].model_copy(update={"epoch": epoch + 1})
        reason = refusal(plan, cfg, epoch)
        if reason is None:
            epoch += 1
        out.append((kind, plan, reason))
    return base, out


def run_native(args: argparse.Namespace) -> dict:
    """The same fault and changes on the PyTorch-native executor: tokens/s healthy, with rank 3
    slowed, after its remediation; then the pause of each reshape and its phases."""
    from trainer.fault_spec import FaultSpec
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native, read_results

    cfg = LlamaConfig(vocab_size=256, dim=args.embd, n_layers=args.layers, n_heads=4, ffn_hidden=2 * args.embd)
    settings = TrainSettings(block_size=args.block)
    base, changes = _native_plans(args.layers, cfg)
    # healthy [0, slow_start) (the first iterations, lazy set-up and cold DTensor caches, are not
    # measured); rank 3 slow from slow_start; remediated at remedy_at; the fault ends when the next
    # change is applied, then one change every ITERATIONS_PER_KIND iterations.
    slow_start, remedy_at, per_phase = 8, 13, 5
    at = [remedy_at] + [remedy_at + per_phase + i * ITERATIONS_PER_KIND for i in range(len(changes) - 1)]
    reshapes = [ScheduledReshape(at_iteration=i, plan=p) for i, (_, p, _) in zip(at, changes)]
    iterations = at[-1] + ITERATIONS_PER_KIND
    tmp = Path(tempfile.mkdtemp(prefix="resihp-bench-native-"))
    slow = FaultSpec(kind="slow_compute", device=3, factor=args.slow_factor, at_iteration=slow_start,
                     duration_iterations=at[1] - slow_start)
    spec = NativeRunSpec(job="bench-reshape-native", model=asdict(cfg), settings=asdict(settings), plan=base,
                         reshapes=reshapes, iterations=iterations, out_dir=str(tmp), device="cpu",
                         faults=[slow], pace_s_per_layer_token=args.native_pace)
    started = time.perf_counter()
    codes = launch_native(spec)
    elapsed = time.perf_counter() - started
    ranks, _ = read_results(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    by_epoch: dict[int, list[dict]] = {}
    for r in ranks.values():
        for rep in r["reshapes"]:
            by_epoch.setdefault(rep["epoch"], []).append(rep)
    walls: dict[int, list[float]] = {}
    for r in ranks.values():
        for it, w in r.get("walls", {}).items():
            walls.setdefault(int(it), []).append(w)

    def rate(plan, iters) -> float | None:
        """Median tokens/s over ``iters`` (an iteration lasts as long as its slowest rank)."""
        steady = [max(walls[i]) for i in iters if i in walls]
        return plan.global_microbatches * args.block / statistics.median(steady) if steady else None

    print(f"bench reshape (native executor): 8 CPU ranks, {args.layers} layers × {args.embd} wide, "
          f"{args.block}-token micro-batches, pace {args.native_pace:g} s/layer-token, {elapsed:.1f} s total; "
          f"exit codes {codes}")
    print(f"{'reshape kind':<14} {'pause s':>9} {'tokens/s after':>15}  phases (s, slowest rank; pause excludes "
          "first_step) / refusal")
    pause_s, tokens_per_s = {}, {}
    for start, (kind, plan, reason) in zip(at, changes):
        if reason is not None:
            print(f"{kind:<14} {'refused':>9} {'':>15}  {reason[:90]}")
            continue
        reports = by_epoch.get(plan.epoch, [])
        if not reports:
            print(f"{kind:<14} {'—':>9}  (not applied)")
            continue
        phases = {p: max(rep["phases_s"].get(p, 0.0) for rep in reports) for p in reports[0]["phases_s"]}
        # The pause, as the reference executor's acknowledgement states it: the protocol, not the first step.
        pause_s[kind] = round(max(sum(v for p, v in rep["phases_s"].items() if p != "first_step")
                                  for rep in reports), 4)
        tokens_per_s[kind] = rate(plan, range(start + 1, start + ITERATIONS_PER_KIND))
        v = tokens_per_s[kind]
        print(f"{kind:<14} {pause_s[kind]:>9.3f} {v if v is None else round(v):>15}  "
              + " ".join(f"{p}={v:.3f}" for p, v in phases.items()))
    remedy = changes[0][1]
    windows = {"healthy": range(3, slow_start), "slow": range(slow_start + 1, remedy_at),
               "remediated": range(remedy_at + 1, at[1])}
    phase_rates = {phase: rate(remedy if phase == "remediated" else base, iters) for phase, iters in windows.items()}
    print(f"{'phase':<14} {'tokens/s':>9}  iterations")
    for phase, iters in windows.items():
        v = phase_rates[phase]
        print(f"{phase:<14} {v if v is None else round(v):>9}  {list(iters)}")
    healthy, slowed, remedied = phase_rates["healthy"], phase_rates["slow"], phase_rates["remediated"]
    won_back = (100 * (remedied - slowed) / (healthy - slowed)
                if healthy and slowed and remedied and healthy > slowed else None)
    if won_back is not None:
        print(f"remediation (micro-batches {'/'.join(map(str, NATIVE_REMEDY_COUNTS))}) won back {won_back:.0f}% "
              "of the throughput the slow rank cost")
    return {"pause_s": pause_s, "tokens_per_s": tokens_per_s, "phase_tokens_per_s": phase_rates,
            "won_back_percent": won_back}


EXCLUSION_REMEDY_COUNTS = (5, 11)  # the micro-batch-only remedy: replica 0 (its TP group holds the slow GPU) runs 5
EXCLUSION_REBALANCED_COUNTS = (7, 9)  # after the exclusion replica 0 runs at TP3, 4/3 as long per micro-batch


def run_native_exclusion(args: argparse.Namespace) -> dict:
    """TP exclusion on the native executor against its micro-batch-only remedy, one launch: the
    pause and phases of re-forming a TP group around a slow GPU, and the throughput each remedy
    wins back (module docstring)."""
    from collector.plan import PipelinePlan, Plan, StagePlan
    from trainer.fault_spec import FaultSpec
    from trainer.native.model import LlamaConfig
    from trainer.native.stage import TrainSettings
    from trainer.native.worker import NativeRunSpec, ScheduledReshape, launch_native, read_results

    layers = args.exclusion_layers
    cfg = LlamaConfig(vocab_size=256, dim=48, n_layers=layers, n_heads=12, ffn_hidden=96)
    settings = TrainSettings(block_size=args.block)

    def plan(epoch: int, groups: tuple[tuple[int, ...], ...], counts: tuple[int, ...]) -> Plan:
        return Plan(epoch=epoch, num_layers=layers, pipelines=tuple(
            PipelinePlan(replica=r, microbatches=n, stages=(StagePlan(devices=g, first_layer=0, end_layer=layers),))
            for r, (g, n) in enumerate(zip(groups, counts, strict=True))))

    tp4 = ((0, 1, 2, 3), (4, 5, 6, 7))
    base = plan(0, tp4, (8, 8))
    microbatches = plan(1, tp4, EXCLUSION_REMEDY_COUNTS)
    excluded = plan(2, ((0, 2, 3), (4, 5, 6, 7)), (8, 8))
    rebalanced = plan(3, ((0, 2, 3), (4, 5, 6, 7)), EXCLUSION_REBALANCED_COUNTS)
    slow_start, remedy_at, exclude_at, rebalance_at, per_phase = 6, 10, 14, 18, 4
    iterations = rebalance_at + per_phase
    tmp = Path(tempfile.mkdtemp(prefix="resihp-bench-native-exclusion-"))
    slow = FaultSpec(kind="slow_compute", device=1, factor=args.slow_factor, at_iteration=slow_start,
                     duration_iterations=iterations - slow_start)
    spec = NativeRunSpec(job="bench-reshape-native-exclusion", model=asdict(cfg), settings=asdict(settings),
                         plan=base, reshapes=[ScheduledReshape(at_iteration=remedy_at, plan=microbatches),
                                              ScheduledReshape(at_iteration=exclude_at, plan=excluded),
                                              ScheduledReshape(at_iteration=rebalance_at, plan=rebalanced)],
                         iterations=iterations, out_dir=str(tmp), device="cpu", faults=[slow],
                         pace_s_per_layer_token=args.exclusion_pace)
    started = time.perf_counter()
    codes = launch_native(spec)
    elapsed = time.perf_counter() - started
    ranks, _ = read_results(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    walls: dict[int, list[float]] = {}
    for r in ranks.values():
        for it, w in r.get("walls", {}).items():
            walls.setdefault(int(it), []).append(w)
    windows = {"healthy": (base, range(3, slow_start)), "slow": (base, range(slow_start + 1, remedy_at)),
               "micro-batches": (microbatches, range(remedy_at + 1, exclude_at)),
               "tp exclusion": (excluded, range(exclude_at + 1, rebalance_at)),
               "tp excl. + mbs": (rebalanced, range(rebalance_at + 1, iterations))}
    rates = {}
    for name, (p, iters) in windows.items():
        steady = [max(walls[i]) for i in iters if i in walls]
        rates[name] = p.global_microbatches * args.block / statistics.median(steady) if steady else None
    reports = [rep for r in ranks.values() for rep in r["reshapes"] if rep["epoch"] == excluded.epoch]
    print(f"bench reshape (native executor, TP exclusion): 8 CPU ranks TP4·PP1·DP2, {layers} layers × 48 wide, "
          f"12 heads, {args.block}-token micro-batches, pace {args.exclusion_pace:g} s/layer-token, device 1 "
          f"×{args.slow_factor:g} from iteration {slow_start}, {elapsed:.1f} s total; exit codes {codes}")
    out: dict = {"tokens_per_s": rates, "pause_s": None, "phases_s": {}, "won_back_percent": {}}
    if reports:
        phases = {p: max(rep["phases_s"].get(p, 0.0) for rep in reports) for p in reports[0]["phases_s"]}
        out["pause_s"] = round(max(sum(v for p, v in rep["phases_s"].items() if p != "first_step")
                                   for rep in reports), 4)
        out["phases_s"] = phases
        steady_s = statistics.median(max(walls[i]) for i in range(exclude_at + 1, rebalance_at) if i in walls)
        out["steady_step_s"] = steady_s
        print(f"TP exclusion (replica 0: TP4 → TP3 on devices 0, 2, 3) pause {out['pause_s']:.3f} s (slowest rank, "
              "first_step excluded): " + " ".join(f"{p}={v:.3f}" for p, v in phases.items())
              + f"; a steady step after it {steady_s:.3f} s")
    else:
        print("TP exclusion: not applied")
    print(f"{'phase':<14} {'tokens/s':>9}  iterations")
    for name, (_, iters) in windows.items():
        v = rates[name]
        print(f"{name:<14} {v if v is None else round(v):>9}  {list(iters)}")
    healthy, slowed = rates["healthy"], rates["slow"]
    labels = {"micro-batches": f"micro-batches only ({'/'.join(map(str, EXCLUSION_REMEDY_COUNTS))})",
              "tp exclusion": "TP exclusion (TP3 beside TP4, 8/8)",
              "tp excl. + mbs": f"TP exclusion with micro-batches {'/'.join(map(str, EXCLUSION_REBALANCED_COUNTS))}"}
    for name, what in labels.items():
        remedied = rates[name]
        if healthy and slowed and remedied and healthy > slowed:
            out["won_back_percent"][name] = round(100 * (remedied - slowed) / (healthy - slowed), 1)
            print(f"{what} won back {out['won_back_percent'][name]:.0f}% of the throughput the slow GPU cost")
    return out


def run_reference(args: argparse.Namespace) -> dict:
    from collector import topics
    from collector.auth import Signer
    from collector.embedded import EmbeddedBus
    from collector.epoch_fence import COMMAND_TTL_S
    from collector.events import CommandAck, EventFactory, IterationSummary, PlanCurrent, ReconfigureCommand
    from collector.stream import EventStream
    from trainer.fault_spec import FaultSpec
    from trainer.reference.launcher import launch
    from trainer.reference.model import GPTConfig
    from trainer.reference.spec import RunSpec
    from trainer.spec import BusSpec

    healthy_end, slow_start, slow_end = 8, 8, 24
    kill_at = slow_end + 2 + ITERATIONS_PER_KIND * len(SEQUENCE) + 4
    iterations = kill_at + 4
    cfg = GPTConfig(vocab_size=256, n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.block)
    base, plans = _plans(args.layers)
    tmp = Path(tempfile.mkdtemp(prefix="resihp-bench-reshape-"))
    bus_path = tmp / "bus.sqlite"
    spec = RunSpec(job="bench-reshape", model=asdict(cfg), iterations=iterations, pg_timeout_s=args.pg_timeout,
                   bus=BusSpec(backend="embedded", path=str(bus_path)), heartbeat_s=1.0,
                   pace_s_per_layer_token=args.pace,
                   faults=[FaultSpec(kind="slow_compute", device=3, factor=args.slow_factor, at_iteration=slow_start,
                                 duration_iterations=slow_end - slow_start),
                           FaultSpec(kind="stop_device", device=7, at_iteration=kill_at)])
    factory = Signer(EventFactory(spec.job, "bench"), "engine")  # it plays the engine: the trainer obeys signed commands
    summaries: dict[int, IterationSummary] = {}
    acks: list[CommandAck] = []
    done = threading.Event()

    def drive() -> None:
        """Publish the commands as the run reaches each phase (reading the bus like any consumer)."""
        with EmbeddedBus(bus_path) as bus, EventStream(bus, "bench", [topics.TELEMETRY, topics.CONTROL]) as stream:
            sent_remedy = False
            queue = list(SEQUENCE)
            waiting_for: str | None = None  # plan_id of the command sent last and not yet acked
            acked_at = -1
            run: str | None = None  # the run a command must name, from the trainer's plan.current

            def command(plan_id: str) -> ReconfigureCommand:
                return ReconfigureCommand(command_id=uuid.uuid4().hex, plan_id=plan_id, plan=plans[plan_id], run=run,
                                          expires_at_s=time.time() + COMMAND_TTL_S)

            while not done.is_set():
                for d in stream.poll(timeout_s=0.1):
                    p = d.event.payload
                    if isinstance(p, PlanCurrent) and run is None:
                        run = p.run
                    elif isinstance(p, IterationSummary):
                        summaries[p.iteration] = p
                    elif isinstance(p, CommandAck):
                        acks.append(p)
                        if p.plan_id == waiting_for:
                            waiting_for, acked_at = None, max(summaries, default=-1)
                top = max(summaries, default=-1)
                if not sent_remedy and top >= slow_start + 5:
                    bus.publish([factory.make(command("remediate"))])
                    sent_remedy = True
                # The rest one at a time, each once the previous one ran a few iterations.
                if (queue and waiting_for is None and top >= slow_end
                        and top >= acked_at + ITERATIONS_PER_KIND):
                    kind = queue.pop(0)
                    bus.publish([factory.make(command(kind))])
                    waiting_for = kind

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    started = time.perf_counter()
    result = launch(spec, base, 8, on_death="drop-replica")
    elapsed = time.perf_counter() - started
    time.sleep(0.5)
    done.set()
    driver.join(10)
    shutil.rmtree(tmp, ignore_errors=True)

    def rate(iters) -> float | None:
        rates = [summaries[i].tokens / summaries[i].wall_s for i in iters if i in summaries and summaries[i].wall_s > 0]
        return statistics.median(rates) if rates else None

    epoch_of = {i: s.epoch for i, s in summaries.items()}
    remedy_iters = [i for i in range(slow_start, slow_end) if epoch_of.get(i) == 1 and epoch_of.get(i - 1) == 1]
    slow_iters = [i for i in range(slow_start + 1, slow_end) if epoch_of.get(i) == 0]
    tokens_per_s = {"healthy": rate(range(3, healthy_end)), "slow": rate(slow_iters), "remediated": rate(remedy_iters)}
    healthy_wall = statistics.median(summaries[i].wall_s for i in range(3, healthy_end) if i in summaries)
    by_plan = {a.plan_id: a for a in acks if a.status.value == "applied"}
    kind_of = {k: k for k in plans} | {pid: "fail_stop" for pid in by_plan if pid.startswith("launcher-drop")}
    pause_s = {kind_of[pid]: round(a.pause_s, 4) for pid, a in by_plan.items() if pid in kind_of}

    print(f"bench reshape: 8 CPU ranks, {args.layers} layers × {args.embd} wide, {args.block}-token micro-batches, "
          f"pace {args.pace:g} s/layer-token, "
          f"{elapsed:.1f} s total; exit codes {result.exit_codes}")
    print(f"{'reshape kind':<14} {'pause s':>9} {'pause iters':>12}  plan after")
    for k in KINDS:
        a = next((by_plan[p] for p in by_plan if kind_of.get(p) == k), None)
        if a is None:
            print(f"{k:<14} {'—':>9} {'—':>12}  (not applied)")
            continue
        print(f"{k:<14} {a.pause_s:>9.3f} {a.pause_s / healthy_wall:>12.1f}  {a.detail[:70]}")
    print(f"{'phase':<14} {'tokens/s':>9}  iterations")
    for phase, iters in (("healthy", list(range(3, healthy_end))), ("slow", slow_iters), ("remediated", remedy_iters)):
        v = tokens_per_s[phase]
        print(f"{phase:<14} {v if v is None else round(v):>9}  {iters}")
    h, s, r = tokens_per_s["healthy"], tokens_per_s["slow"], tokens_per_s["remediated"]
    if h and s and r and h > s:
        print(f"remediation won back {100 * (r - s) / (h - s):.0f}% of the throughput the slow rank cost")
    schedule_tokens_per_s = {}
    print(f"{'schedule':<14} {'tokens/s':>9}  iterations (TP1·PP4·DP2, 8 micro-batches per replica)")
    for name, kind in (("1f1b", "pp"), ("interleaved", "interleaved"), ("zero_bubble", "zero_bubble")):
        e = plans[kind].epoch
        iters = sorted(i for i in epoch_of if epoch_of[i] == e and epoch_of.get(i - 1) == e)
        schedule_tokens_per_s[name] = rate(iters)
        v = schedule_tokens_per_s[name]
        print(f"{name:<14} {v if v is None else round(v):>9}  {iters}")
    return {"pause_s": pause_s, "tokens_per_s": tokens_per_s, "schedule_tokens_per_s": schedule_tokens_per_s}
