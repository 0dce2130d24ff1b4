"""``run_agent``: one node's agent from parsed flags to exit code, every failure one line.

The steps: the rendezvous (our bound store and job check for c10d, torch's registry for the other
backends) → the worker spec (each rank wrapped in trainer/agent/child.py) → torch's agent loop →
shut the rendezvous and the bus down, whatever happened. torch's agent stops this node's ranks
(SIGTERM to each rank's process group, then SIGKILL) on every way out, signals included.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer.agent.hang import HangPolicy
from trainer.agent.predicted import PredictedIteration
from trainer.agent.store import LOOPBACK_NAMES, AgentError, RendezvousStore, make_handler, open_rendezvous_store
from trainer.agent.vacancy import VacancyRendezvous
from trainer.spec import BusSpec


def worker_command(args: argparse.Namespace, cmd: Any, cmd_args: list[str]) -> tuple[str, list[str]]:
    """The program and arguments of each rank: the user's script inside the child wrapper."""
    if args.run_path:
        raise AgentError("--run-path is not supported by resihp run; pass the script path itself")
    if args.no_python:
        return str(cmd), list(cmd_args)  # not Python: no wrapper (the process-group kill still applies)
    script = ["-m", args.training_script] if args.module else [args.training_script]
    rest = cmd_args[cmd_args.index(args.training_script) + 1:]
    return str(cmd), ["-u", "-m", "trainer.agent.child", *script, *rest]


def _bool(value: str | None) -> bool | None:
    return None if value is None else value.lower() in ("1", "true", "yes", "y", "on")


