"""The demo's simulator process: ``resihp simulate --closed-loop``, with its clock on the wall clock.

Why not ``resihp simulate`` itself: the simulator's clock starts at 1,700,000,000 s (reproducible
traces), while the analytics, remediation and console events carry wall-clock times. In one log
that would put the workload's events years before the reactions to them, and a replay (which paces
by ``time_s``) would stall. Here the simulated clock starts now and runs at ``--speed`` (1: real
time), so every event of the demo's log is on one time line. Everything else is the stock
``SimulatorRunner``: telemetry and truth out, commands and probes in, fenced and acknowledged.

Run as ``python -m resihp.demo.sim_workload SCENARIO --speed 1 [bus flags]``; prints one JSON line
per second to stdout (iteration, epoch, hanging) for whoever watches it, and a last line with the
totals. A job that hangs on a dead rank for longer than ``--max-hang-s`` simulated seconds stops
(exit 3): nobody reshaped it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from resihp.options import add_bus_flags, bus_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resihp.demo.sim_workload", description=__doc__)
    p.add_argument("scenario")
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    p.add_argument("--max-hang-s", type=float, default=120.0,
                   help="give up after hanging this long (simulated s) on a dead rank (default 120)")
    add_bus_flags(p)
    args = p.parse_args(argv)

    from trainer.sim.engine import SimEngine
    from trainer.sim.runner import SimulatorRunner
    from trainer.sim.scenario import load_scenario

    sc = load_scenario(args.scenario)
    engine = SimEngine(sc.sim_config(start_time_s=time.time()), sc.all_faults())
    gave_up = False
    last_report = 0.0

    def stop() -> bool:
        nonlocal gave_up, last_report
        now = time.monotonic()
        if now - last_report >= 1.0:
            last_report = now
            print(json.dumps({"iteration": engine.iteration, "epoch": engine.plan.epoch,
                              "hanging_s": round(engine.hanging_for_s, 1)}), flush=True)
        gave_up = engine.hanging_for_s > args.max_hang_s
        return gave_up

    with bus_from_args(args) as bus:
        runner = SimulatorRunner(bus, engine, speed=args.speed)
        try:
            _join_control(runner)
            runner.run(iterations=sc.iterations, duration_s=sc.duration_s, stop=stop)
        finally:
            runner.close()
    print(json.dumps({"done": True, "iteration": engine.iteration, "epoch": engine.plan.epoch,
                      "faults": len(engine.history), "gave_up": gave_up}), flush=True)
    if gave_up:
        print(f"the job hung on dead device(s) {sorted(engine.dead)} for {engine.hanging_for_s:.0f} simulated s and "
              "nobody reshaped it; see the remediate log", file=sys.stderr)
        return 3
    return 0


def _join_control(runner, limit_s: float = 60.0) -> None:
    """Join the control topic's consumer group before the first iteration.

    The runner polls the control topic with a zero timeout between iterations; on Kafka a consumer
    that only ever polls with a zero timeout never completes its group join (kafka-python needs a
    blocking poll for the join's round trips), so commands would never arrive. Polling with a
    timeout until partitions are assigned fixes that; the runner still starts at the topic's end.
    """
    deadline = time.monotonic() + limit_s
    while not runner.stream.consumer.positions():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the simulator could not join the control topic's group in {limit_s:.0f} s; "
                               "is the bus reachable?")
        runner.handle_control(timeout_s=0.5)


if __name__ == "__main__":
    sys.exit(main())
