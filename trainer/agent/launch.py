"""``run_agent``: one node's agent from parsed flags to exit code, every failure one line.

The steps (:class:`AgentLaunch`): the rendezvous (our bound store and job check for c10d; the
job's store and torch's dynamic rendezvous on etcd for etcd, trainer/agent/etcd_store.py; torch's
registry for the other backends) → the bus clients → the worker spec (each rank wrapped in
trainer/agent/child.py) → torch's agent loop → shut the rendezvous and the bus down, whatever
happened; ``run_agent`` turns each way out into its exit code and one line. torch's agent stops this node's ranks
(SIGTERM to each rank's process group, then SIGKILL) on every way out, signals included.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.agent.hang import HangPolicy
from trainer.agent.predicted import PredictedIteration
from trainer.agent.store import (LOOPBACK_NAMES, AgentError, RendezvousStore, bind_bootstrap_store, leave_rendezvous,
                                 make_handler, open_rendezvous_store)
from trainer.agent.vacancy import VacancyRendezvous
from trainer.spec import BusSpec

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    import torch.distributed as dist

    from trainer.agent.commands import JoinOrders, NodeCommands
    from trainer.agent.etcd_client import EtcdClient
    from trainer.agent.node import AgentSettings, NodeAgent
    from trainer.agent.shrink_executor import ShrinkExecutor
    from trainer.telemetry import TelemetryPublisher
    from trainer.torchtitan.controller import TitanRelayout


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


class AgentLaunch:
    """One node's launch, step by step: :meth:`rendezvous` → :meth:`open_telemetry` →
    :meth:`worker_spec` → :meth:`run`, and :meth:`close` whatever happened. It owns what the steps
    open (the rendezvous store and handler, the bus clients, the agent), so :meth:`close` shuts down
    exactly what was opened, in every way out."""

    def __init__(self, args: argparse.Namespace, bus: BusSpec, echo: Callable[[str], None]) -> None:
        from torch.distributed.run import config_from_args

        from trainer.agent.options import normalise

        self.args, self.bus, self.echo = normalise(args), bus, echo
        self.config, cmd, cmd_args = config_from_args(self.args)
        self.program, self.program_args = worker_command(self.args, cmd, cmd_args)
        self.configs = dict(self.config.rdzv_configs)
        self.timeout_s = float(self.configs.pop("read_timeout", 60))
        self.hosts = _bool(self.configs.pop("is_host", None))
        self.source = f"agent-{os.uname().nodename}-{os.getpid()}"
        self.rdzv: RendezvousStore | None = None
        self.etcd: EtcdClient | None = None  # the job's store is on etcd (--rdzv-backend etcd)
        self.job_store: dist.Store | None = None  # the rendezvous store itself: vacancies go there
        self.telemetry: TelemetryPublisher | None = None
        self.predicted: PredictedIteration | None = None
        self.commands: NodeCommands | None = None
        self.handler: Any = None
        self.node_address: str | None = None
        self.master: tuple[str | None, int | None] = (None, None)
        self.agent: NodeAgent | None = None
        self.relayout: TitanRelayout | None = None
        self.finished = False  # this agent ends on purpose: its peers must not take its ranks for lost
        self.orders: JoinOrders | None = None  # a spare's wait for a join order (--join-on-command)
        self.shrink_executor: ShrinkExecutor | None = None  # a shrinking world's executor (--on-failure shrink)

    def check_flags(self) -> None:
        """The join flags make sense only together: fails with the flags to pass."""
        args = self.args
        if self.config.rdzv_backend in ("etcd-v2",):
            raise AgentError("--rdzv-backend etcd-v2 needs etcd's v2 API and python-etcd; pass --rdzv-backend etcd "
                             "(etcd's v3 API, docs/agent.md) with --rdzv-endpoint HOST:PORT,HOST:PORT,...")
        if args.join_running and (self.config.rdzv_backend not in ("c10d", "etcd") or args.on_failure != "shrink"):
            raise AgentError("--join-running takes a dead node's place in a job run with --rdzv-backend c10d or etcd "
                             "and --on-failure shrink; pass both, with the job's other flags")
        if args.join_on_command and (not args.join_running or args.no_telemetry):
            raise AgentError("--join-on-command makes a --join-running agent wait for a join order from the bus; pass "
                             "--join-running, and not --no-telemetry")

    def rendezvous(self) -> None:
        """The rendezvous handler: our bound store and job check for c10d, the job's store on etcd
        for etcd (node commands and replacements apply to both), torch's registry for the other
        backends. Fails with ``AgentError`` on a store that cannot be bound or reached, and a
        ``RendezvousError`` from torch."""
        if self.config.rdzv_backend == "c10d":
            self._c10d_rendezvous()
            return
        if self.config.rdzv_backend == "etcd":
            self._etcd_rendezvous()
            return
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import registry as rdzv_registry
        from torch.distributed.launcher.api import _get_addr_and_port

        config = self.config
        params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes,
                                      max_nodes=config.max_nodes, local_addr=config.local_addr,
                                      **config.rdzv_configs)
        self.handler = rdzv_registry.get_rendezvous_handler(params)
        self.master = _get_addr_and_port(params)

    def _c10d_rendezvous(self) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        args, config = self.args, self.config
        self.rdzv = rdzv = open_rendezvous_store(config.rdzv_endpoint, config.run_id,
                                                 hosts=False if args.join_running else self.hosts,
                                                 node_rank=args.node_rank, bind=args.rdzv_bind,
                                                 timeout_s=self.timeout_s)
        # The ranks' bootstrap store listens where this node is reached: --local-addr, else the
        # address the rendezvous is bound to on its host, else loopback for a loopback endpoint.
        self.node_address = config.local_addr or rdzv.bound or (
            "127.0.0.1" if rdzv.host in LOOPBACK_NAMES or rdzv.host.startswith("127.") else None)
        params = RendezvousParameters(backend="c10d", endpoint=f"{rdzv.host}:{rdzv.port}", run_id=config.run_id,
                                      min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                      local_addr=self.node_address, **self.configs)
        self.job_store = rdzv.store
        self._job_handler(lambda: make_handler(rdzv, params, self.node_address, self.timeout_s))
        if rdzv.hosting:
            self.echo(f"rendezvous {config.run_id} at {rdzv.host}:{rdzv.port} (hosted by this agent)")

    def _etcd_rendezvous(self) -> None:
        """torch's dynamic rendezvous with its state, the job's store and the ranks' store on the
        etcd cluster at --rdzv-endpoint (trainer/agent/etcd_store.py): no agent hosts anything the
        job needs. Fails with ``AgentError`` on a bad endpoint list or a cluster nobody answers."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from trainer.agent.etcd_client import EtcdUnavailable, parse_endpoints
        from trainer.agent.etcd_store import EtcdStore, etcd_client, etcd_handler, job_store, reachable

        config = self.config
        try:
            endpoints = parse_endpoints(config.rdzv_endpoint)
            self.etcd = etcd = etcd_client(config.rdzv_endpoint, self.timeout_s)
            reachable(etcd)
        except ValueError as exc:
            raise AgentError(f"--rdzv-endpoint: {exc}") from None
        except EtcdUnavailable as exc:
            raise AgentError(f"cannot reach the etcd cluster at {config.rdzv_endpoint} ({exc}); check "
                             "--rdzv-endpoint and that a majority of its members is up") from None
        loopback = all(h in LOOPBACK_NAMES or h.startswith("127.") or h == "::1" for h, _ in endpoints)
        self.node_address = config.local_addr or ("127.0.0.1" if loopback else None)
        params = RendezvousParameters(backend="etcd", endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                      min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                      local_addr=self.node_address, **self.configs)
        self.job_store = job_store(etcd, config.run_id, self.timeout_s)

        def handler() -> Any:
            assert isinstance(self.job_store, EtcdStore)
            made = etcd_handler(etcd, self.job_store, params)
            bind_bootstrap_store(made, self.node_address, self.timeout_s)
            return made

        self._job_handler(handler)

    def _job_handler(self, make: Callable[[], Any]) -> None:
        """The node-command reader and this agent's handler: ``make``'s, or a replacement's
        (--join-running) that takes a dead node's place from the job store."""
        from collector.epoch_fence import run_of
        from trainer.agent.commands import JoinOrders, NodeCommands

        args, config = self.args, self.config
        assert self.job_store is not None
        if not args.no_telemetry:  # node commands name a node of a rendezvous round
            self.commands = NodeCommands(self.bus.open(), args.job, self.source, run=run_of(config.run_id))
        self.orders = orders = (JoinOrders(self.commands, config.nproc_per_node) if args.join_on_command and self.commands
                                else None)
        self.handler = (VacancyRendezvous(self.job_store, config.run_id, config.nproc_per_node,
                                          float(self.configs.get("join_timeout", 600)), orders)
                        if args.join_running else make())
        if args.join_on_command:
            self.echo(f"spare {self.source} waiting for an order to take the place a node left in job {config.run_id} "
                      f"(resihp node join NODE --round ROUND [--spare {self.source}]; --join-running --join-on-command)")
        elif args.join_running:
            self.echo(f"waiting for a place that a dead node left in job {config.run_id} (--join-running)")

    def open_telemetry(self) -> None:
        """The agent's bus clients: its telemetry and, without --expected-step-s, the cost model's
        predicted iteration its hang deadline scales from (none with --no-telemetry)."""
        args = self.args
        if args.no_telemetry:
            return
        from trainer.telemetry import TelemetryPublisher

        self.telemetry = TelemetryPublisher(self.bus.open, args.job, 0, heartbeat_s=None, source=self.source,
                                            role="executor")  # its hang findings are signed as the executor's
        if args.expected_step_s is None:
            group = f"agent:{args.job}:{os.uname().nodename}:{os.getpid()}"
            self.predicted = PredictedIteration(self.bus.open(), args.job, group)

    def open_executor(self) -> None:
        """A torchtitan job (``-m torchtitan.train --module trainer.torchtitan``) gets its executor in
        each of its agents (trainer/torchtitan/controller.py; the one of group rank 0 speaks for the
        job): the plan announced, commands obeyed by a restart at a new layout, a lost device or node
        restarted past. Its command line gains ``--checkpoint.enable``."""
        args = self.args
        if args.no_telemetry:
            return
        from trainer.torchtitan.controller import TitanRelayout, is_torchtitan_job

        if not is_torchtitan_job(args.module, args.training_script, args.training_script_args):
            return
        self.relayout = TitanRelayout(args.job, self.bus.open, self.telemetry, min_nodes=self.config.min_nodes,
                                      hosts_rendezvous=self.rdzv is not None and self.rdzv.hosting)
        head = self.program_args.index(args.training_script) + 1
        self.program_args = self.program_args[:head] + self.relayout.initial_args(self.program_args[head:])

    def open_shrink_executor(self) -> None:
        """Under --on-failure shrink with the bus on, the executor of a shrinking world
        (trainer/agent/shrink_executor.py): idle until the job's ranks report their world."""
        args = self.args
        if args.no_telemetry or args.on_failure != "shrink" or args.join_running:
            return
        from collector.epoch_fence import run_of
        from trainer.agent.shrink_executor import ShrinkExecutor

        self.shrink_executor = ShrinkExecutor(args.job, self.bus.open, run_of(self.config.run_id),
                                              self.config.nproc_per_node)

    def settings(self) -> AgentSettings:
        from trainer.agent.node import AgentSettings

        args, rdzv = self.args, self.rdzv
        return AgentSettings(job=args.job, node_label=os.uname().nodename,
                             work_dir=Path(args.work_dir or tempfile.mkdtemp(prefix="resihp-agent-")),
                             hang=HangPolicy(args.hang_factor, args.hang_floor_s, args.expected_step_s),
                             on_hang=args.on_hang, on_failure=args.on_failure, heartbeat_s=args.heartbeat_s,
                             telemetry=self.telemetry, predicted=self.predicted, node_address=self.node_address,
                             job_store=self.job_store, etcd=self.etcd,
                             hosts_rendezvous=rdzv is not None and rdzv.hosting, commands=self.commands,
                             stop_grace_s=args.stop_grace_s, drain_s=args.drain_s, relayout=self.relayout,
                             shrink_executor=self.shrink_executor,
                             rank_env={} if args.no_telemetry else self.bus.environment())

    def worker_spec(self, settings: AgentSettings) -> WorkerSpec:
        """torch's spec of this node's ranks; with --preload each rank is forked from a server
        that imported the modules once, so starting or restarting one costs no imports
        (trainer/agent/pcontext.py). Fails on --preload with --no-python."""
        from torch.distributed.elastic.agent.server.api import WorkerSpec

        entrypoint: Any = self.program
        program_args = self.program_args
        if self.args.preload:
            if self.args.no_python:
                raise AgentError("--preload forks Python ranks; it cannot start a --no-python program")
            from trainer.agent.child import run_script

            entrypoint, program_args = run_script, program_args[program_args.index("trainer.agent.child") + 1:]
            settings.preload = tuple(m for m in self.args.preload.split(",") if m)
            # the ranks' imports run while this agent waits in the rendezvous (for its peers, for a
            # place as a spare, or for a running job to take it in), not once the round formed
            from trainer.agent.pcontext import start_fork_server

            start_fork_server(settings.preload)
        config = self.config
        master_addr, master_port = self.master
        return WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                          args=tuple(program_args), rdzv_handler=self.handler, max_restarts=config.max_restarts,
                          monitor_interval=config.monitor_interval, master_addr=master_addr,
                          master_port=master_port, local_addr=config.local_addr)

    def run(self) -> int:
        """Every step, then torch's agent loop to its end: 0 when every rank succeeded, 1 when a
        rank failed past its restarts or this node lost all its ranks to the shrinking world."""
        from trainer.agent.node import NodeAgent

        self.check_flags()
        self.rendezvous()
        self.open_telemetry()
        self.open_executor()
        self.open_shrink_executor()
        settings = self.settings()
        spec = self.worker_spec(settings)
        self.agent = agent = NodeAgent(spec, self.config.logs_specs, settings,
                                       log_line_prefix_template=self.config.log_line_prefix_template)
        result = agent.run()
        self.finished = not result.is_failed()
        if result.is_failed():
            rank, first = min(result.failures.items(), key=lambda item: item[1].timestamp)
            how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
                   else f"exited with code {first.exitcode}")
            self.echo(f"error: rank {rank} (local {first.local_rank}, pid {first.pid}) {how}; "
                      f"{len(result.failures)} rank(s) failed on this node, restarts left 0 of {self.config.max_restarts}")
            return 1
        if self.relayout is not None and self.relayout.left_out:
            self.echo(f"the job's plan epoch {self.relayout.epoch} runs no rank on this node; it left the job, "
                      "which goes on on the other nodes")
            return 0
        if agent.lost and len(agent.lost) == self.config.nproc_per_node:
            self.echo(f"error: every rank of this node was lost ({sorted(agent.lost)}); the job went on without them")
            return 1
        return 0

    def close(self) -> None:
        """Says this node's end to its peers (a death unless it finished), shuts the rendezvous
        and the bus clients; a rendezvous whose host is gone cannot be shut, and is left."""
        if self.agent is not None and self.agent.presence is not None:
            self.agent.presence.close(self.finished)
        if self.handler is not None:
            try:
                if self.relayout is not None and self.relayout.left_out:
                    leave_rendezvous(self.handler)  # the job goes on without this node: not closed
                else:
                    self.handler.shutdown()
            except Exception:  # noqa: BLE001 - the rendezvous may already be gone with its host
                pass
        if self.orders is not None:
            self.orders.close()
        for client in (self.relayout, self.shrink_executor, self.telemetry, self.predicted, self.commands):
            if client is not None:
                client.close()