def run_agent(args: argparse.Namespace, bus: BusSpec, echo=None) -> int:
    """Run this node's agent to the end; returns the exit code (0: every rank succeeded)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port
    from torch.distributed.run import config_from_args

    from collector.epoch_fence import run_of
    from trainer.agent.commands import JoinOrders, NodeCommands
    from trainer.agent.node import AgentSettings, NodeAgent, NodeStopped
    from trainer.agent.options import normalise
    from trainer.telemetry import TelemetryPublisher

    echo = echo or (lambda line: print(f"resihp run: {line}", file=sys.stderr, flush=True))
    args = normalise(args)
    config, cmd, cmd_args = config_from_args(args)
    program, program_args = worker_command(args, cmd, cmd_args)
    configs = dict(config.rdzv_configs)
    timeout_s = float(configs.pop("read_timeout", 60))
    hosts = _bool(configs.pop("is_host", None))
    rdzv: RendezvousStore | None = None
    telemetry = None
    predicted = None
    commands = None
    handler = None
    node_address = None
    agent = None
    finished = False  # this agent ends on purpose: its peers must not take its ranks for lost
    try:
        if args.join_running and (config.rdzv_backend != "c10d" or args.on_failure != "shrink"):
            raise AgentError("--join-running takes a dead node's place in a job run with --rdzv-backend c10d and "
                             "--on-failure shrink; pass both, with the job's other flags")
        if args.join_on_command and (not args.join_running or args.no_telemetry):
            raise AgentError("--join-on-command makes a --join-running agent wait for a join order from the bus; pass "
                             "--join-running, and not --no-telemetry")
        source = f"agent-{os.uname().nodename}-{os.getpid()}"
        if config.rdzv_backend == "c10d":
            rdzv = open_rendezvous_store(config.rdzv_endpoint, config.run_id, hosts=False if args.join_running else hosts,
                                         node_rank=args.node_rank, bind=args.rdzv_bind, timeout_s=timeout_s)
            # The ranks' bootstrap store listens where this node is reached: --local-addr, else the
            # address the rendezvous is bound to on its host, else loopback for a loopback endpoint.
            node_address = config.local_addr or rdzv.bound or (
                "127.0.0.1" if rdzv.host in LOOPBACK_NAMES or rdzv.host.startswith("127.") else None)
            params = RendezvousParameters(backend="c10d", endpoint=f"{rdzv.host}:{rdzv.port}", run_id=config.run_id,
                                          min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                          local_addr=node_address, **configs)
            if not args.no_telemetry:  # node commands name a node of a c10d rendezvous round
                commands = NodeCommands(bus.open(), args.job, source, run=run_of(config.run_id))
            handler = (VacancyRendezvous(rdzv.store, config.run_id, config.nproc_per_node,
                                         float(configs.get("join_timeout", 600)),
                                         JoinOrders(commands) if args.join_on_command and commands else None)
                       if args.join_running else make_handler(rdzv, params, node_address, timeout_s))
            if rdzv.hosting:
                echo(f"rendezvous {config.run_id} at {rdzv.host}:{rdzv.port} (hosted by this agent)")
            if args.join_on_command:
                echo(f"waiting for an order to take the place a node left in job {config.run_id} (resihp node join "
                     "NODE --round ROUND; --join-running --join-on-command)")
            elif args.join_running:
                echo(f"waiting for a place that a dead node left in job {config.run_id} (--join-running)")
            master_addr, master_port = None, None
        else:
            params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                          run_id=config.run_id, min_nodes=config.min_nodes,
                                          max_nodes=config.max_nodes, local_addr=config.local_addr,
                                          **config.rdzv_configs)
            handler = rdzv_registry.get_rendezvous_handler(params)
            master_addr, master_port = _get_addr_and_port(params)
        if not args.no_telemetry:
            telemetry = TelemetryPublisher(bus.open, args.job, 0, heartbeat_s=None, source=source)
            if args.expected_step_s is None:
                group = f"agent:{args.job}:{os.uname().nodename}:{os.getpid()}"
                predicted = PredictedIteration(bus.open(), args.job, group)
        work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="resihp-agent-"))
        settings = AgentSettings(job=args.job, node_label=os.uname().nodename, work_dir=work_dir,
                                 hang=HangPolicy(args.hang_factor, args.hang_floor_s, args.expected_step_s),
                                 on_hang=args.on_hang, on_failure=args.on_failure, heartbeat_s=args.heartbeat_s,
                                 telemetry=telemetry, predicted=predicted, node_address=node_address,
                                 job_store=rdzv.store if rdzv is not None else None,
                                 hosts_rendezvous=rdzv is not None and rdzv.hosting, commands=commands,
                                 stop_grace_s=args.stop_grace_s)
        entrypoint: Any = program
        if args.preload:
            # Forked from a server that imported the modules once: starting or restarting a rank
            # costs no imports (trainer/agent/pcontext.py).
            if args.no_python:
                raise AgentError("--preload forks Python ranks; it cannot start a --no-python program")
            from trainer.agent.child import run_script

            entrypoint, program_args = run_script, program_args[program_args.index("trainer.agent.child") + 1:]
            settings.preload = tuple(m for m in args.preload.split(",") if m)
        spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                          args=tuple(program_args), rdzv_handler=handler, max_restarts=config.max_restarts,
                          monitor_interval=config.monitor_interval, master_addr=master_addr,
                          master_port=master_port, local_addr=config.local_addr)
        agent = NodeAgent(spec, config.logs_specs, settings,
                          log_line_prefix_template=config.log_line_prefix_template)
        result = agent.run()
        finished = not result.is_failed()
        if result.is_failed():
            rank, first = min(result.failures.items(), key=lambda item: item[1].timestamp)
            how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
                   else f"exited with code {first.exitcode}")
            echo(f"error: rank {rank} (local {first.local_rank}, pid {first.pid}) {how}; "
                 f"{len(result.failures)} rank(s) failed on this node, restarts left 0 of {config.max_restarts}")
            return 1
        if agent.lost and len(agent.lost) == config.nproc_per_node:
            echo(f"error: every rank of this node was lost ({sorted(agent.lost)}); the job went on without them")
            return 1
        return 0
    except NodeStopped as exc:  # its peers see it go as a death (presence, below) and go on without it
        echo(f"stopped on node command {exc.command.command_id}: {exc.detail}")
        return 0
    except AgentError as exc:
        echo(f"error: {exc}")
        return 2
    except RendezvousError as exc:
        first_line = (str(exc) or type(exc).__name__).splitlines()[0]
        echo(f"error: the rendezvous failed ({type(exc).__name__}: {first_line}); check that every agent has the "
             "same --rdzv-endpoint, --rdzv-id and --nnodes, and raise join_timeout in --rdzv-conf if nodes start late")
        return 2
    except DistError as exc:  # a store of the running job stopped answering: its host agent is gone
        first_line = (str(exc) or type(exc).__name__).splitlines()[0]
        echo(f"error: lost the job's rendezvous store ({type(exc).__name__}: {first_line}); the agent that hosts it "
             "(node rank 0) is gone, and the job cannot go on without it; this node's ranks were stopped")
        return 2
    except SignalException as exc:
        echo(f"stopped by {exc.sigval.name}; this node's ranks were stopped")
        return 128 + int(exc.sigval)
    finally:
        if agent is not None and agent.presence is not None:
            agent.presence.close(finished)
        if handler is not None:
            try:
                handler.shutdown()
            except Exception:  # noqa: BLE001 - the rendezvous may already be gone with its host
                pass
        if telemetry is not None:
            telemetry.close()
        if predicted is not None:
            predicted.close()
        if commands is not None:
            commands.close()
