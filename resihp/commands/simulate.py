"""``resihp simulate SCENARIO --out TRACE``: run a scenario and record its full event log plus
ground truth as a Parquet trace (docs/traces.md); ``--bus`` also publishes it live."""

from __future__ import annotations

import argparse

from resihp.options import add_bus_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a scenario into a trace (and optionally onto the bus)",
                       description=__doc__)
    p.add_argument("scenario", nargs="?", help="scenario YAML file, or a name from scenarios/ (e.g. fail_slow_compute_x2)")
    p.add_argument("--out", default=None, help="trace to write: a .parquet file or a directory")
    p.add_argument("--iterations", type=int, default=None, help="override the scenario's iteration count")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--telemetry", choices=["all", "none"], default=None,
                   help="override which ranks emit telemetry (none: truth and summaries only)")
    p.add_argument("--publish", action="store_true", help="also publish the events to the bus (open loop)")
    p.add_argument("--closed-loop", action="store_true",
                   help="publish to the bus and obey reconfigure commands / probe requests from it")
    p.add_argument("--speed", type=float, default=None,
                   help="simulated seconds per wall second: with --publish or --closed-loop each iteration goes "
                        "out when the simulated clock reaches it, a live job's steady rate (default: as fast as "
                        "possible)")
    p.add_argument("--publishers", type=int, default=1,
                   help="with --publish (open loop, no --out): processes that publish the ranks' telemetry, each with "
                        "its own bus producer and a share of the DP replicas (default 1: this process); the job's "
                        "own events go out from this process (docs/simulator.md)")
    p.add_argument("--list", action="store_true", help="list the scenario library and exit")
    add_bus_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from collector.trace import TraceWriter
    from resihp.options import bus_from_args
    from trainer.sim.engine import SimEngine
    from trainer.sim.publishers import BusSpec, SplitPublisher, parent_wire, run_split_open_loop, whole_job_wire
    from trainer.sim.runner import Pacer, SimulatorRunner, run_open_loop
    from trainer.sim.scenario import load_scenario

    if args.list:
        lib = Path(__file__).resolve().parents[2] / "scenarios"
        for f in sorted(lib.glob("*.yaml")):
            sc = load_scenario(f)
            print(f"{f.stem:32s} {sc.description.splitlines()[0] if sc.description else ''}")
        return 0
    if not args.scenario:
        print("give a SCENARIO (see --list)")
        return 2
    sc = load_scenario(args.scenario)
    overrides = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.telemetry is not None:
        overrides["telemetry"] = args.telemetry
    engine = SimEngine(sc.sim_config(**overrides), sc.all_faults())
    iterations = args.iterations or sc.iterations
    if args.out is None and not (args.publish or args.closed_loop):
        print("nothing to do: give --out TRACE and/or --publish / --closed-loop")
        return 2
    if args.publishers < 1:
        print(f"--publishers must be at least 1, not {args.publishers}")
        return 2
    if args.publishers > 1 and (args.out or args.closed_loop or not args.publish):
        print("--publishers N needs --publish, open loop, without --out: the publishers cannot follow a closed loop's "
              "commands, and a trace is written from events in one process")
        return 2
    writer = TraceWriter(args.out) if args.out else None
    bus = bus_from_args(args) if (args.publish or args.closed_loop) else None
    bar = tqdm(total=iterations, unit="it", desc=sc.name, disable=None)
    pacer: Pacer | None = None
    try:
        if args.closed_loop:
            assert bus is not None
            runner = SimulatorRunner(bus, engine, speed=args.speed, record=writer.write if writer else None)
            pacer = runner.pacer
            try:
                last = engine.iteration

                def stop() -> bool:
                    nonlocal last
                    bar.update(engine.iteration - last)
                    last = engine.iteration
                    return False

                runner.run(iterations=iterations, duration_s=sc.duration_s, stop=stop)
            finally:
                runner.close()
            count = None
        elif bus is not None and writer is None:  # the ranks' records written straight from the timings
            pacer = Pacer(engine, args.speed) if args.speed else None
            if args.publishers == 1:
                engine.rank_wire = whole_job_wire(engine)
                count = run_split_open_loop(engine, bus, None, iterations=iterations, duration_s=sc.duration_s,
                                            progress=bar.update, pacer=pacer)
            else:
                engine.rank_wire = parent_wire(engine)
                spec = BusSpec(args.bus, args.bus_path, args.bootstrap)
                with SplitPublisher(engine.config, sc.all_faults(), spec, args.publishers) as publishers:
                    count = run_split_open_loop(engine, bus, publishers, iterations=iterations,
                                                duration_s=sc.duration_s, progress=bar.update, pacer=pacer)
        else:
            def sink(events: list) -> None:
                if writer:
                    writer.write(events)
                if bus:
                    bus.publish(events)

            pacer = Pacer(engine, args.speed) if args.speed and bus else None
            count = run_open_loop(engine, sink, iterations=iterations, duration_s=sc.duration_s, progress=bar.update,
                                  pacer=pacer)
    finally:
        bar.close()
        if writer:
            writer.close()
        if bus:
            bus.close()
    faults = len(engine.history)
    print(f"{sc.name}: {engine.iteration} iterations, {engine.now_s:,.1f} simulated s, epoch {engine.plan.epoch}, "
          f"{faults} fault(s) injected" + (f", {count:,} events" if count is not None else "")
          + (f" -> {writer.path}" if writer else "")
          + (f"; paced at ×{pacer.speed:g}, at worst {pacer.behind_s:.2f} s behind" if pacer is not None else ""))
    return 0