def run_agent(args: argparse.Namespace, bus: BusSpec, echo: Callable[[str], None] | None = None) -> int:
    """Run this node's agent to the end; returns the exit code (0: every rank succeeded, 1: a rank
    failed, 2: the launch or the rendezvous failed, 128 + N: stopped by signal N)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError

    from trainer.agent.etcd_client import EtcdUnavailable
    from trainer.agent.node_stop import NodeStopped

    echo = echo or (lambda line: print(f"resihp run: {line}", file=sys.stderr, flush=True))
    launch: AgentLaunch | None = None
    try:
        launch = AgentLaunch(args, bus, echo)
        return launch.run()
    except NodeStopped as exc:  # its peers see it go as a death (presence, below) and go on without it
        echo(f"stopped on node command {exc.command.command_id}: {exc.detail}")
        return 0
    except AgentError as exc:
        echo(f"error: {exc}")
        return 2
    except RendezvousError as exc:
        echo(f"error: the rendezvous failed ({_first_line(exc)}); check that every agent has the "
             "same --rdzv-endpoint, --rdzv-id and --nnodes, and raise join_timeout in --rdzv-conf if nodes start late")
        return 2
    except EtcdUnavailable as exc:  # the job's store on etcd: a majority of the cluster is gone
        echo(f"error: lost the job's store on etcd ({_first_line(exc)}); the job goes on only while a majority "
             "of the etcd cluster answers; this node's ranks were stopped")
        return 2
    except DistError as exc:  # a store of the running job stopped answering: its host agent is gone
        echo(f"error: lost the job's rendezvous store ({_first_line(exc)}); the agent that hosts it "
             "(node rank 0) is gone, and the job cannot go on without it; this node's ranks were stopped")
        return 2
    except SignalException as exc:
        echo(f"stopped by {exc.sigval.name}; this node's ranks were stopped")
        return 128 + int(exc.sigval)
    finally:
        if launch is not None:
            launch.close()


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc) or type(exc).__name__).splitlines()[0]}"
