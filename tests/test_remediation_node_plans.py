"""Node plans: the engine blames a node, scores its exclusion against in-job reshapes, and orders
its stop once the layout without it is applied (remediation/node_plans.py, the engine, the folds)."""

from __future__ import annotations

from pathlib import Path

from collector import topics
from collector.embedded import EmbeddedBus
from collector.epoch_fence import COMMAND_TTL_S
from collector.events import (
    AckStatus, CommandAck, Evidence, ExecutorCapabilities, FaultCategory, IncidentOpened, IterationPrediction, Location, NodeCommand,
    NodeCommandAck, NodeSpare, PolicyChanged, PolicyMode, Severity,
)
from collector.plan import Plan
from collector.plan_lifecycle import PlanLifecycle, fold
from collector.stream import EventStream
from remediation.cluster import ClusterState, DeviceState, Hardware
from remediation.engine import EngineConfig, RemediationEngine
from remediation.lifecycle import PlanStatus
from remediation.model import PlannerModel
from remediation.node_plans import NodeSettings, blamed_nodes, choose, without_nodes
from remediation.plan_result import PlanResult
from tests.fixtures.signing import Authors

JOB = "nodes"
RUN = "job-42"
HW = Hardware(devices_per_node=4)
PLAN = Plan.uniform(tp=2, pp=2, dp=4, num_layers=8, microbatches_per_replica=4)  # devices 0-15: nodes 0-3


def _incident(incident_id: str, category: FaultCategory, locations: list[Location]) -> IncidentOpened:
    return IncidentOpened(incident_id=incident_id, category=category, severity=Severity.HIGH, iteration=5,
                          locations=locations, evidence=Evidence(), summary=incident_id)


def _engine(bus: EmbeddedBus, run: str | None = RUN, auto: bool = True) -> RemediationEngine:
    if auto:
        bus.publish([Authors(JOB, "operator").make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="cli:test"))])
    config = EngineConfig(job=JOB, num_devices=16, hardware=HW, nodes=NodeSettings(run=run, round=3))
    return RemediationEngine(bus, config, PlannerModel.uniform(8), PLAN)


def _result(plan: Plan, horizon_tokens: float) -> PlanResult:
    return PlanResult(plan=plan, strategy="ours", changed=True, iteration_s=1.0, predicted_tokens_per_s=1.0,
                      current_tokens_per_s=1.0, reshape_cost_s=0.0, horizon_tokens=horizon_tokens)


# ---- blame and choice, no bus -------------------------------------------------------------------


def test_a_node_is_blamed_for_several_bad_devices_never_for_one_or_for_a_link() -> None:
    cluster = ClusterState(16, HW).with_device(5, DeviceState(compute_factor=2.0))
    assert blamed_nodes(cluster, PLAN, 2) == {}
    cluster = cluster.with_device(6, DeviceState(link_factor=3.0)).with_link(0, 12, 4.0)
    assert list(blamed_nodes(cluster, PLAN, 2)) == [1]
    assert "5 slow ×2.00" in blamed_nodes(cluster, PLAN, 2)[1] and "6 NIC ×3.00" in blamed_nodes(cluster, PLAN, 2)[1]
    # a node location kills every device of the node; a node the plan does not use is nobody's concern
    dead = ClusterState(16, HW).with_location(Location(target="node", node=2), FaultCategory.FAIL_STOP)
    assert "4 of its 4 devices are bad" in blamed_nodes(dead, PLAN, 2)[2]
    unused = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=8)  # devices 0-7
    assert blamed_nodes(dead, unused, 2) == {}


def test_the_exclusion_wins_only_when_no_plan_keeping_the_node_trains_more() -> None:
    keeps, leaves = PLAN, Plan.uniform(tp=2, pp=2, dp=3, num_layers=8, microbatches_per_replica=4)  # 0-11
    node3 = set(range(12, 16))
    in_job_leaves = _result(leaves, 100.0)
    assert choose(in_job_leaves, None, node3) is in_job_leaves  # the in-job winner already leaves it idle
    assert choose(_result(keeps, 100.0), _result(leaves, 99.0), node3) is None  # keeping it trains more
    excluded = _result(leaves, 101.0)
    assert choose(_result(keeps, 100.0), excluded, node3) is excluded
    assert choose(None, excluded, node3) is excluded  # nothing in-job is worth applying; the exclusion is
    assert choose(None, None, node3) is None
    cluster = without_nodes(ClusterState(16, HW), [3])
    assert cluster.dead_devices() == node3


