"""The executor of a shrinking data-parallel world: its telemetry, its layout, and the engine's node plans.

A job on trainer/agent/shrink.py's ``ShrinkingWorld`` (``resihp run --on-failure shrink``; the
agent's sample job with ``--report``) has one layout: data parallelism over the ranks in its world.
A rank is in the world or gone; no device can idle outside the layout. So its layout changes only
as its world does: a rank dies, a node is stopped (its ranks drain out at a step boundary,
trainer/agent/node_stop.py), a spare joins a place (trainer/agent/vacancy.py). This module is the
protocol that lets the platform see and steer that, in two halves:

    ranks   :class:`WorldTelemetry`: each rank reports its chunks (``telemetry.iteration``: a forward
            and a backward chunk per micro-batch, the gradient all-reduce) under the world's
            generation as the plan epoch and its position as its DP coordinate; the world's first
            rank also writes ``resihp/shrink/world`` in the ranks' store (signed): the generation,
            the members, the job's shape
    agent   :class:`ShrinkExecutor`, in the agent whose ranks include the world's first rank: it
            announces ``plan.current`` (one replica per member, epoch = generation) and
            ``plan.capabilities`` (``leaves_by_node_stop``), follows every change of the world with
            a new ``plan.current``, and takes the engine's ``command.reconfigure``: a plan that keeps
            the running layout's members less whole nodes is the node plan whose stops the engine
            issues with the command (remediation/node_plans.py); it is acknowledged ``applied`` once
            those nodes' ranks have left the world, ``failed`` with the rule it breaks otherwise, or
            when they have not left within :data:`EXCLUSION_DEADLINE_S`

The epoch is the world's generation, which every rank knows without being told: the engine's
command for epoch e+1 is applied by the world's next change, the drain. A change the engine did not
command (a death, a join) is announced as the next epoch, reason ``reshape``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from collector.events import ExecutorCapabilities, ReconfigureCommand
from collector.plan import PipelinePlan, Plan, StagePlan
from collector.settings import environment
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.integration import CommandListener, IterationReport, ResiHPReporter

log = logging.getLogger("resihp.agent")
WORLD_KEY = "resihp/shrink/world"  # the world's first rank's word on the world it steps in
EXCLUSION_DEADLINE_S = 120.0  # a command whose nodes have not left by then is a failed command
LAYERS = 2  # the sample job's model: two linear layers
CAPABILITIES = ExecutorCapabilities(
    executor="shrink", tp_shrink="no", tp_exclusion=False, pp_repartition="no", dp_drop=True,
    dp_microbatch_migration=True, spares=False, leaves_by_node_stop=True, schedules=["1f1b"],
    notes={"dp_drop": "a replica leaves with its node: the engine's stop drains the node's ranks at a step boundary",
           "spares": "a rank is in the world or gone; a spare agent takes a stopped node's place and its ranks join"})


@dataclass(frozen=True)
class WorldRecord:
    """``resihp/shrink/world``: the generation, its members (global ranks, in position order), the
    step it was written at, and the job's shape (samples per step and per micro-batch, tokens per sample)."""

    generation: int
    members: tuple[int, ...]
    step: int
    batch: int
    microbatch: int
    width: int

    @classmethod
    def parse(cls, body: Any) -> WorldRecord:
        if not isinstance(body, dict) or not isinstance(body.get("members"), list) or not body["members"] or \
                not all(type(body.get(k)) is int and body[k] >= 0 for k in ("generation", "step")) or \
                not all(type(body.get(k)) is int and body[k] >= 1 for k in ("batch", "microbatch", "width")) or \
                not all(type(r) is int and r >= 0 for r in body["members"]) or \
                len(set(body["members"])) != len(body["members"]):
            raise ValueError("a world record is {generation, members: [distinct ranks], step, batch, microbatch, width}")
        return cls(body["generation"], tuple(body["members"]), body["step"], body["batch"], body["microbatch"],
                   body["width"])

    def plan(self) -> Plan:
        """One replica per member, each running its share's micro-batches (the shares differ by at
        most one sample), epoch = generation."""
        n = len(self.members)
        pipelines = tuple(PipelinePlan(replica=i, microbatches=max(1, math.ceil(len(range(i, self.batch, n))
                                                                                 / self.microbatch)),
                                       stages=(StagePlan(devices=(d,), first_layer=0, end_layer=LAYERS),))
                          for i, d in enumerate(self.members))
        return Plan(epoch=self.generation, num_layers=LAYERS, pipelines=pipelines)


class _World(Protocol):
    """What the rank side reads of trainer/agent/shrink.py's ``ShrinkingWorld``."""

    generation: int
    world: tuple[int, ...]
    records: SignedStore

    @property
    def rank(self) -> int: ...


class WorldTelemetry:
    """One rank's side: its chunks under the world's generation, and the world record from its first rank."""

    def __init__(self, args: argparse.Namespace, rank_id: int) -> None:
        self.args, self.rank_id = args, rank_id
        self.reporter = ResiHPReporter(environment().job or "resihp", rank_id, (0, 0, 0), heartbeat_s=None)
        self.generation = -1

    def begin(self, step: int, world: _World) -> IterationReport:
        """The report of step ``step``; a new generation first sets this rank's role (and the
        world's first rank writes the world record)."""
        if world.generation != self.generation:
            self.generation = world.generation
            self.reporter.set_role(world.generation, (0, 0, world.rank))
            if world.rank == 0:
                world.records.set(WORLD_KEY, {"generation": world.generation, "members": list(world.world),
                                              "step": step, "batch": self.args.batch,
                                              "microbatch": self.args.microbatch, "width": self.args.width})
        return IterationReport(self.reporter, step, self.reporter.epoch)

    def end(self, report: IterationReport, loss: float | None) -> None:
        """Publish the step's report (the world's first rank adds the job's line: tokens, loss)."""
        if loss is not None:
            report.summary(tokens=self.args.batch * self.args.width, loss=loss)
        for payload in report.payloads(report.now_s()):
            self.reporter.publisher.publish(payload)

    def close(self) -> None:
        self.reporter.close()


