"""The native executor (trainer/native/) on real processes with gloo: every layout, and every
live reshape, trains exactly what one process training the same global batches would.

Each test launches 4 CPU ranks (float64, a 4-layer decoder 32 wide; the TP 4 → 3 proof a 2-layer
one with 12 heads) and compares the per-iteration losses and the final parameters with
``reference_losses`` to float tolerance.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from collector import topics
from collector.embedded import EmbeddedBus
from collector.events import RankIteration, ReshapePhase
from collector.plan import PipelinePlan, Plan, StagePlan
from collector.stream import EventStream
from trainer.native.model import LlamaConfig
from trainer.native.stage import TrainSettings, reference_losses
from trainer.native.worker import NativeRunSpec, ReshapeFault, ScheduledReshape, launch_native, read_results
from trainer.spec import BusSpec

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

CFG = LlamaConfig(dim=32, n_layers=4, n_heads=4, ffn_hidden=64, vocab_size=64, dtype="float64")
SETTINGS = TrainSettings(block_size=16)
GLOBAL_MICROBATCHES = 4


# one replica: (microbatches, [(devices, first_layer, end_layer), ...])
ReplicaSpec = tuple[int, list[tuple[tuple[int, ...], int, int]]]


def _plan(epoch: int, *pipelines: ReplicaSpec, cfg: LlamaConfig = CFG) -> Plan:
    """``_plan(e, (microbatches, [(devices, first_layer, end_layer), ...]), ...)``, one per replica."""
    return Plan(epoch=epoch, num_layers=cfg.n_layers, pipelines=tuple(
        PipelinePlan(replica=r, microbatches=mbs, stages=tuple(
            StagePlan(devices=d, first_layer=a, end_layer=b) for d, a, b in stages))
        for r, (mbs, stages) in enumerate(pipelines)))


def _run(tmp: Path, plan: Plan, iterations: int, reshapes=(), cfg: LlamaConfig = CFG, **extra) -> tuple[dict, dict]:
    spec = NativeRunSpec(model=asdict(cfg), settings=asdict(SETTINGS), plan=plan, iterations=iterations,
                         reshapes=[ScheduledReshape(at_iteration=i, plan=p) for i, p in reshapes],
                         out_dir=str(tmp), timeout_s=60, device="cpu", **extra)
    codes = launch_native(spec)
    assert all(c == 0 for c in codes.values()), codes
    return read_results(tmp)


def _assert_matches_reference(ranks: dict, params: dict, iterations: int, cfg: LlamaConfig = CFG) -> None:
    ref_losses, ref_params = reference_losses(cfg, SETTINGS, [GLOBAL_MICROBATCHES] * iterations)
    for device, r in ranks.items():
        for it, loss in r["losses"].items():
            assert loss == pytest.approx(ref_losses[int(it)], rel=1e-9), (device, it)
    assert sorted(params) == sorted(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-9, atol=1e-9, msg=k)


def test_tp_exclusion_on_one_replica_then_tp_shrink_and_dp_migration_equal_the_reference_with_telemetry(tmp_path):
    # TP2·DP2 with replica 1 running 1 of 4 micro-batches; a plan giving replicas different layer
    # ranges is refused and training goes on; then replica 1's stage excludes device 3 (TP 2→1 on
    # that stage beside replica 0's TP2, so the replicas sum full gradients); then replica 0 shrinks
    # to TP1 too with the micro-batches moved back to 2/2 (devices 3, then 1, released). Replica 0
    # names its TP group 1, 0: the shards follow the group's rank order, not the plan's.
    start = _plan(0, (3, [((1, 0), 0, 4)]), (1, [((2, 3), 0, 4)]))
    split = _plan(1, (3, [((1, 0), 0, 4)]), (1, [((2,), 0, 2), ((3,), 2, 4)]))
    excluded = _plan(1, (3, [((1, 0), 0, 4)]), (1, [((2,), 0, 4)]))
    shrunk = _plan(2, (2, [((0,), 0, 4)]), (2, [((2,), 0, 4)]))
    bus = tmp_path / "bus.sqlite"
    ranks, params = _run(tmp_path, start, 5, reshapes=[(1, split), (2, excluded), (3, shrunk)],
                         bus=BusSpec(backend="embedded", path=str(bus)))
    _assert_matches_reference(ranks, params, 5)
    assert ranks[1].get("released") and ranks[3].get("released")
    assert "different stage layer ranges" in ranks[0]["refused"][0]
    assert ranks[3]["epochs"] == {"0": 0, "1": 0} and ranks[1]["epochs"] == {"0": 0, "1": 0, "2": 1}
    exclusion, reshape = ranks[0]["reshapes"]
    assert exclusion["source"] == "live" and exclusion["iteration"] == 2 and reshape["iteration"] == 3
    assert set(reshape["phases_s"]) == {"agree", "export", "new_mesh", "stages_rebuilt", "redistribute", "first_step"}
    # each protocol phase's CPU too (bench reshape_cpu sums it over ranks); a stage build costs some
    assert set(reshape["cpu_s"]) == set(reshape["phases_s"]) - {"first_step"}
    assert all(v >= 0 for v in reshape["cpu_s"].values()) and reshape["cpu_s"]["stages_rebuilt"] > 0

    with EmbeddedBus(bus) as b, EventStream(b, "test", [topics.TELEMETRY]) as stream:
        events = []
        while batch := stream.poll(timeout_s=0.1):
            events += [d.event.payload for d in batch if isinstance(d.event.payload, RankIteration)]
    by_key = {(e.rank, e.iteration): e for e in events}
    assert set(by_key) == ({(d, i) for d in (0, 1, 2, 3) for i in (0, 1)} | {(d, 2) for d in (0, 1, 2)}
                           | {(d, i) for d in (0, 2) for i in (3, 4)})
    first = by_key[(2, 0)]  # replica 1 ran micro-batch 3 only, under epoch 0
    assert first.epoch == 0 and (first.coords.tp, first.coords.pp, first.coords.dp) == (0, 0, 1)
    assert [(c.kind.value, c.microbatch) for c in first.chunks] == [("F", 3), ("B", 3)]
    assert all(c.tokens == SETTINGS.block_size and c.seq_lens is not None and sum(c.seq_lens) == SETTINGS.block_size
               for c in first.chunks)
    later = by_key[(0, 4)]
    assert later.epoch == 2 and sorted({c.microbatch for c in later.chunks}) == [0, 1]


def test_tp_4_to_3_on_one_stage_of_a_pp2_dp2_job_equals_the_reference(tmp_path):
    # TP4·PP2·DP2 on 16 ranks; device 5 leaves replica 0's stage 1, which goes on at TP3 on devices
    # 4, 6, 7 while every other stage stays at TP4. Activations and gradients cross TP4 → TP3 by
    # the contract's rule (stage 0's rank 3 sends to nobody; stage 1's rank 0 sends gradients to two
    # ranks); the FFN width (100) and vocabulary (98) divide unevenly, so both stages sum full
    # gradients across replicas. Its TP shards are re-cut from the four live TP4 shards.
    cfg = LlamaConfig(dim=48, n_layers=2, n_heads=12, ffn_hidden=100, vocab_size=98, dtype="float64")
    other: ReplicaSpec = (2, [((8, 9, 10, 11), 0, 1), ((12, 13, 14, 15), 1, 2)])
    start = _plan(0, (2, [((0, 1, 2, 3), 0, 1), ((4, 5, 6, 7), 1, 2)]), other, cfg=cfg)
    excluded = _plan(1, (2, [((0, 1, 2, 3), 0, 1), ((4, 6, 7), 1, 2)]), other, cfg=cfg)
    ranks, params = _run(tmp_path, start, 3, reshapes=[(1, excluded)], cfg=cfg)
    _assert_matches_reference(ranks, params, 3, cfg)
    assert ranks[5].get("released") and ranks[5]["epochs"] == {"0": 0}
    assert all(r["reshapes"][0]["source"] == "live" and r["final_epoch"] == 1
               for d, r in ranks.items() if d != 5)


def test_tp_4_to_3_excluding_one_device_equals_the_reference(tmp_path):
    # A model whose heads, FFN width and vocabulary divide by 4 and by 3. TP4 on devices 0-3, then
    # device 1 is excluded: the whole job shrinks to TP3 on devices 0, 2, 3 (a regular mesh
    # again), the weights and AdamW state re-cut from the four live TP4 shards, device 1 released.
    cfg = LlamaConfig(dim=48, n_layers=2, n_heads=12, ffn_hidden=96, vocab_size=96, dtype="float64")
    start = _plan(0, (4, [((0, 1, 2, 3), 0, 2)]), cfg=cfg)
    excluded = _plan(1, (4, [((0, 2, 3), 0, 2)]), cfg=cfg)
    ranks, params = _run(tmp_path, start, 3, reshapes=[(1, excluded)], cfg=cfg)
    _assert_matches_reference(ranks, params, 3, cfg)
    assert ranks[1].get("released") and ranks[1]["epochs"] == {"0": 0}
    assert all(ranks[d]["reshapes"][0]["source"] == "live" and ranks[d]["epochs"] == {"0": 0, "1": 1, "2": 1}
               for d in (0, 2, 3))


def test_tp_grow_onto_fsdp_and_tp_together_equals_the_reference(tmp_path):
    # DP4 (FSDP over four replicas) → TP2·DP2: every parameter lands in FSDP's strided shard of a
    # TP shard on a 2-D mesh, each rank taking its shard of the moved state by flat indices.
    replicas: list[ReplicaSpec] = [(1, [((d,), 0, 4)]) for d in range(4)]
    start = _plan(0, *replicas)
    grown = _plan(1, (2, [((0, 1), 0, 4)]), (2, [((2, 3), 0, 4)]))
    ranks, params = _run(tmp_path, start, 4, reshapes=[(2, grown)])
    _assert_matches_reference(ranks, params, 4)
    assert all(r["reshapes"][0]["source"] == "live" and r["final_epoch"] == 1 for r in ranks.values())


def test_pp_repartition_and_dp_drop_then_a_dcp_checkpoint_loads_at_another_layout(tmp_path):
    # PP2·DP2 → one replica of stages [0,1) + [1,4) running all 4 micro-batches (layers moved
    # between stages, devices 2 and 3 released), checkpointed with DCP; a fresh 2-rank job at
    # TP2·PP1 loads it and trains on: all equal to one process training 5 iterations.
    start = _plan(0, (2, [((0,), 0, 2), ((1,), 2, 4)]), (2, [((2,), 0, 2), ((3,), 2, 4)]))
    moved = _plan(1, (4, [((0,), 0, 1), ((1,), 1, 4)]))
    ranks, params = _run(tmp_path / "a", start, 3, reshapes=[(2, moved)], save_dir=str(tmp_path / "ckpt"))
    _assert_matches_reference(ranks, params, 3)
    assert ranks[2].get("released") and ranks[0]["reshapes"][0]["source"] == "live"
    assert any(r.get("reshapes") and r["reshapes"][0]["phases_s"]["redistribute"] >= 0 for r in ranks.values())

    resumed = _plan(0, (4, [((0, 1), 0, 4)]))
    ranks, params = _run(tmp_path / "b", resumed, 5, resume_dir=str(tmp_path / "ckpt"))
    assert sorted(int(i) for i in ranks[0]["losses"]) == [3, 4]
    _assert_matches_reference(ranks, params, 5)


def test_a_reshape_that_fails_mid_way_rolls_every_rank_back_and_training_goes_on(tmp_path):
    # TP2·DP2. A micro-batch-only change keeps every group and stage. Then the reshape to epoch 2
    # fails twice on one rank — device 0 in stages_rebuilt (to PP2·DP2), device 3 in
    # redistribute (to TP2·DP1, which would release it) — and every rank rolls back and trains
    # on at epoch 1; the third try is applied. Every loss equals one process's.
    start = _plan(0, (2, [((0, 1), 0, 4)]), (2, [((2, 3), 0, 4)]))
    counts = _plan(1, (3, [((0, 1), 0, 4)]), (1, [((2, 3), 0, 4)]))
    pp = _plan(2, (2, [((0,), 0, 2), ((1,), 2, 4)]), (2, [((2,), 0, 2), ((3,), 2, 4)]))
    one = _plan(2, (4, [((0, 1), 0, 4)]))
    faults = [ReshapeFault(device=0, epoch=2, phase="stages_rebuilt"), ReshapeFault(device=3, epoch=2, phase="redistribute")]
    bus = tmp_path / "bus.sqlite"
    ranks, params = _run(tmp_path, start, 6, reshapes=[(1, counts), (2, pp), (3, one), (4, one)],
                         reshape_faults=faults, bus=BusSpec(backend="embedded", path=str(bus)))
    _assert_matches_reference(ranks, params, 6)
    assert ranks[0]["epochs"] == {str(i): e for i, e in enumerate([0, 1, 1, 1, 2, 2])}
    assert ranks[3]["epochs"] == {str(i): e for i, e in enumerate([0, 1, 1, 1])} and ranks[3].get("released")
    assert [r["epoch"] for r in ranks[0]["reshapes"]] == [1, 2] and ranks[0]["reshapes"][0]["source"] == "groups kept"
    first_failure, second_failure = ranks[1]["refused"]
    assert "failed by the end of stages_rebuilt" in first_failure and "failed by the end of redistribute" in second_failure
    assert "device 0 failed in stages_rebuilt: injected" in ranks[0]["refused"][0]

    with EmbeddedBus(bus) as b, EventStream(b, "test", [topics.TELEMETRY]) as stream:
        phases = []
        while batch := stream.poll(timeout_s=0.1):
            phases += [d.event.payload for d in batch if isinstance(d.event.payload, ReshapePhase)]
    of_device_2 = [(p.epoch, p.iteration, p.phase.value, p.ok) for p in phases if p.rank == 2]
    assert of_device_2 == [
        (1, 1, "agree", True), (1, 1, "first_step", True),
        (2, 2, "agree", True), (2, 2, "export", True), (2, 2, "new_mesh", True), (2, 2, "rollback", False),
        (2, 3, "agree", True), (2, 3, "export", True), (2, 3, "new_mesh", True), (2, 3, "stages_rebuilt", True),
        (2, 3, "rollback", False),
        (2, 4, "agree", True), (2, 4, "export", True), (2, 4, "new_mesh", True), (2, 4, "stages_rebuilt", True),
        (2, 4, "redistribute", True)]
    assert all(p.executor == "native" and p.duration_s >= 0 for p in phases)
