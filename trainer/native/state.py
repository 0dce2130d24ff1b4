"""Moving a native job's training state between layouts: live between processes, DCP on disk.

Units are state-dict keys (fully-qualified parameter names, global because a stage keeps the
model's layer indices), so "who holds what" is a set of names per rank, whatever the layout.

* :func:`export_full` — on the old mesh, DTensor-gather every parameter and AdamW moment of this
  rank's stage to full size (``full_state_dict=True``: an all-gather over FSDP's dp dimension and
  TP's tp dimension). Memory: one stage's full state per rank.
* :func:`exchange` — on the new world, every rank announces the keys it holds; each key a rank
  needs under the new plan comes from itself or the lowest-ranked live holder, one point-to-point
  message per (source, destination) pair. Keys nobody holds are returned as missing.
* :func:`load_full` — into the freshly built stage: torch's ``set_model_state_dict`` /
  ``set_optimizer_state_dict`` cut each full tensor to this rank's DTensor shard (a scatter per key).
* :func:`save_dcp` / :func:`load_dcp` — the sharded DCP checkpoint: written by any layout, read by
  any other (DCP's resharding planner), and the fallback when a key has no live holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

FULL = StateDictOptions(full_state_dict=True)


@dataclass
class FullState:
    """Full-size tensors of the keys this rank holds: parameters, AdamW state per parameter,
    the param groups and the LR scheduler's state."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    scheduler: dict[str, Any] = field(default_factory=dict)


def export_full(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> FullState:
    """Collective over the old mesh: every rank of a stage gets that stage's full state."""
    msd: Any = get_model_state_dict(model, options=FULL)
    params = {k: v.detach().cpu() for k, v in msd.items()}
    osd: Any = get_optimizer_state_dict(model, opt, options=FULL)
    optim = {k: {n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in s.items()}
             for k, s in osd["state"].items()}
    return FullState(params, optim, list(osd["param_groups"]), sched.state_dict())


def needed_keys(model: nn.Module) -> list[str]:
    """The parameter names the freshly built stage ``model`` holds under the new plan."""
    return [k for k, _ in model.named_parameters()]


def exchange(mine: FullState | None, needed: list[str], rank: int, world_size: int
             ) -> tuple[FullState, list[str]]:
    """Collective over the new world: bring every key in ``needed`` to this rank from a live
    holder, point to point. Returns the assembled state and the keys no live rank holds (every
    rank gets the same missing list, so all take the disk fallback together).

    Each key comes from its lowest-ranked holder (this rank itself when it holds it). The transfers
    are one message per (source, destination) pair that has something to move, taken by every rank
    in the same global order, so the first unfinished pair always has both ends waiting on it and
    the exchange cannot deadlock."""
    held = sorted(mine.params) if mine is not None else []
    holders: list[Any] = [None] * world_size
    wants: list[Any] = [None] * world_size
    dist.all_gather_object(holders, held)
    dist.all_gather_object(wants, needed)
    # Point-to-point on a group of its own, closed by a barrier on it: otherwise a rank done early
    # would start the next collective on the default group (a mesh dimension spanning the world
    # reuses it) while its peers still exchange there, and gloo would mix the two up.
    moves: Any = dist.new_group(list(range(world_size)))
    held_by = [set(h) for h in holders]
    missing = sorted({k for keys in wants for k in keys} - set().union(*held_by))
    out = FullState()
    if mine is not None:
        out.param_groups, out.scheduler = mine.param_groups, mine.scheduler

    def source_of(k: str, dst: int) -> int | None:
        if k in held_by[dst]:
            return dst
        return next((r for r in range(world_size) if k in held_by[r]), None)

    for dst in range(world_size):
        by_source: dict[int, list[str]] = {}
        for k in wants[dst]:
            src = source_of(k, dst)
            if src is not None:
                by_source.setdefault(src, []).append(k)
        for src in sorted(by_source):
            keys = by_source[src]
            if src == dst == rank:
                assert mine is not None
                out.params.update({k: mine.params[k] for k in keys})
                out.optim.update({k: mine.optim[k] for k in keys if k in mine.optim})
            elif src == rank:
                assert mine is not None
                dist.send_object_list([({k: mine.params[k] for k in keys},
                                        {k: mine.optim[k] for k in keys if k in mine.optim},
                                        mine.param_groups, mine.scheduler)], dst=dst, group=moves)
            elif dst == rank:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src, group=moves)
                params, optim, groups, sched = box[0]
                out.params.update(params)
                out.optim.update(optim)
                out.param_groups, out.scheduler = groups, sched
    dist.barrier(group=moves)
    dist.destroy_process_group(moves)
    return out, missing


def load_full(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, state: FullState) -> None:
    """Cut ``state``'s full tensors to this rank's shards and load them (a collective per key over the new mesh)."""
    device = next(model.parameters()).device  # the exchange carries CPU tensors; a CUDA stage wants its own
    # The model's own key order on every rank: loading scatters key by key, a collective each.
    order = [k for k, _ in model.named_parameters() if k in state.params]
    params: Any = {k: state.params[k].to(device) for k in order}
    set_model_state_dict(model, params, options=FULL)
    # One param group (build_optimizer's): its hyper-parameters from any source, its members this stage's keys.
    groups = [dict(state.param_groups[0], params=order)]
    optim = {k: {n: (t.to(device) if isinstance(t, torch.Tensor) and n != "step" else t)
                 for n, t in state.optim[k].items()} for k in order if k in state.optim}
    osd: Any = {"state": optim, "param_groups": groups}
    set_optimizer_state_dict(model, opt, osd, options=FULL)
    sched.load_state_dict(state.scheduler)


def save_dcp(directory: str | Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, iteration: int) -> None:
    """Every world rank: a sharded DCP checkpoint (each rank writes its own shards, replicas
    deduplicated) plus the scheduler and iteration in ``meta.pt`` from world rank 0."""
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        torch.save({"iteration": iteration, "scheduler": sched.state_dict()}, Path(directory) / "meta.pt")
    dist.barrier()


def load_dcp(directory: str | Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> int:
    """Every world rank: load a DCP checkpoint written by any layout into this layout's shards
    (DCP's default planner reshards: each rank reads the byte ranges of its own shards).
    Returns the checkpoint's iteration."""
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    meta = torch.load(Path(directory) / "meta.pt", weights_only=False)
    sched.load_state_dict(meta["scheduler"])
    return int(meta["iteration"])
