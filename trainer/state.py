"""Training state in layout-free terms: moving it live between layouts, and checkpoints on disk.

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
the process-group timeout; the reshape then fails and the caller falls back to a disk checkpoint);
no replica fully alive for some unit (``NoLiveSource``: reload from disk instead).

``save_checkpoint`` / ``load_checkpoint``: the fallback. Replica 0 of the plan gathers each unit to
full size inside its TP groups and writes one file per unit; any layout loads them by cutting its
shards. So a checkpoint goes from any layout to any layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from collector.plan import Plan
from trainer.optim import AdamW
from trainer.model import GPTConfig, GPTStage, full_shape, shard, shard_rule, unshard
from trainer.parallel import Layout, all_units, gather_tp, owner_stage, units_of_stage

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


def _flatten(state: ShardState, names: list[str]) -> torch.Tensor:
    return torch.cat([state[n][k].reshape(-1) for n in names for k in STATE_KINDS])


def _unflatten(cfg: GPTConfig, flat: torch.Tensor, names: list[str], tp: int) -> ShardState:
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


def _reassemble(cfg: GPTConfig, pieces: list[ShardState], names: list[str], tp_new: int, rank_new: int) -> ShardState:
    out: ShardState = {}
    for n in names:
        rule = shard_rule(n)
        out[n] = {k: shard(unshard([p[n][k] for p in pieces], rule), rule, tp_new, rank_new) for k in STATE_KINDS}
    return out


def transfer_live(cfg: GPTConfig, old: Plan, new: Layout, me: int, mine: ShardState | None) -> ShardState:
    """Move every unit's shards to their owners under ``new.plan``; returns this device's new state.

    ``mine`` is this device's state under ``old`` (None if it had no role). Must be called by every
    member of ``new.world`` (the default process group), in any order of arrival.
    """
    alive = set(new.world)
    old_roles, new_roles = old.roles, new.plan.roles
    result: ShardState = {}
    for unit in all_units(cfg.n_layer):
        names = unit_names(cfg, unit)
        source = None
        for r in range(old.dp):
            st = owner_stage(old, r, unit)
            if set(st.devices) <= alive:
                source = st
                break
        for r in range(new.plan.dp):
            for dst in owner_stage(new.plan, r, unit).devices:
                nr = new_roles[dst]
                orole = old_roles.get(dst)
                keeps = (orole is not None and dst in alive
                         and unit in _units(old, orole) and (orole.tp_degree, orole.tp_rank) == (nr.tp_degree, nr.tp_rank))
                if keeps:
                    if dst == me:
                        result.update({n: mine[n] for n in names})
                    continue
                if source is None:
                    raise NoLiveSource(f"no replica of plan epoch {old.epoch} has a live copy of {unit}; "
                                       "reload it from a disk checkpoint (--checkpoint-dir)")
                if me != dst and me not in source.devices:
                    continue
                pieces: list[ShardState] = []
                for src in source.devices:
                    if src == me and dst == me:
                        pieces.append({n: mine[n] for n in names})
                    elif src == me:
                        dist.send(_flatten(mine, names), dst=new.rank(dst))
                    elif dst == me:
                        buf = torch.empty(sum(_shard_numel(cfg, n, source.tp) for n in names) * len(STATE_KINDS),
                                          dtype=cfg.torch_dtype)
                        dist.recv(buf, src=new.rank(src))
                        pieces.append(_unflatten(cfg, buf, names, source.tp))
                if dst == me:
                    result.update(_reassemble(cfg, pieces, names, nr.tp_degree, nr.tp_rank))
    return result


def _units(plan: Plan, role) -> list[str]:
    return units_of_stage(plan.num_layers, role.first_layer, role.end_layer)


# ---- disk checkpoints ---------------------------------------------------------------------------


def save_checkpoint(directory: str | Path, layout: Layout, me: int, stage: GPTStage | None, opt, iteration: int,
                    tp_devices: tuple[int, ...] | None) -> None:
    """Replica 0 writes each unit at full size (one file per unit); every world member calls this."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = layout.plan
    role = plan.roles.get(me)
    if stage is not None and role is not None and role.replica == plan.pipelines[0].replica:
        state = export_state(stage, opt)
        for unit in _units(plan, role):
            names = unit_names(stage.cfg, unit)
            flat = _flatten(state, names)
            if role.tp_degree > 1:
                flats = gather_tp(flat, stage.tp, tp_devices, layout)
                pieces = [_unflatten(stage.cfg, f, names, role.tp_degree) for f in flats]
            else:
                pieces = [_unflatten(stage.cfg, flat, names, 1)]
            if role.tp_rank == 0:
                full = _reassemble(stage.cfg, pieces, names, 1, 0)
                torch.save(full, directory / f"{unit}.pt.tmp")
                (directory / f"{unit}.pt.tmp").replace(directory / f"{unit}.pt")
    if layout.rank(me) == 0:
        (directory / "meta.json").write_text(json.dumps({"iteration": iteration, "epoch": plan.epoch}))


def load_checkpoint(directory: str | Path, cfg: GPTConfig, first_layer: int, end_layer: int, tp_degree: int,
                    tp_rank: int) -> tuple[ShardState, int]:
    """This rank's shards of a checkpoint written by any layout, and the iteration it was taken at."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    out: ShardState = {}
    for unit in units_of_stage(cfg.n_layer, first_layer, end_layer):
        full = torch.load(directory / f"{unit}.pt", weights_only=True)
        for n, kinds in full.items():
            out[n] = {k: shard(v.to(cfg.torch_dtype), shard_rule(n), tp_degree, tp_rank) for k, v in kinds.items()}
    return out, int(meta["iteration"])


def read_full_parameters(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every full parameter of a checkpoint (tests and tools)."""
    out = {}
    for f in sorted(Path(directory).glob("*.pt")):
        for n, kinds in torch.load(f, weights_only=True).items():
            out[n] = kinds["param"]
    return out
