"""``resihp remediate``: run the remediation engine for one job over the bus.

It folds incidents and the plan lifecycle from the log, plans when the faults change (the joint
TP/PP/DP planner, or a baseline with --strategy), publishes proposals, applies decisions by
publishing reconfiguration commands fenced by epoch, and verifies each applied plan against
measured throughput. The layout running at start is given by --plan FILE (a collector.plan.Plan
as JSON) or by --tp/--pp/--dp/--microbatches (the uniform layout).
"""

from __future__ import annotations

import argparse
import sys

from resihp.options import add_bus_flags, bus_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("remediate", help="run the remediation engine (plans, decisions, commands)", description=__doc__)
    add_bus_flags(p)
    p.add_argument("--job", default="resihp", help="job name (default: resihp)")
    p.add_argument("--plan", default=None, metavar="FILE", help="the running plan as JSON (collector.plan.Plan)")
    p.add_argument("--tp", type=int, default=2, help="uniform layout: TP degree (default 2)")
    p.add_argument("--pp", type=int, default=2, help="uniform layout: pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=2, help="uniform layout: replicas (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="uniform layout: micro-batches per replica (default 8)")
    p.add_argument("--layers", type=int, default=8, help="model layers for the uniform layout (default 8)")
    p.add_argument("--model", default=None, metavar="FILE",
                   help="model costs as JSON (remediation.model.ModelSpecFile); default: a uniform model")
    p.add_argument("--devices", type=int, default=None, help="devices in the cluster (default: the plan's highest id + 1)")
    p.add_argument("--devices-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--strategy", default="ours", help="planning strategy: ours or a baseline (see remediation.baselines)")
    p.add_argument("--horizon-s", type=float, default=1800.0, help="expected time until the next change (default 1800)")
    p.add_argument("--group", default="remediation", help="consumer group")
    p.add_argument("--verify-from-telemetry", action="store_true",
                   help="verify with telemetry.summary (reads the telemetry topic) instead of analytics.prediction")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="stop after this long with nothing new (default: run until interrupted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from collector.plan import Plan
    from remediation.baselines import make_strategy
    from remediation.candidates import PlannerOptions
    from remediation.cluster import Hardware
    from remediation.engine import EngineConfig, RemediationEngine
    from remediation.model import ModelSpec, ModelSpecFile

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.plan:
        plan = Plan.model_validate_json(Path(args.plan).read_text())
    else:
        plan = Plan.uniform(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=args.layers,
                            microbatches_per_replica=args.microbatches)
    if args.model:
        model = ModelSpecFile.model_validate_json(Path(args.model).read_text()).spec()
    else:
        model = ModelSpec.uniform(plan.num_layers)
    if model.num_layers != plan.num_layers:
        print(f"the model has {model.num_layers} layers but the plan {plan.num_layers}; pass matching --model/--plan",
              file=sys.stderr)
        return 2
    try:
        strategy = make_strategy(args.strategy, model, args.horizon_s)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    config = EngineConfig(
        job=args.job, num_devices=args.devices or max(plan.devices) + 1,
        hardware=Hardware(devices_per_node=args.devices_per_node),
        options=PlannerOptions(horizon_s=args.horizon_s), group=args.group,
        verify_from_telemetry=args.verify_from_telemetry,
    )
    with bus_from_args(args) as bus:
        engine = RemediationEngine(bus, config, model, plan, strategy)
        try:
            engine.run(idle_exit_s=args.exit_when_idle)
        finally:
            engine.close()
    return 0