# ---- the engine over the embedded bus -----------------------------------------------------------


def test_a_dead_node_is_excluded_and_stopped_once_the_layout_runs_without_it(tmp_path: Path) -> None:
    """A node fail-stop under the auto policy: one poll proposes the layout without the node with
    its stop order, decides and commands it; the stop goes out only after the trainer's applied
    ack, and the agent's applied ack makes its ranks known dead, so no roll-back can use them."""
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        prop = record.proposal
        assert record.status == PlanStatus.COMMANDED
        assert not set(range(4, 8)) & set(prop.plan.devices)
        (order,) = prop.node_orders
        assert (order.node, order.action, order.round, order.run, order.devices) == (1, "stop", 3, RUN, [4, 5, 6, 7])
        assert prop.diff[0].startswith("stop node 1 (devices 4–7, rendezvous round 3) once the plan runs")
        assert not record.node_commands  # not before the layout runs

        bus.publish([trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1))])
        engine.poll_once()
        (command,) = record.node_commands.values()
        assert isinstance(command, NodeCommand) and command.command_id == order.command_id
        assert (command.node, command.action, command.round, command.run) == (1, "stop", 3, RUN)
        assert command.expires_at_s is not None and command.expires_at_s - engine.clock_s == COMMAND_TTL_S
        assert record.node_order_state(order.command_id) == "commanded"

        bus.publish([trainer.make(NodeCommandAck(command_id=order.command_id, node=1, action="stop", round=3,
                                                 status=AckStatus.APPLIED, running_round=3, ranks=[4, 5, 6, 7]))])
        engine.poll_once()
        assert record.node_order_state(order.command_id) == "applied"
        assert {4, 5, 6, 7} <= engine.state.known_dead and engine.state.node_round == 3
        assert len(engine.state.plans) == 1  # the stop changes no layout: nothing to plan
        engine.close()


def test_a_waiting_spare_is_ordered_into_the_stopped_nodes_place_and_its_join_returns_the_ranks(
        tmp_path: Path) -> None:
    """Spares say they wait (``node.spare``): the node plan joins the oldest one that fits (this
    run, the node's number of ranks, a claim not stale) into the stopped node's place; its order is
    issued with the stop once the layout runs and names that spare, and the spare's applied ack
    makes the ranks alive again and the spare no longer waiting. Spares of another run, of another
    size, stale, or that stopped waiting are never named."""
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)

        def spare(name: str, **kw: object) -> NodeSpare:
            return NodeSpare.model_validate({"spare": name, "run": RUN, "ranks": 4, "waiting": True,
                                             "expires_at_s": 4e9, **kw})

        bus.publish([Authors(JOB, name).make(p) for name, p in (
            ("agent-other-run", spare("agent-other-run", run="job-7")), ("agent-two", spare("agent-two", ranks=2)),
            ("agent-stale", spare("agent-stale", expires_at_s=1.0)), ("agent-gone", spare("agent-gone")),
            ("agent-gone", spare("agent-gone", waiting=False, expires_at_s=None)),
            ("agent-spare", spare("agent-spare")), ("agent-later", spare("agent-later")))])
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        stop, join = record.proposal.node_orders
        assert (stop.action, join.action, join.node, join.round, join.run, join.spare) == (
            "stop", "join", 1, 3, RUN, "agent-spare")
        assert join.devices == [4, 5, 6, 7]
        assert record.proposal.diff[1].startswith("join spare agent-spare into node 1's place (devices 4–7")
        assert engine.state.waiting_spares(RUN, 4, engine.clock_s) == ["agent-later"]  # one spare per place

        bus.publish([trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1))])
        engine.poll_once()
        commands = record.node_commands
        assert [(c.action, c.spare) for c in commands.values() if isinstance(c, NodeCommand)] == [
            ("stop", None), ("join", "agent-spare")]
        bus.publish([trainer.make(NodeCommandAck(command_id=stop.command_id, node=1, action="stop", round=3,
                                                 status=AckStatus.APPLIED, running_round=3, ranks=[4, 5, 6, 7]))])
        engine.poll_once()
        assert {4, 5, 6, 7} <= engine.state.known_dead
        bus.publish([Authors(JOB, "agent-spare").make(NodeCommandAck(
            command_id=join.command_id, node=1, action="join", round=3, status=AckStatus.APPLIED, running_round=3,
            ranks=[4, 5, 6, 7]))])
        engine.poll_once()
        assert record.node_order_state(join.command_id) == "applied"
        assert not {4, 5, 6, 7} & engine.state.known_dead and "agent-spare" not in engine.state.spares
        # the incident named the machine that left: the spare's node is not planned around again
        assert engine.state.open_incidents() and not engine.state.current_incidents()
        assert len(engine.state.plans) == 1
        engine.close()


