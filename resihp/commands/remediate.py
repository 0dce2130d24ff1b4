"""``resihp remediate``: run the remediation engine for one job over the bus.

It folds incidents and the plan lifecycle from the log, plans when the faults change (the joint
TP/PP/DP planner, or a baseline with --strategy), publishes proposals, applies decisions by
publishing reconfiguration commands fenced by epoch, and verifies each applied plan against
measured throughput.

The running plan comes from the trainer's ``plan.current`` events (published at start and after
every reshape); --plan FILE (a collector.plan.Plan as JSON) or --tp/--pp/--dp/--microbatches (the
uniform layout) give it until one arrives. The cost figures come from the analytics consumer's
``analytics.cost_model`` fits of the running stages; --model FILE gives them until fits arrive
(and without either, the engine waits: it does not plan blind).

Incidents the detector has not located to a device yet are reported and wait: a fail-slow named
only by its TP group waits --localisation-wait-s for the rank, then is planned around as a whole
group; a link fault with no ends waits for a confirmation. An error while planning one incident
is logged and the engine keeps running.

Node plans (docs/remediation.md, "Node plans"): with --node-run RDZV_ID (the ``--rdzv-id`` of the
job's ``resihp run`` agents), when the incidents blame a whole node the engine may propose the
layout without it together with the node's stop, issued as ``command.node`` once the layout is
applied. Without it a blamed node is reported and planned around in the job.
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
    p.add_argument("--tp", type=int, default=None, help="uniform layout until plan.current arrives: TP degree (2 if "
                   "--pp/--dp are given)")
    p.add_argument("--pp", type=int, default=None, help="uniform layout: pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=None, help="uniform layout: replicas (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="uniform layout: micro-batches per replica (default 8)")
    p.add_argument("--layers", type=int, default=8, help="model layers for the uniform layout (default 8)")
    p.add_argument("--model", default=None, metavar="FILE",
                   help="model costs as JSON (remediation.model.read_model_file), used until analytics.cost_model fits "
                   "arrive; default with a --plan/--tp layout: a uniform model")
    p.add_argument("--mean-document-tokens", type=float, default=1024.0,
                   help="mean packed document length, for the attention term when planning from fits (default 1024)")
    p.add_argument("--localisation-wait-s", type=float, default=30.0,
                   help="how long (event time) a fail-slow located only to a TP group waits for the rank to be named "
                   "before the planner plans around the whole group (default 30)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices in the cluster (default: the running plan's highest id + 1, whole nodes)")
    p.add_argument("--devices-per-node", type=int, default=8, help="devices per node (default 8); for node plans, "
                   "the ranks each agent runs (--nproc-per-node)")
    p.add_argument("--node-run", default=None, metavar="RDZV_ID",
                   help="the job's rendezvous id (its agents' --rdzv-id): turns node plans on, whose stop orders "
                        "name it (default: off)")
    p.add_argument("--node-round", type=int, default=0, metavar="ROUND",
                   help="the rendezvous round node orders name until an agent's command.node_ack says which runs "
                        "(default 0)")
    p.add_argument("--node-min-bad-devices", type=int, default=2, metavar="N",
                   help="a node is blamed when at least N of its devices are slow, dead or behind a slow NIC "
                        "(default 2)")
    p.add_argument("--strategy", default="ours", help="planning strategy: ours or a baseline (see remediation.baselines)")
    p.add_argument("--horizon-s", type=float, default=1800.0, help="expected time until the next change (default 1800)")
    p.add_argument("--group", default="remediation", help="consumer group")
    p.add_argument("--verify-from-telemetry", action="store_true",
                   help="verify with telemetry.summary (reads the telemetry topic) instead of analytics.prediction")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="stop after this long with nothing new (default: run until interrupted)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics (plans awaiting approval and their age) on 127.0.0.1:PORT (0: a free "
                   "port, printed on stderr); see docs/metrics.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from collector.epoch_fence import run_of
    from collector.plan import Plan
    from remediation.baselines import make_strategy
    from remediation.candidates import PlannerOptions
    from remediation.cluster import Hardware
    from remediation.engine import EngineConfig, RemediationEngine
    from pydantic import ValidationError

    from collector.codec import one_line
    from remediation.model import PlannerModel, read_model_file
    from remediation.node_plans import NodeSettings

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = None
    if args.plan:
        plan = Plan.model_validate_json(Path(args.plan).read_text())
    elif any(x is not None for x in (args.tp, args.pp, args.dp)):
        plan = Plan.uniform(tp=args.tp or 2, pp=args.pp or 2, dp=args.dp or 2, num_layers=args.layers,
                            microbatches_per_replica=args.microbatches)
    model = None
    if args.model:
        try:
            model = read_model_file(Path(args.model).read_text())
        except ValidationError as exc:
            print(f"--model {args.model}: {one_line(exc, '<file>')}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as exc:
            print(f"--model {args.model}: {exc}", file=sys.stderr)
            return 2
    elif plan is not None:
        model = PlannerModel.uniform(plan.num_layers)
    if model is not None and plan is not None and model.num_layers != plan.num_layers:
        print(f"the model has {model.num_layers} layers but the plan {plan.num_layers}; pass matching --model/--plan",
              file=sys.stderr)
        return 2
    try:
        make_strategy(args.strategy, model or PlannerModel.uniform(1), args.horizon_s)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.node_round < 0 or args.node_min_bad_devices < 1:
        print("--node-round is a round from 0 and --node-min-bad-devices a count from 1", file=sys.stderr)
        return 2
    config = EngineConfig(
        job=args.job, num_devices=args.devices,
        hardware=Hardware(devices_per_node=args.devices_per_node),
        options=PlannerOptions(horizon_s=args.horizon_s), group=args.group,
        verify_from_telemetry=args.verify_from_telemetry, strategy=args.strategy,
        mean_document_tokens=args.mean_document_tokens, localisation_wait_s=args.localisation_wait_s,
        nodes=NodeSettings(run=run_of(args.node_run) if args.node_run else None, round=args.node_round,
                           min_bad_devices=args.node_min_bad_devices),
    )
    with bus_from_args(args) as bus:
        engine = RemediationEngine(bus, config, model, plan)
        server = None
        if args.metrics_port is not None:
            from remediation.approval_metrics import serve_approval_metrics

            server = serve_approval_metrics(engine, args.metrics_port)
        try:
            engine.run(idle_exit_s=args.exit_when_idle)
        finally:
            if server is not None:
                server.close()
            engine.close()
    return 0
