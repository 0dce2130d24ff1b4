"""Training state in layout-free terms, moved live between layouts (disk: trainer/reference/checkpoint.py).

A rank's state is, per canonical parameter name, its shard of the parameter and of the optimizer
moments (AdamW's ``exp_avg`` and ``exp_avg_sq``; the step count is the iteration, the same on
every rank). Shards follow the parameter's rule (col / row / rep), so any holder can rebuild the
full tensor from one complete TP group and cut the piece a new owner needs.

``transfer_live``: every unit (embeddings, a layer, the head) gets to each of its new owners from
the first old replica whose whole owner group is alive — DP replicas hold identical state, so any
surviving replica is a complete source and no checkpoint is needed. A new owner that already holds
exactly the shard it needs (same unit, same TP degree and rank) keeps it and nothing moves. All
participants walk one global list of (unit, receiver, sender) transfers with blocking send / recv,
which cannot deadlock. What can fail: a sender dying mid-transfer (the receiver's recv raises after
the process-group timeout and the reshape fails); no replica fully alive for some unit
(``units_without_live_copy`` says so beforehand; the executor then loads a disk checkpoint instead,
see trainer/reference/checkpoint.py, and ``transfer_live`` itself raises ``NoLiveSource``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collector.plan import Plan
from trainer.agent.wake import wait
from trainer.reference.chunks import all_units, role_chunks, units_of_chunks
from trainer.reference.model import GPTConfig, GPTStage, full_shape, shard, shard_rule, unshard
from trainer.reference.optim import AdamW
from trainer.reference.parallel import PlanWorld, owner_stage

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")
ShardState = dict[str, dict[str, torch.Tensor]]  # name -> kind -> shard


class NoLiveSource(RuntimeError):
    pass


def make_optimizer(stage: GPTStage, lr: float, weight_decay: float, step: int = 0) -> AdamW:
    """AdamW whose state exists (and so can move) from step 0."""
    return AdamW(stage.parameters(), lr=lr, weight_decay=weight_decay, step=step)


def export_state(stage: GPTStage, opt: AdamW) -> ShardState:
    out: ShardState = {}
    for name, p in stage.named_parameters():
        st = opt.state[p]
        out[name] = {"param": p.detach().clone(), "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
    return out


def import_state(stage: GPTStage, opt: AdamW, state: ShardState, step: int) -> None:
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name not in state:
                raise KeyError(f"no state for {name} after the transfer; the plan left it unowned")
            p.copy_(state[name]["param"])
            opt.state[p] = {"exp_avg": state[name]["exp_avg"].clone(), "exp_avg_sq": state[name]["exp_avg_sq"].clone()}
    opt.step_count = step


def unit_names(cfg: GPTConfig, unit: str) -> list[str]:
    """Canonical parameter names of a unit, sorted (the wire order of every transfer)."""
    if unit == "embed":
        return ["wpe.weight", "wte.weight"]
    if unit == "head":
        return ["lm_head.weight", "ln_f.bias", "ln_f.weight"]
    i = unit.split(".")[1]
    leaves = ["attn.k.weight", "attn.proj.weight", "attn.q.weight", "attn.v.weight", "ln1.bias", "ln1.weight",
              "ln2.bias", "ln2.weight", "mlp.fc.weight", "mlp.out.weight"]
    return [f"layers.{i}.{leaf}" for leaf in leaves]


def _shard_numel(cfg: GPTConfig, name: str, tp: int) -> int:
    n = 1
    for d in full_shape(cfg, name):
        n *= d
    return n if shard_rule(name) == "rep" else n // tp


def _shard_shape(cfg: GPTConfig, name: str, tp: int) -> tuple[int, ...]:
    shape = list(full_shape(cfg, name))
    rule = shard_rule(name)
    if rule != "rep":
        shape[0 if rule == "col" else 1] //= tp
    return tuple(shape)


def flatten(state: ShardState, names: list[str]) -> torch.Tensor:
    """One flat tensor of ``names``' shards, kind after kind (the wire and disk order)."""
    return torch.cat([state[n][k].reshape(-1) for n in names for k in STATE_KINDS])