@dataclass
class _InFlight:
    command: ReconfigureCommand
    leaving: frozenset[int]
    asked_at: float


class ShrinkExecutor:
    """The agent's side, active while its node holds the world's first rank (see the module's docstring)."""

    def __init__(self, job: str, open_bus: Callable[[], Any], run: str | None, ranks_per_node: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.open_bus, self.run, self.ranks_per_node, self.clock = job, open_bus, run, ranks_per_node, clock
        self.listener: CommandListener | None = None
        self.world: WorldRecord | None = None
        self.flight: _InFlight | None = None

    def watch(self, records: SignedStore, local_ranks: set[int]) -> None:
        """One monitor pass over the ranks' store of this round."""
        world = records.read(WORLD_KEY, WorldRecord.parse, allowed=RANK_WRITERS)
        if world is None or world.members[0] not in local_ranks:
            return  # no report yet, or another node's agent holds the world's first rank
        if self.listener is None:
            self.world = world
            self.listener = CommandListener(self.job, world.plan(), bus=self.open_bus, source="agent:shrink",
                                            check=self._refusal, run=self.run)
            self.listener.announce_plan(world.plan(), gpus_per_node=self.ranks_per_node, model_name="sample_job",
                                        tokens_per_microbatch=world.microbatch * world.width)
            self.listener.announce_capabilities(CAPABILITIES)
            log.info("shrinking world of job %s: %s", self.job, world.plan().shape())
        self._take_command()  # before the change: the stop the engine issued with a command may already have drained
        if self.world is not None and world.generation > self.world.generation:
            self._changed(world)
        self._deadline()

    def _refusal(self, plan: Plan) -> str | None:
        """Why the running world cannot become ``plan`` ("" or None: it can, by the stops the engine issues with it)."""
        world = self.world
        assert world is not None
        devices = plan.devices
        if any(len(s.devices) != 1 for p in plan.pipelines for s in p.stages) or \
                any(len(p.stages) != 1 for p in plan.pipelines):
            return "a shrinking data-parallel world runs one rank per replica: no tensor or pipeline parallelism"
        if set(devices) - set(world.members):
            return (f"devices {sorted(set(devices) - set(world.members))} are not in the world: ranks join only by a "
                    "spare taking a stopped node's place")
        leaving = set(world.members) - set(devices)
        nodes = {r // self.ranks_per_node for r in leaving}
        partial = sorted(r for n in nodes for r in range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node)
                         if r in world.members and r not in leaving)
        if partial:
            return (f"ranks leave the world only with their node (its stop drains them); the plan keeps {partial} "
                    f"of node(s) {sorted(nodes)}")
        if not leaving:
            return "the plan runs the world as it is: nothing to do"
        return None

    def _take_command(self) -> None:
        """The next command the listener hands over (fenced, checked by :meth:`_refusal`), if none is in flight."""
        listener = self.listener
        assert listener is not None and self.world is not None
        if self.flight is not None:
            return
        command = listener.poll()
        if command is not None:
            leaving = frozenset(set(self.world.members) - set(command.plan.devices))
            self.flight = _InFlight(command, leaving, self.clock())
            log.info("shrinking world of job %s: epoch %d once ranks %s have left with their node(s)", self.job,
                     command.plan.epoch, sorted(leaving))

    def _deadline(self) -> None:
        """A command whose ranks have not left in time fails; the world runs on as it is."""
        listener, flight = self.listener, self.flight
        assert listener is not None
        if flight is not None and self.clock() - flight.asked_at > EXCLUSION_DEADLINE_S:
            listener.ack_failed(flight.command, f"ranks {sorted(flight.leaving)} did not leave the world within "
                                                f"{EXCLUSION_DEADLINE_S:.0f} s (was their node stopped?)")
            self.flight = None

    def _changed(self, world: WorldRecord) -> None:
        """The world changed: the commanded exclusion happened (applied), or something else did (announced)."""
        listener, flight = self.listener, self.flight
        assert listener is not None
        self.world = world
        plan = world.plan()
        if flight is not None and world.generation == flight.command.plan.epoch and \
                set(world.members) == set(flight.command.plan.devices):
            listener.ack_applied(flight.command, self.clock() - flight.asked_at,
                                 detail=f"ranks {sorted(flight.leaving)} left the world with their node; "
                                        f"{len(world.members)} replicas from step {world.step}")
            if plan.pipelines != flight.command.plan.pipelines:  # the plan as the world runs it (its micro-batch split)
                listener.adopt(plan, reason="reshape")
            self.flight = None
            return
        if flight is not None:
            listener.ack_failed(flight.command, f"the world changed otherwise first (generation {world.generation}: "
                                                f"members {list(world.members)})")
            self.flight = None
        listener.adopt(plan, reason="reshape")
        log.info("shrinking world of job %s now runs %s (epoch %d)", self.job, plan.shape(), plan.epoch)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
