"""A realistic event sequence for one job, built only from the contract (collector.events).

The console is built against the contract, not against the detector, planner or simulator, which
are written elsewhere. This module plays all of them at once so that tests, screenshots and the
responsiveness benchmark have something true-to-shape to show: per-rank telemetry with packed
sequence lengths, the detector's predictions and rank health, an incident that is opened and
confirmed, a proposed plan, and — when asked — the rest of the lifecycle (decision, command,
acknowledgement, verification).

Nothing here is a model of training performance; it is a picture of one, good enough to draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from collector.events import (
    AckStatus, Chunk, ChunkKind, CommandAck, Coords, Envelope, EventFactory, Evidence, FaultCategory,
    FaultInjected, IncidentConfirmed, IncidentOpened, IncidentResolved, IterationPrediction, Location,
    PlanDecision, PlanProposed, PlanVerified, RankHealth, RankHealthEntry, RankIteration, RankState,
    ReconfigureCommand, Severity,
)
from collector.plan import PipelinePlan, Plan, StagePlan

T0_S = 1_700_000_000.0


@dataclass(frozen=True)
class DemoSpec:
    """What to generate. ``lifecycle``: 'proposed' stops with a pending plan; 'verified' goes on."""

    job: str = "demo"
    tp: int = 2
    pp: int = 2
    dp: int = 2
    num_layers: int = 8
    microbatches_per_replica: int = 4
    iterations: int = 120
    telemetry_iterations: int | None = None  # per-rank telemetry for the last N iterations only
    fault_rank: int = 5
    fault_factor: float = 2.0
    fault_at: int = 60
    iteration_s: float = 1.5
    gpus_per_node: int = 8
    lifecycle: str = "proposed"
    seed: int = 0


def degraded_plan(plan: Plan, slow_device: int) -> tuple[Plan, list[str]]:
    """Drop ``slow_device`` from its TP group (halving it) and move micro-batches off its replica."""
    role = plan.role_of(slow_device)
    pipelines = []
    diff: list[str] = []
    moved = max(1, plan.pipelines[role.replica].microbatches // 4)
    for pipe in plan.pipelines:
        stages = []
        for s, stage in enumerate(pipe.stages):
            if pipe.replica == role.replica and s == role.stage:
                keep = tuple(d for d in stage.devices if d != slow_device)[: max(1, stage.tp // 2)]
                diff.append(f"replica {pipe.replica} stage {s}: TP{stage.tp} → TP{len(keep)} (drops device {slow_device})")
                stage = StagePlan(devices=keep, first_layer=stage.first_layer, end_layer=stage.end_layer)
            stages.append(stage)
        mbs = pipe.microbatches
        if pipe.replica == role.replica:
            mbs -= moved
        elif pipe.replica == (role.replica + 1) % plan.dp:
            mbs += moved
        if mbs != pipe.microbatches:
            diff.append(f"replica {pipe.replica}: {pipe.microbatches} → {mbs} micro-batches")
        pipelines.append(PipelinePlan(replica=pipe.replica, microbatches=mbs, stages=tuple(stages)))
    new = Plan(epoch=plan.epoch + 1, schedule=plan.schedule, num_layers=plan.num_layers, pipelines=tuple(pipelines))
    return new, diff


def demo_events(spec: DemoSpec = DemoSpec()) -> list[Envelope]:
    """The whole sequence, in publication order (times increase)."""
    rng = random.Random(spec.seed)
    plan = Plan.uniform(tp=spec.tp, pp=spec.pp, dp=spec.dp, num_layers=spec.num_layers,
                        microbatches_per_replica=spec.microbatches_per_replica)
    new_plan, diff = degraded_plan(plan, spec.fault_rank)
    ranks = {d: EventFactory(spec.job, f"rank-{d}") for d in plan.devices}
    analytics = EventFactory(spec.job, "analytics")
    planner = EventFactory(spec.job, "remediation")
    trainer = EventFactory(spec.job, "trainer")
    truth = EventFactory(spec.job, "simulator")
    out: list[Envelope] = []
    incident_id = f"inc-{spec.job}-{spec.fault_at}"
    plan_id = f"plan-{spec.job}-{spec.fault_at}"
    detect_at = spec.fault_at + 3
    confirm_at = spec.fault_at + 6
    propose_at = spec.fault_at + 8
    apply_at = spec.fault_at + 12 if spec.lifecycle != "proposed" else None
    telemetry_from = 0 if spec.telemetry_iterations is None else spec.iterations - spec.telemetry_iterations
    tokens_per_mb = 4096
    current = plan

    for it in range(spec.iterations):
        t = T0_S + it * spec.iteration_s
        if apply_at is not None and it == apply_at:
            current = new_plan
        faulty = it >= spec.fault_at and spec.fault_rank in current.roles
        seq_batches = [[rng.choice((128, 256, 512, 1024, 2048)) for _ in range(rng.randint(2, 6))]
                       for _ in range(current.global_microbatches)]
        if it == spec.fault_at:
            loc = Location(target="compute", rank=spec.fault_rank, factor=spec.fault_factor)
            out.append(truth.make(FaultInjected(fault_id=f"f-{spec.fault_at}", category=FaultCategory.FAIL_SLOW,
                                                location=loc, start_iteration=it), time_s=t))
        if it >= telemetry_from:
            mb0 = 0
            for pipe in current.pipelines:
                for s, stage in enumerate(pipe.stages):
                    for tpr, d in enumerate(stage.devices):
                        factor = spec.fault_factor if (faulty and d == spec.fault_rank) else 1.0
                        chunks = []
                        start = 0.0
                        for m in range(pipe.microbatches):
                            lens = seq_batches[(mb0 + m) % len(seq_batches)]
                            base = (1e-5 * sum(lens) + 2e-9 * sum(x * x for x in lens) + 0.002) * factor
                            base *= stage.num_layers * spec.pp / plan.num_layers
                            base *= 2 / stage.tp * rng.uniform(0.97, 1.03)
                            for kind, mult in ((ChunkKind.FORWARD, 1.0), (ChunkKind.BACKWARD, 2.0)):
                                chunks.append(Chunk(kind=kind, microbatch=m, tokens=sum(lens), seq_lens=lens,
                                                    start_s=start, duration_s=base * mult))
                                start += base * mult
                        out.append(ranks[d].make(RankIteration(
                            epoch=current.epoch, iteration=it, rank=d, node=d // spec.gpus_per_node,
                            coords=Coords(tp=tpr, pp=s, dp=pipe.replica), wall_s=spec.iteration_s,
                            chunks=chunks), time_s=t))
                mb0 += pipe.microbatches
        tokens = tokens_per_mb * current.global_microbatches
        predicted = spec.iteration_s * (1.0 if current is plan else 1.08)
        slow = spec.fault_factor if (faulty and current is plan) else (1.08 if current is not plan else 1.0)
        observed = spec.iteration_s * slow * rng.uniform(0.97, 1.03)
        out.append(analytics.make(IterationPrediction(
            epoch=current.epoch, iteration=it, observed_s=observed, predicted_s=predicted, tokens=tokens,
            model_error=0.03), time_s=t + 0.1))

        if it == detect_at:
            out.append(analytics.make(RankHealth(epoch=0, iteration=it, ranks=[
                RankHealthEntry(rank=spec.fault_rank, state=RankState.SLOW, factor=spec.fault_factor)]), time_s=t + 0.2))
            window = list(range(max(0, it - 20), it + 1))
            evidence = Evidence(
                iterations=window,
                observed_s=[spec.iteration_s * (spec.fault_factor if i >= spec.fault_at else 1.0) for i in window],
                predicted_s=[spec.iteration_s for _ in window],
                rank_factors={d: (spec.fault_factor if d == spec.fault_rank else 1.0) for d in plan.devices},
                statistic="CUSUM on observed/predicted", note="sequence lengths explain < 5% of the gap")
            out.append(analytics.make(IncidentOpened(
                incident_id=incident_id, category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH, iteration=it,
                locations=[Location(target="compute", rank=spec.fault_rank, factor=spec.fault_factor,
                                    replica=plan.role_of(spec.fault_rank).replica,
                                    stage=plan.role_of(spec.fault_rank).stage, confidence=0.9)],
                evidence=evidence,
                summary=f"rank {spec.fault_rank} runs {spec.fault_factor:.1f}× slower than predicted"), time_s=t + 0.3))
        if it == confirm_at:
            out.append(analytics.make(IncidentConfirmed(
                incident_id=incident_id, method="persistence",
                detail=f"slowdown persisted {confirm_at - detect_at} iterations"), time_s=t + 0.3))
        if it == propose_at:
            healthy_tps = tokens / spec.iteration_s
            out.append(planner.make(PlanProposed(
                plan_id=plan_id, incident_ids=[incident_id], strategy="resihp-joint", base_epoch=plan.epoch,
                plan=new_plan, current_tokens_per_s=healthy_tps / spec.fault_factor,
                predicted_tokens_per_s=healthy_tps / 1.08, reshape_cost_s=4.2, diff=diff,
                severity=Severity.HIGH), time_s=t + 0.4))
        if apply_at is not None and it == apply_at - 2:
            out.append(planner.make(PlanDecision(plan_id=plan_id, approve=True, actor="policy:auto",
                                                 comment="high severity, auto-apply"), time_s=t + 0.5))
            out.append(planner.make(ReconfigureCommand(command_id=f"cmd-{plan_id}", plan_id=plan_id, plan=new_plan),
                                    time_s=t + 0.6))
        if apply_at is not None and it == apply_at:
            out.append(trainer.make(CommandAck(
                command_id=f"cmd-{plan_id}", plan_id=plan_id, epoch=new_plan.epoch, status=AckStatus.APPLIED,
                running_epoch=new_plan.epoch, pause_s=3.9, pause_iterations=2), time_s=t))
        if apply_at is not None and it == apply_at + 10:
            tps = tokens / spec.iteration_s
            out.append(planner.make(PlanVerified(
                plan_id=plan_id, measured_tokens_per_s=tps, predicted_tokens_per_s=tps * 0.99,
                reason=f"measured {tps:,.0f} tokens/s against the predicted {tps * 0.99:,.0f}"), time_s=t + 0.5))
            out.append(analytics.make(IncidentResolved(incident_id=incident_id, iteration=it,
                                                       reason="rank removed by plan epoch 1"), time_s=t + 0.6))
    return out