def unflatten(cfg: GPTConfig, flat: torch.Tensor, names: list[str], tp: int) -> ShardState:
    """Inverse of :func:`flatten` for shards cut at TP degree ``tp``."""
    out: ShardState = {}
    at = 0
    for n in names:
        shape = _shard_shape(cfg, n, tp)
        size = _shard_numel(cfg, n, tp)
        out[n] = {}
        for k in STATE_KINDS:
            out[n][k] = flat[at:at + size].view(shape).clone()
            at += size
    return out


def reassemble(cfg: GPTConfig, pieces: list[ShardState], names: list[str], tp_new: int, rank_new: int) -> ShardState:
    """Full tensors from one complete TP group's ``pieces`` (TP-rank order), cut for (tp_new, rank_new)."""
    out: ShardState = {}
    for n in names:
        rule = shard_rule(n)
        out[n] = {k: shard(unshard([p[n][k] for p in pieces], rule), rule, tp_new, rank_new) for k in STATE_KINDS}
    return out


def transfer_live(cfg: GPTConfig, old: Plan, new: PlanWorld, me: int, mine: ShardState | None) -> ShardState:
    """Move every unit's shards to their owners under ``new.plan``; returns this device's new state.

    ``mine`` is this device's state under ``old`` (None if it had no role). Must be called by every
    member of ``new.world`` (the default process group), in any order of arrival.
    """
    have: ShardState = mine if mine is not None else {}  # a device with no role sends and keeps nothing
    alive = set(new.world)
    new_roles = new.plan.roles
    result: ShardState = {}
    for unit in all_units(cfg.n_layer):
        names = unit_names(cfg, unit)
        source = _live_source(old, unit, alive)
        for r in range(new.plan.dp):
            for dst in owner_stage(new.plan, r, unit).devices:
                nr = new_roles[dst]
                if _keeps(old, new, unit, dst):
                    if dst == me:
                        result.update({n: have[n] for n in names})
                    continue
                if source is None:
                    raise NoLiveSource(f"no replica of plan epoch {old.epoch} has a live copy of {unit}; "
                                       "reload it from a disk checkpoint (run with --save-dir and --checkpoint-every)")
                if me != dst and me not in source.devices:
                    continue
                pieces: list[ShardState] = []
                for src in source.devices:
                    if src == me and dst == me:
                        pieces.append({n: have[n] for n in names})
                    elif src == me:
                        wait(dist.isend(flatten(have, names), dst=new.rank(dst)), "transfer send", p2p=True)
                    elif dst == me:
                        buf = torch.empty(sum(_shard_numel(cfg, n, source.tp) for n in names) * len(STATE_KINDS),
                                          dtype=cfg.torch_dtype)
                        wait(dist.irecv(buf, src=new.rank(src)), "transfer recv", p2p=True)
                        pieces.append(unflatten(cfg, buf, names, source.tp))
                if dst == me:
                    result.update(reassemble(cfg, pieces, names, nr.tp_degree, nr.tp_rank))
    return result


def _live_source(old: Plan, unit: str, alive: set[int]):
    """The first old replica's owner stage of ``unit`` whose whole TP group is alive (or None)."""
    for r in range(old.dp):
        st = owner_stage(old, r, unit)
        if set(st.devices) <= alive:
            return st
    return None


def _keeps(old: Plan, new: PlanWorld, unit: str, dst: int) -> bool:
    """``dst`` already holds exactly the shard of ``unit`` it needs under ``new`` (nothing moves)."""
    orole, nr = old.roles.get(dst), new.plan.roles[dst]
    return (orole is not None and dst in new.world and unit in _units(old, orole)
            and (orole.tp_degree, orole.tp_rank) == (nr.tp_degree, nr.tp_rank))


def units_without_live_copy(old: Plan, new: PlanWorld) -> list[str]:
    """Units some new owner needs that no replica of ``old`` still holds on live devices: when this
    is not empty, :func:`transfer_live` would raise ``NoLiveSource`` and the state must come from a
    disk checkpoint instead. A pure function of the two plans and the world, so every rank agrees."""
    alive = set(new.world)
    missing = []
    for unit in all_units(old.num_layers):
        if _live_source(old, unit, alive) is not None:
            continue
        owners = [d for r in range(new.plan.dp) for d in owner_stage(new.plan, r, unit).devices]
        if not all(_keeps(old, new, unit, d) for d in owners):
            missing.append(unit)
    return missing


def _units(plan: Plan, role) -> list[str]:
    return units_of_chunks(plan.num_layers, role_chunks(plan, role))
