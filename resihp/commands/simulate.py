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
    p.add_argument("--list", action="store_true", help="list the scenario library and exit")
    add_bus_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from collector.trace import TraceWriter
    from resihp.options import bus_from_args
    from trainer.sim.engine import SimEngine
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