def test_a_job_whose_devices_leave_only_with_their_node_gets_the_stop_with_the_command(tmp_path: Path) -> None:
    """A shrinking data-parallel world (``leaves_by_node_stop``) changes its layout by the node's
    stop, which drains the node's ranks: the orders go out with the command (every reader's fold
    takes them there without a report), and a plan leaving out devices of a node it does not
    stop is refused with why."""
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    dp = Plan.uniform(tp=1, pp=1, dp=16, num_layers=8, microbatches_per_replica=1)
    caps = ExecutorCapabilities(executor="shrink", tp_shrink="no", tp_exclusion=False, pp_repartition="no",
                                spares=False, leaves_by_node_stop=True)
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish([Authors(JOB, "operator").make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=[Severity.HIGH], actor="cli:test")), trainer.make(caps)])
        config = EngineConfig(job=JOB, num_devices=16, hardware=HW, nodes=NodeSettings(run=RUN, round=3))
        engine = RemediationEngine(bus, config, PlannerModel.uniform(8), dp)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert record.status == PlanStatus.COMMANDED
        (order,) = record.proposal.node_orders
        assert order.with_command and list(record.node_commands) == [order.command_id]  # before any ack
        events = [d.event for d in EventStream(bus, "reader", [topics.CONTROL],
                                               on_assign=lambda ps: {tp: 0 for tp in ps}).poll(timeout_s=0.2)]
        assert not fold(events, PlanLifecycle(job=JOB)).reports
        engine.close()
    with EmbeddedBus(tmp_path / "bus-one.sqlite") as bus:  # one slow device: its node is not blamed
        bus.publish([trainer.make(caps)])
        engine = RemediationEngine(bus, config, PlannerModel.uniform(8), dp)
        bus.publish([analytics.make(_incident("s2", FaultCategory.FAIL_SLOW, [
            Location(target="compute", rank=2, factor=30.0, measure="compute")]))])
        engine.poll_once()
        assert not engine.state.plans
        assert any("leaves devices [2] out, but the job's devices leave only with their node" in r
                   for r in engine.refusals), engine.refusals
        engine.close()


def test_slow_ranks_on_one_node_get_a_node_plan_only_when_no_plan_keeping_some_of_them_trains_more(
        tmp_path: Path) -> None:
    """Every GPU of node 2 at ×20: the best plan leaves the node idle, so it comes with the node's
    stop. Two of its GPUs at ×50: the best plan keeps their TP peers, so it stops nothing and says
    why. Under the propose policy nothing is commanded."""
    analytics = Authors(JOB, "analytics")
    for ranks, factor, stopped in (((8, 9, 10, 11), 20.0, [2]), ((8, 10), 50.0, [])):
        with EmbeddedBus(tmp_path / f"bus-{len(ranks)}.sqlite") as bus:
            engine = _engine(bus, auto=False)
            bus.publish([analytics.make(_incident(f"s{r}", FaultCategory.FAIL_SLOW, [
                Location(target="compute", rank=r, factor=factor, measure="compute")])) for r in ranks])
            engine.poll_once()
            (record,) = engine.state.plans.values()
            assert [o.node for o in record.proposal.node_orders] == stopped
            assert record.status == PlanStatus.PROPOSED and not record.node_commands
            kept = [r for r in engine.refusals if "trains more over the horizon: no node is stopped" in r]
            assert bool(kept) == (not stopped)
            if stopped:
                assert not set(range(8, 12)) & set(record.proposal.plan.devices)
            engine.close()


