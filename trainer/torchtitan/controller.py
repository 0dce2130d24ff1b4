"""The node agent's side of a torchtitan job: its plan announced, its commands obeyed by a restart.

torchtitan runs one regular layout per process world, so the platform's reshape of a torchtitan job
is a restart at another layout, driven from the agent (which holds the executor's key; the ranks
only publish telemetry). :class:`TitanRelayout` is called on every pass of the agent's monitor loop
(trainer/agent/node.py) and walks the protocol of trainer/agent/relayout.py:

    announce   once the job's rank 0 has said what it runs (``resihp/relayout/job``: degrees,
               devices, micro-batches, layers), ``plan.current`` and ``plan.capabilities`` go out, so
               the engine plans for this job within what torchtitan can run (layout.py)
    command    a ``command.reconfigure`` (signed, fenced, for this run: trainer/integration.py's
               ``CommandListener``) whose plan is a uniform layout: its torchtitan degrees and the
               device of each new rank (``layout_of``); anything else is acknowledged ``failed``
               with the rule it breaks, and the job runs on untouched
    stop       the stop order in the ranks' store; the ranks stop after one step, together, and save
    restart    when every rank has exited after ``stopped``: the same command line with the new
               degrees and the global batch kept, as many ranks as the plan has devices, each on its
               device (``RESIHP_DEVICES``; on GPUs also ``CUDA_VISIBLE_DEVICES``)
    resumed    the new world's first step: ``command.ack`` applied with the pause, the new
               ``plan.current``, and the pause's phases as ``telemetry.reshape_phase`` events

Probes: each ``probe.request`` the listener admits (signed by analytics, for devices the job runs,
bounded) is posted in the ranks' store; the ranks run it together at their next step boundary
(trainer/torchtitan/probes.py: a compute probe times a matmul, a link probe a send to the next
rank) and the asked ones publish ``probe.result``.

Fail-stop (trainer/torchtitan/recovery.py): a rank that dies ends its round and torch restarts the
group at the same layout from the last periodic checkpoint; when the same device's rank ends two
rounds in a row the device is judged lost, and the agent restarts the job from that checkpoint at
the largest uniform layout on the devices left, as the next plan epoch (``plan.current``, reason
``restart``, and the pause's phases), without spending a restart. A command in flight when a rank
dies is acknowledged ``failed``.

Across nodes (trainer/agent/relayout.py) every node's agent runs this controller. The leader — the
agent of the round's group rank 0 — is the only one on the bus (announcements, commands, probes,
acknowledgements); before its stop order it writes the new world (``order``: devices in world-rank
order, flags), and each agent, once the world stopped, starts the order's devices that are its own:
the next rendezvous round is the new world. A node the plan leaves with no rank leaves the job (its
agent takes itself out of the rendezvous and ends; the leader orders it only when the job's
``--nnodes`` minimum allows it and that node does not serve the rendezvous). A node that is gone —
its agent dead, or every round without it — makes a round of another size: every agent lays that
round out alike from the job's last shape (the uniform layout of exactly its ranks), a restart past
the node from the last checkpoint, announced by the leader as the next plan epoch (reason
``restart``). A node's device lost twice in a row leaves that node's share (``LostDevices``), and
the round that follows is laid out the same way. A node that joins the running job (its agent
waits in the rendezvous) is taken in at a step boundary: the leader's stop order names no new
world (``grow``), the ranks stop and save, every agent restarts its share into the round the
newcomer completes, laid out as any round of another size; the newcomer reads the job's shape
from the leader's record in the job's store and takes device numbers the job never had.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from collector.events import PlanCurrentReason, ReconfigureCommand, ReshapePhase, ReshapePhaseName
from collector.plan import Plan
from trainer.agent.relayout import (DEVICES_ENV, EPOCH_ENV, GROW_COMMAND, JOINED_KEY, NODE_KEY, ORDER_KEY, PROBE_KEY,
                                    PROBE_REQUEST_KEY, RESUMED_KEY, SHAPE_KEY, STOP_KEY, STOPPED_KEY, NodeRecord,
                                    RelayoutOrder, StepMark, StopOrder)
from trainer.agent.signed_store import RANK_WRITERS, SignedStore
from trainer.integration import CommandListener
from trainer.telemetry import TelemetryPublisher
from trainer.torchtitan.layout import (JOB_KEY, TORCHTITAN_CAPABILITIES, JobShape, TitanLayout, fallback_layout,
                                       layout_flags, layout_of, with_flags)
from trainer.torchtitan.recovery import LostDevices

log = logging.getLogger("resihp.torchtitan")
STOP_DEADLINE_S = 120.0  # a stop order not obeyed by then (no step boundary reached) is a failed command
RESUME_DEADLINE_S = 300.0  # a new world that has not stepped by then
HOLD_S = 20.0  # a node's ranks exited with an order pending: how long to wait for the stop mark


def is_torchtitan_job(module: bool, script: str, script_args: Sequence[str]) -> bool:
    """``resihp run -m torchtitan.train --module trainer.torchtitan …``: a job this controller serves."""
    if not (module and script == "torchtitan.train"):
        return False
    args = list(script_args)
    for i, arg in enumerate(args):
        if arg == "--module" and i + 1 < len(args):
            return args[i + 1].startswith("trainer.torchtitan")
        if arg.startswith("--module="):
            return arg.split("=", 1)[1].startswith("trainer.torchtitan")
    return False


@dataclass
class _InFlight:
    """The leader's command, from its stop order to the new world's first step."""

    command: ReconfigureCommand
    layout: TitanLayout
    asked_at: float
    stopped: StepMark | None = None
    stopped_at: float = 0.0
    restarted_at: float = 0.0


@dataclass(frozen=True)
class JobRecord:
    """What the leader keeps in the job's store (``SHAPE_KEY``) for a node that joins later: the
    shape the newest world runs and ``high``, one past every device the job has had."""

    shape: JobShape
    high: int

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape.to_json(), "high": self.high}

    @classmethod
    def parse(cls, body: Any) -> JobRecord:
        if not isinstance(body, dict) or not isinstance(body.get("high"), int) or body["high"] < 0:
            raise ValueError("a job record is {shape: {...}, high: int >= 0}")
        shape = JobShape.parse(body.get("shape"))
        if shape.devices and max(shape.devices) >= body["high"]:
            raise ValueError("a job record's high mark is not above its devices")
        return cls(shape, body["high"])


@dataclass
class _Recovery:
    """A restart past lost devices or a gone node, from its detection to the new world's first step."""

    epoch: int
    what: str  # what was lost, in words
    detected_at: float
    restarted_at: float
    stopped: str = "the failed world's ranks stopped"  # how the old world ended, in words