def test_without_the_jobs_rendezvous_id_a_blamed_node_is_reported_and_planned_in_job(tmp_path: Path) -> None:
    analytics = Authors(JOB, "analytics")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus, run=None, auto=False)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert not record.proposal.node_orders and not set(range(4, 8)) & set(record.proposal.plan.devices)
        assert any("node 1 is blamed" in r and "--node-run" in r for r in engine.refusals)
        engine.close()


def test_a_stop_the_agent_refuses_is_published_and_leaves_the_devices_planned_around(tmp_path: Path) -> None:
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        bus.publish([trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1))])
        engine.poll_once()
        (order,) = record.proposal.node_orders
        bus.publish([trainer.make(NodeCommandAck(
            command_id=order.command_id, node=1, action="stop", round=3, status=AckStatus.IGNORED_STALE,
            running_round=4, detail="names rendezvous round 3, but the job is in round 4"))])
        engine.poll_once()
        assert record.node_order_state(order.command_id) == "ignored_stale"
        assert engine.state.node_round == 4 and record.status == PlanStatus.APPLIED
        assert any("was not obeyed (ignored_stale" in r for r in engine.refusals)
        engine.close()


def test_the_plan_fold_keeps_a_node_plans_orders_and_answers_and_ignores_an_operators(tmp_path: Path) -> None:
    """Every reader's fold (collector/plan_lifecycle.py) puts the order and its ack on the plan
    record; an operator's own ``resihp node stop`` (no plan names it) moves no plan."""
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        ack = trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                      status=AckStatus.APPLIED, running_epoch=1))
        bus.publish([ack])
        engine.poll_once()
        (order,) = record.proposal.node_orders
        node_ack = trainer.make(NodeCommandAck(command_id=order.command_id, node=1, action="stop", round=3,
                                               status=AckStatus.APPLIED, running_round=3, ranks=[4, 5, 6, 7]))
        operator = Authors(JOB, "cli:alice").make(NodeCommand(command_id="by-hand", node=2, action="stop", round=3,
                                                               run=RUN, expires_at_s=1e9))
        stream = EventStream(bus, "reader", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
        events = [d.event for d in stream.poll(timeout_s=0.2)]
        stream.close()
        engine.close()
    state = fold(events + [node_ack, operator], PlanLifecycle(job=JOB))
    seen = state.plans[record.plan_id]
    assert seen.status == PlanStatus.APPLIED and list(seen.node_commands) == [order.command_id]
    assert seen.node_order_state(order.command_id) == "applied"
    assert "by-hand" not in state.node_orders and not any("by-hand" in r.message for r in state.reports)


def test_an_in_job_proposal_writes_no_node_orders_so_older_signatures_still_cover_its_bytes() -> None:
    from collector.events import NodeOrder, PlanProposed

    fields = dict(plan_id="p", incident_ids=[], strategy="ours", base_epoch=0, plan=PLAN, current_tokens_per_s=1.0,
                  predicted_tokens_per_s=2.0, reshape_cost_s=0.0, diff=[])
    assert "node_orders" not in PlanProposed(**fields).model_dump(mode="json")
    order = NodeOrder(command_id="c", node=1, action="stop", round=0, run=RUN, devices=[4, 5])
    again = PlanProposed.model_validate_json(PlanProposed(**fields, node_orders=[order]).model_dump_json())
    assert again.node_orders == [order]


def test_resihp_remediate_turns_node_plans_on_with_the_jobs_rendezvous_id(tmp_path: Path) -> None:
    from collector.events import PlanProposed
    from resihp.cli import main

    path = tmp_path / "bus.sqlite"
    flags = ["--bus", "embedded", "--bus-path", str(path), "--job", JOB]
    layout = ["--tp", "2", "--pp", "2", "--dp", "4", "--layers", "8", "--microbatches", "4", "--devices-per-node", "4"]
    assert main(["remediate", *flags, *layout, "--node-round", "-1"]) == 2
    with EmbeddedBus(path) as bus:
        bus.publish([Authors(JOB, "analytics").make(
            _incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
    assert main(["remediate", *flags, *layout, "--node-run", RUN, "--node-round", "2", "--exit-when-idle", "0.3"]) == 0
    with EmbeddedBus(path) as bus:
        stream = EventStream(bus, "reader", [topics.CONTROL], on_assign=lambda ps: {tp: 0 for tp in ps})
        (proposal,) = [d.event.payload for d in stream.poll(timeout_s=0.2) if isinstance(d.event.payload, PlanProposed)]
        stream.close()
    assert [(o.node, o.round, o.run) for o in proposal.node_orders] == [(1, 2, RUN)]


def test_the_console_shows_a_node_plans_orders_as_they_go(tmp_path: Path) -> None:
    from ui.read_model import ReadModel

    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    model = ReadModel()

    def control(bus: EmbeddedBus) -> None:
        stream = EventStream(bus, f"console-{len(model.plans)}", [topics.CONTROL, topics.ANALYTICS],
                             on_assign=lambda ps: {tp: 0 for tp in ps})
        for d in stream.poll(timeout_s=0.2):
            model.apply(d.event)
        stream.close()

    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        engine = _engine(bus)
        bus.publish([analytics.make(_incident("n1", FaultCategory.FAIL_STOP, [Location(target="node", node=1)]))])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        control(bus)
        assert model.plans[record.plan_id].node_orders == ["stop node 1 (rendezvous round 3): waiting for the plan "
                                                           "to be applied"]
        (order,) = record.proposal.node_orders
        bus.publish([trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1)),
                     trainer.make(NodeCommandAck(command_id=order.command_id, node=1, action="stop", round=3,
                                                 status=AckStatus.APPLIED, running_round=3, ranks=[4, 5, 6, 7],
                                                 detail="node 1 stopped its ranks [4, 5, 6, 7]"))])
        engine.poll_once()
        control(bus)
        engine.close()
    assert model.plans[record.plan_id].node_orders == [
        "stop node 1 (rendezvous round 3): applied — node 1 stopped its ranks [4, 5, 6, 7]"]


def test_a_node_plan_short_of_its_prediction_is_kept_once_its_stop_is_ordered(tmp_path: Path) -> None:
    """The layout before it used the node: once the stop is out, that layout cannot run again, so
    a shortfall keeps the plan (and says why) instead of rolling back onto a leaving node."""
    analytics, trainer = Authors(JOB, "analytics"), Authors(JOB, "trainer")
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        bus.publish([analytics.make(IterationPrediction(epoch=0, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                        tokens=1_000)) for i in range(5)])
        engine = _engine(bus)
        bus.publish([analytics.make(_incident(f"s{r}", FaultCategory.FAIL_SLOW, [
            Location(target="compute", rank=r, factor=20.0, measure="compute")])) for r in (8, 9, 10, 11)])
        bus.publish([analytics.make(IterationPrediction(epoch=0, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                        tokens=100)) for i in range(6, 12)])
        engine.poll_once()
        (record,) = engine.state.plans.values()
        assert [o.node for o in record.proposal.node_orders] == [2] and record.status == PlanStatus.COMMANDED
        bus.publish([trainer.make(CommandAck(command_id=record.command_id or "", plan_id=record.plan_id, epoch=1,
                                             status=AckStatus.APPLIED, running_epoch=1))])
        engine.poll_once()
        assert record.node_commands  # ordered; no ack yet
        bus.publish([analytics.make(IterationPrediction(epoch=1, iteration=i, observed_s=1.0, predicted_s=1.0,
                                                        tokens=101)) for i in range(20, 27)])  # no gain measured
        engine.poll_once()
        engine.poll_once()
        assert record.status == PlanStatus.VERIFIED and len(engine.state.plans) == 1
        assert any(f"plan {record.plan_id} fell short" in r for r in engine.refusals)
        engine.close()