class TitanRelayout:
    """One torchtitan job's executor inside each of its node agents (the leader speaks for the job)."""

    def __init__(self, job: str, open_bus: Callable[[], Any], telemetry: TelemetryPublisher | None,
                 min_nodes: int = 1, hosts_rendezvous: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.open_bus, self.telemetry, self.clock = job, open_bus, telemetry, clock
        self.min_nodes, self.hosts_rendezvous = min_nodes, hosts_rendezvous  # --nnodes' minimum; this node's role
        self.left_out = False  # an order left this node with no rank: its agent leaves the job
        self.shape: JobShape | None = None  # what the newest world runs (its rank 0's record)
        self.node_devices: tuple[int, ...] = ()  # this node's devices: its ranks' in the job's first round
        self.share: tuple[int, ...] = ()  # the devices this node's ranks run on now, by local rank
        self.first_rank = 0  # the world rank of this node's local rank 0, this round
        self.group_rank, self.group_world = 0, 1
        self.epoch = 0  # the plan epoch this round's world runs
        self.listener: CommandListener | None = None  # the leader's bus side
        self.flight: _InFlight | None = None  # the leader's command in flight
        self.order: RelayoutOrder | None = None  # the world every node restarts into next
        self.order_stopped: StepMark | None = None
        self.held_since: float | None = None  # this node's ranks exited; the stop mark not read yet
        self.expected_world = 0  # the world the next round was started for (0: the running one)
        self.recovery: _Recovery | None = None
        self.failed_at: float | None = None
        self.devices = LostDevices()
        self.env: dict[str, str] = {}
        self.probes_posted = 0  # probe numbers run from 1 per world; a new world's ranks start at 0 done
        self._shape_read = False  # this round's world said what it runs
        self._records: SignedStore | None = None
        self._job_records: SignedStore | None = None  # the job's own store, which outlives rounds
        self.high = 0  # one past every device the job has had (the leader's job record)
        self.grow_asked_at: float | None = None  # a node waits to join: when this agent first heard of it

    @property
    def leader(self) -> bool:
        return self.group_rank == 0

    @property
    def multi_node(self) -> bool:
        return self.group_world > 1

    # ---- what the agent asks -----------------------------------------------------------------------

    def initial_args(self, args: Sequence[str]) -> list[str]:
        """The job's own command line, with checkpointing on (a restart resumes from a checkpoint)."""
        if "--checkpoint.enable" in args or any(a.startswith("--checkpoint.enable=") for a in args):
            return list(args)
        return [*args, "--checkpoint.enable"]

    def worker_env(self) -> dict[str, str]:
        """Environment of the ranks the agent starts next (the devices and epoch of a new layout)."""
        return dict(self.env)

    def identity(self, rank: int) -> tuple[int, int]:
        """World rank ``rank``'s device and the plan epoch its world runs (heartbeats name devices)."""
        local = rank - self.first_rank
        if 0 <= local < len(self.share):
            return self.share[local], self.epoch
        if self.shape is not None and rank < len(self.shape.devices):
            return self.shape.devices[rank], self.epoch
        return rank, self.epoch

    def start_round(self, group_rank: int, group_world: int, ranks: Sequence[int], world: int,
                    records: SignedStore, job_records: SignedStore | None = None,
                    round_number: int = 0) -> Callable[[Sequence[str]], list[str]] | None:
        """A new rendezvous round, before this node's ranks start (``ranks``: their world ranks, by
        local rank; ``world``: the round's size; ``round_number``: the rendezvous round's). Says
        this node's devices to the others and returns the edit of the command line when the round
        is not the size its layout was meant for. ``job_records``: the job's store, signed for the
        job, where a node that joins a running job reads what it runs."""
        if group_world < self.group_world:  # a node is gone: the failures that ended the last round were its
            self.devices.forgive()
        self.group_rank, self.group_world, self.first_rank = group_rank, group_world, min(ranks, default=0)
        self.probes_posted, self._shape_read, self.order, self.order_stopped, self.held_since = 0, False, None, None, None
        self.grow_asked_at, self._job_records = None, job_records
        if not self.node_devices:
            joined = self._join(len(ranks)) if round_number > 0 else None
            self.node_devices = self.share = joined or tuple(ranks)
        records.set(NODE_KEY.format(group_rank=group_rank),
                    NodeRecord(tuple(self.devices.healthy(self.node_devices)), self.hosts_rendezvous).to_json())
        meant, self.expected_world = self.expected_world or (self.shape.layout.world if self.shape else 0), 0
        if self.shape is None or world == meant:
            return None
        return self._refit(world)

    def _join(self, local_world: int) -> tuple[int, ...] | None:
        """This agent's first round is not the job's: it joins a running job. Its devices are new
        numbers from the job record's ``high`` on, and it lays the round out from the record's
        shape as every other node does. None when the job keeps no record (it has not stepped)."""
        if self._job_records is None:
            return None
        record = self._job_records.read(SHAPE_KEY, JobRecord.parse)
        if record is None:
            return None
        claimed = self._job_records.store.add(JOINED_KEY.format(high=record.high), local_world) - local_world
        if claimed < 0:
            raise RuntimeError(f"the job's count of joined devices reads {claimed + local_world}, below what this "
                               f"node just claimed: the counter under {JOINED_KEY.format(high=record.high)!r} was "
                               "changed by someone else; refusing to pick devices that may be another node's")
        first = record.high + claimed
        self.shape, self.epoch, self.expected_world = record.shape, record.shape.epoch, -1
        devices = tuple(range(first, first + local_world))
        log.warning("torchtitan job %s: this node joins the running job (plan epoch %d, %d ranks) with devices %s",
                    self.job, record.shape.epoch, record.shape.layout.world, list(devices))
        return devices

    def _refit(self, world: int) -> Callable[[Sequence[str]], list[str]] | None:
        """A round of another size than its layout (a node gone, or one that lost a device): the
        uniform layout of exactly ``world`` ranks, the same on every node (the same shape, the same
        rule), from the last checkpoint, as the next plan epoch."""
        shape = self.shape
        assert shape is not None
        global_mb = shape.microbatches * shape.layout.batch
        layout = fallback_layout(shape.layout, world, global_mb, shape.num_layers, exact=True)
        if layout is None:
            log.error("torchtitan job %s: a round of %d ranks and no uniform layout of exactly that many keeps its "
                      "global batch of %d micro-batches; the ranks start at the old flags", self.job, world, global_mb)
            return None
        now = self.clock()
        self.epoch = max(self.epoch, shape.epoch) + 1
        self._set_env(self.share, self.epoch)
        if self.flight is not None:  # its order's world, plus or less a node, is not the plan it asked for
            self._fail(f"the round after the stop had {world} ranks, not the plan's {self.flight.layout.world} (a node "
                       f"joined or left); the job restarts at the uniform layout of exactly {world} ranks")
        grew = world > shape.layout.world
        self.recovery = _Recovery(self.epoch, f"a world of {shape.layout.world} ranks came back as {world}" +
                                  (" (a node joined)" if grew else ""),
                                  self.failed_at if self.failed_at is not None else now, now,
                                  "the ranks stopped after a step and saved, and the round formed" if grew else
                                  "the failed world's ranks stopped")
        extra = layout.flags(global_mb // layout.batch, shape.samples_per_microbatch)
        log.warning("torchtitan job %s: a round of %d ranks (was %d): restarting from its last checkpoint at pp %d, "
                    "dp %d, tp %d as plan epoch %d", self.job, world, shape.layout.world, layout.pp, layout.batch,
                    layout.tp, self.epoch)
        return lambda args: with_flags(args, extra)

    def _set_env(self, share: Sequence[int], epoch: int) -> None:
        """The ranks started next run on ``share`` (by local rank) in plan ``epoch``; on GPUs each
        sees its device by its index on this node."""
        self.share = tuple(share)
        self.env = {DEVICES_ENV: ",".join(str(d) for d in share), EPOCH_ENV: str(epoch),
                    "CUDA_VISIBLE_DEVICES": ",".join(str(self.node_devices.index(d)) for d in share)}

    def watch(self, records: SignedStore, all_exited_ok: bool, failed: Sequence[int] | None,
              relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """One monitor pass. ``records``: this round's ranks' store; ``failed``: None, or the world
        ranks whose failure ended the round; ``relaunch(local_world, edit_args)`` restarts this
        node's ranks. True when it restarted them, or holds them stopped for a restart to come
        (the agent carries on)."""
        self._records = records
        if not self._shape_read:
            self._read_shape(records)
        if self.shape is None:
            return False
        if failed is not None:
            self.probes_posted, self.failed_at = 0, self.clock()
            if self.flight is not None:
                self._fail("a rank failed before the new layout ran; the job restarts from its last checkpoint")
            return self._on_failure(failed, relaunch)
        if self.recovery is not None and self._shape_read:
            self._recovered(records)
        if self.flight is not None and self.flight.restarted_at:
            self._resumed(records)
        if self.leader and self.listener is not None and self.flight is None and self.order is None:
            command = self.listener.poll()
            self._post_probes(records)
            if command is not None:
                self._begin(command, records)
        return self._obey(records, all_exited_ok, relaunch)

    def restart_for_order(self, records: SignedStore,
                          relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """torch restarts this node's ranks because another node joined a new round: when that is
        an order's new world (the stop written), start this node's share of it instead."""
        if self.shape is None:
            return False
        return self._obey(records, True, relaunch, may_hold=False)

    def make_room(self, records: SignedStore) -> bool:
        """torch would restart the group now because a node waits to join the rendezvous: True
        while the ranks are asked to stop together first (the leader writes a stop order with no
        new world, command ``grow``), so no step since the last checkpoint is lost; the restart
        into the joiner's round follows their stop (:meth:`_obey`). False leaves it to torch (the
        job has not said what it runs yet)."""
        if self.shape is None or self.left_out:
            return False
        if self.grow_asked_at is None:
            self.grow_asked_at = self.clock()
            if self.leader and self.order is None:
                records.set(STOP_KEY, {"epoch": self.epoch + 1, "command": GROW_COMMAND})
                log.info("torchtitan job %s: a node waits to join; the ranks stop after their next step and save",
                         self.job)
        return True

    def _post_probes(self, records: SignedStore) -> None:
        """The probes the listener admitted since the last pass, for the ranks to run together."""
        assert self.listener is not None
        for request in self.listener.take_probes():
            self.probes_posted += 1
            records.set(PROBE_REQUEST_KEY.format(number=self.probes_posted), request.model_dump(mode="json"))
            records.set(PROBE_KEY, {"number": self.probes_posted})

    # ---- steps -----------------------------------------------------------------------------------------

    def _read_shape(self, records: SignedStore) -> None:
        """This round's world, as its rank 0 says it; the leader announces the job on its first."""
        shape = records.read(JOB_KEY, JobShape.parse, allowed=RANK_WRITERS)
        if shape is None or shape.epoch < self.epoch:
            return
        self.shape, self.epoch, self._shape_read = shape, shape.epoch, True
        if self.leader:
            self._keep_record(shape)
        if not self.leader or self.listener is not None:
            return
        plan = shape.plan()
        self.listener = CommandListener(self.job, plan, bus=self.open_bus, source="agent:torchtitan",
                                        check=self._refusal)
        if self.recovery is None:  # a leader that takes over in a restart announces it once it stepped
            self._announce("start" if shape.epoch == 0 else "restart")
        self.listener.announce_capabilities(TORCHTITAN_CAPABILITIES)
        log.info("torchtitan job %s runs %s", self.job, plan.shape())

    def _keep_record(self, shape: JobShape) -> None:
        """The leader's job record for nodes that join later: this shape, and the high mark."""
        if self._job_records is None:
            return
        kept = self._job_records.read(SHAPE_KEY, JobRecord.parse)
        self.high = max(self.high, kept.high if kept is not None else 0, max(shape.devices, default=-1) + 1,
                        max(self.node_devices, default=-1) + 1)
        self._job_records.set(SHAPE_KEY, JobRecord(shape, self.high).to_json())

    def _announce(self, reason: PlanCurrentReason) -> None:
        """``plan.current`` for the shape this world reported: the first announcement with what the
        planner needs to cost the job, later ones as the plan the job moved to."""
        assert self.listener is not None and self.shape is not None
        shape, plan = self.shape, self.shape.plan()
        if self.listener.announced:
            self.listener.adopt(plan, reason=reason)
            return
        self.listener.announce_plan(plan, reason=reason, gpus_per_node=max(1, len(self.node_devices)),
                                    model_name=shape.model, layer_state_bytes=shape.layer_state_bytes,
                                    tokens_per_microbatch=shape.tokens_per_microbatch)

    def _refusal(self, plan: Plan) -> str | None:
        assert self.shape is not None
        try:
            _, devices = layout_of(plan, self.shape.layout, self.listener.running if self.listener else None)
        except ValueError as exc:  # NotUniform, or a plan no grid can hold
            return str(exc)
        if not self.multi_node:
            return None
        nodes = self._nodes()
        if nodes is None:
            return "not every node of the job has said its devices this round"
        stray = sorted(set(devices) - {d for node in nodes.values() for d in node.devices})
        if stray:
            return f"devices {stray} are on no node of the job (or were lost)"
        empty = [g for g, node in sorted(nodes.items()) if not set(node.devices) & set(devices)]
        if not empty:
            return None
        if len(nodes) - len(empty) < self.min_nodes:
            return (f"plan epoch {plan.epoch} leaves node(s) {empty} with no rank, and the job runs on at least "
                    f"{self.min_nodes} node(s) (--nnodes)")
        hosts = [g for g in empty if nodes[g].hosts_rendezvous]
        if hosts:
            return (f"plan epoch {plan.epoch} leaves node(s) {hosts} with no rank, and node {hosts[0]} serves the "
                    "job's rendezvous (on etcd no node does)")
        return None

    def _nodes(self) -> dict[int, NodeRecord] | None:
        """What each node said of itself this round, by group rank (None until every node did)."""
        if self._records is None:
            return None
        keys = [NODE_KEY.format(group_rank=g) for g in range(self.group_world)]
        found = self._records.read_many(keys, NodeRecord.parse)
        if any(node is None for node in found):
            return None
        return {g: node for g, node in enumerate(found) if node is not None}

    def _begin(self, command: ReconfigureCommand, records: SignedStore) -> None:
        """The leader's side of a command: the new world's order, then the stop."""
        assert self.shape is not None and self.listener is not None
        layout, devices = layout_of(command.plan, self.shape.layout, self.listener.running)
        extra = layout.flags(command.plan.pipelines[0].microbatches, self.shape.samples_per_microbatch)
        self.order = RelayoutOrder(command.plan.epoch, command.command_id, tuple(devices), tuple(extra))
        self.flight = _InFlight(command, layout, self.clock())
        records.set(ORDER_KEY, self.order.to_json())
        records.set(STOP_KEY, {"epoch": command.plan.epoch, "command": command.command_id})
        log.info("torchtitan job %s: stop for epoch %d (%s)", self.job, command.plan.epoch, command.plan.shape())

    def _obey(self, records: SignedStore, all_exited_ok: bool,
              relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None], may_hold: bool = True) -> bool:
        """Every node's side of an order: once the world has stopped and this node's ranks are
        gone, start this node's share of the new world. True when it did, or (``may_hold``) while
        it waits for the stop mark with its ranks already exited."""
        now = self.clock()
        if self.order is None:
            order = records.read(ORDER_KEY, _layout_order)
            if order is None or order.epoch <= self.epoch:
                return self._grow(records, all_exited_ok, relaunch, may_hold)
            self.order = order
        order, flight = self.order, self.flight
        if self.order_stopped is None:
            mark = records.read(STOPPED_KEY, StepMark.parse, allowed=RANK_WRITERS)
            if mark is not None and mark.epoch == order.epoch:
                self.order_stopped = mark
                if flight is not None:
                    flight.stopped, flight.stopped_at = mark, now
        if self.order_stopped is None:
            if flight is not None and now - flight.asked_at > STOP_DEADLINE_S:
                self._fail(f"the job reached no step boundary in {STOP_DEADLINE_S:.0f} s; it runs on at the old layout")
                self.order = None
                return False
            if not all_exited_ok or not may_hold:
                return False
            self.held_since = self.held_since or now  # this node's ranks stopped before rank 0 said so
            return now - self.held_since < HOLD_S  # past that, they simply finished
        if not all_exited_ok:
            return False
        share = order.share(self.devices.healthy(self.node_devices))
        if not share:  # the new world runs without this node: its agent leaves the job
            log.warning("torchtitan job %s: plan epoch %d runs no rank on this node (devices %s); its agent leaves "
                        "the job", self.job, order.epoch, list(self.node_devices))
            self.left_out, self.order, self.epoch = True, None, order.epoch
            return True
        self._set_env(share, order.epoch)
        self.epoch, self.expected_world, self.order = order.epoch, len(order.devices), None
        if flight is not None:
            flight.restarted_at = self.clock()
        relaunch(len(share), lambda args: with_flags(args, order.flags))
        return True

    def _grow(self, records: SignedStore, all_exited_ok: bool,
              relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None], may_hold: bool) -> bool:
        """A stop with no new world (a node waits to join, :meth:`make_room`): once the ranks have
        stopped and exited, restart this node's share into the next round, which every node then
        lays out for its size (:meth:`start_round`). True when it did, or while it holds."""
        if not all_exited_ok:
            return False
        now = self.clock()
        mark = records.read(STOPPED_KEY, StepMark.parse, allowed=RANK_WRITERS)
        if mark is None or mark.epoch <= self.epoch:
            stop = records.read(STOP_KEY, StopOrder.parse)
            if stop is None or stop.epoch <= self.epoch or not may_hold:
                return False
            self.held_since = self.held_since or now  # the ranks stopped before rank 0's mark was read
            return now - self.held_since < HOLD_S
        log.info("torchtitan job %s: stopped after step %d for a joining node; restarting into its round",
                 self.job, mark.step)
        self.failed_at = self.grow_asked_at if self.grow_asked_at is not None else now
        self.expected_world = -1  # whatever size the next round has, lay it out again
        relaunch(len(self.share), list)
        return True

    def _resumed(self, records: SignedStore) -> None:
        """The leader's command: the new world's first step acknowledges it."""
        flight = self.flight
        assert flight is not None
        mark = records.read(RESUMED_KEY, StepMark.parse, allowed=RANK_WRITERS)
        now = self.clock()
        if mark is not None and mark.epoch == flight.command.plan.epoch:
            self._applied(flight, mark, now)
        elif now - flight.restarted_at > RESUME_DEADLINE_S:
            self._fail(f"the new world did not step within {RESUME_DEADLINE_S:.0f} s")

    def _applied(self, flight: _InFlight, mark: StepMark, now: float) -> None:
        assert self.listener is not None
        pause_s = now - flight.asked_at
        stopped = flight.stopped or StepMark(mark.epoch, mark.step)
        self.listener.ack_applied(flight.command, pause_s,
                                  detail=f"restarted at {flight.layout.world} ranks (pp {flight.layout.pp}, "
                                         f"dp {flight.layout.batch}, tp {flight.layout.tp}) from the checkpoint of "
                                         f"step {stopped.step}")
        self._phases(flight, mark, now)
        self.flight = None

    def _phases(self, flight: _InFlight, mark: StepMark, now: float) -> None:
        """The pause as the agent saw it: stop agreed and saved, new world started, first step."""
        if self.telemetry is None:
            return
        epoch, step = flight.command.plan.epoch, mark.step
        spans = [(ReshapePhaseName.EXPORT, flight.stopped_at - flight.asked_at,
                  "every rank stopped after the same step and saved its DCP checkpoint"),
                 (ReshapePhaseName.NEW_MESH, flight.restarted_at - flight.stopped_at, "the old world's ranks exited"),
                 (ReshapePhaseName.FIRST_STEP, now - flight.restarted_at,
                  f"new world of {flight.layout.world} ranks started, loaded the checkpoint (resharded) and stepped")]
        for phase, seconds, detail in spans:
            self.telemetry.publish(ReshapePhase(executor="torchtitan", epoch=epoch, iteration=step, rank=0,
                                                phase=phase, duration_s=max(0.0, seconds), detail=detail))

    # ---- fail-stop -------------------------------------------------------------------------------------

    def _on_failure(self, failed: Sequence[int], relaunch: Callable[[int, Callable[[Sequence[str]], list[str]]], None]) -> bool:
        """A round ended by the ranks ``failed``: leave the restart to torch (same layout, last
        checkpoint) unless a device of this node is now judged lost; then restart past it — on one
        node at the layout of the devices left, across nodes with this node's share less the lost
        device (the round that follows is laid out by :meth:`start_round`). True when restarted."""
        assert self.shape is not None
        self.recovery, self.order, self.order_stopped = None, None, None  # a world that failed never resumed
        lost = self.devices.failed(self.identity(r)[0] for r in failed)
        if not lost:
            return False
        shape = self.shape
        if self.multi_node:
            share = [d for d in self.share if d not in lost]
            log.warning("torchtitan job %s lost device(s) %s: this node restarts on %s; the round that follows is "
                        "laid out for the devices every node has left", self.job, sorted(lost), share)
            self.expected_world = -1  # whatever size the next round has, lay it out again
            self._set_env(share, self.epoch)
            relaunch(len(share), list)
            return True
        healthy = self.devices.healthy(shape.devices)
        global_mb = shape.microbatches * shape.layout.batch
        layout = fallback_layout(shape.layout, len(healthy), global_mb, shape.num_layers)
        if layout is None:
            log.error("torchtitan job %s lost devices %s and no uniform layout fits the %d left; torch's restarts "
                      "go on at the old layout", self.job, sorted(self.devices.lost), len(healthy))
            return False
        devices = healthy[:layout.world]
        self.epoch = max(shape.epoch, self.listener.running.epoch if self.listener else 0) + 1
        self._set_env(devices, self.epoch)
        self.expected_world = layout.world
        extra = layout.flags(global_mb // layout.batch, shape.samples_per_microbatch)
        log.warning("torchtitan job %s lost device(s) %s: restarting from its last checkpoint at %d ranks "
                    "(pp %d, dp %d, tp %d) on devices %s", self.job, sorted(lost), layout.world, layout.pp,
                    layout.batch, layout.tp, ",".join(str(d) for d in devices))
        now = self.clock()
        self.recovery = _Recovery(self.epoch, f"device(s) {', '.join(str(d) for d in sorted(lost))} judged lost",
                                  now, now)
        relaunch(layout.world, lambda args: with_flags(args, extra))
        return True

    def _recovered(self, records: SignedStore) -> None:
        """The world restarted past lost devices or a gone node has stepped: the leader says it runs
        the new plan."""
        recovery = self.recovery
        assert recovery is not None and self.shape is not None
        mark = records.read(RESUMED_KEY, StepMark.parse, allowed=RANK_WRITERS)
        if mark is None or mark.epoch != recovery.epoch:
            return
        now = self.clock()
        self.recovery, self.failed_at = None, None
        if not self.leader or self.listener is None:
            return
        self._announce("restart")
        log.info("torchtitan job %s runs %s since step %d (%s)", self.job, self.shape.plan().shape(), mark.step,
                 recovery.what)
        if self.telemetry is None:
            return
        for phase, seconds, detail in (
                (ReshapePhaseName.NEW_MESH, recovery.restarted_at - recovery.detected_at,
                 f"{recovery.what}; {recovery.stopped}"),
                (ReshapePhaseName.FIRST_STEP, now - recovery.restarted_at,
                 f"new world of {self.shape.layout.world} ranks started, loaded the last checkpoint (resharded) "
                 f"and stepped")):
            self.telemetry.publish(ReshapePhase(executor="torchtitan", epoch=recovery.epoch, iteration=mark.step,
                                                rank=0, phase=phase, duration_s=max(0.0, seconds), detail=detail))

    def _fail(self, why: str) -> None:
        assert self.flight is not None and self.listener is not None
        self.listener.ack_failed(self.flight.command, why)
        log.warning("torchtitan job %s: command %s failed: %s", self.job, self.flight.command.command_id, why)
        self.flight = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def _layout_order(body: Any) -> RelayoutOrder:
    """A leader's order as a torchtitan node obeys it: its flags change the layout and nothing else
    (refused, and reported, otherwise)."""
    order = RelayoutOrder.parse(body)
    layout_flags(order.flags)
    return order
