"""Moving a native job's training state between layouts: live between processes, DCP on disk.

Units are state-dict keys (fully-qualified parameter names, global because a stage keeps the
model's layer indices), so "who holds what" is a set of names per rank, whatever the layout. A
rank holds a *piece* of a key: its local shard (DTensor's, FSDP's and TP's alike), described by
the flat global indices it covers, which each rank computes alone by cutting an index tensor
with its own placements — so no collective runs on the old mesh and nothing is gathered there.

* :func:`local_state` — this rank's pieces: parameter and AdamW moments side by side, their
  indices, the step, the param group's hyper-parameters and the LR scheduler's state.
* :func:`exchange` — over a group spanning the old and the new world: one small
  ``all_gather_object`` of who holds which piece and who needs which key; then each key a rank
  needs comes from the fewest holders that cover it (itself first), two raw tensors (indices,
  values) per (source, destination) pair, all posted at once, and lands in one indexed copy per
  pair. Keys no live piece covers are
  returned as missing (every rank computes the same list, so all take the disk fallback together).
* :func:`load_full` — each rank takes its own new shard of every assembled full tensor (the flat
  indices its new placement covers: no communication) into the freshly built stage and its AdamW
  state.
* :func:`save_dcp` / :func:`load_dcp` — the sharded DCP checkpoint: written by any layout, read by
  any other (DCP's resharding planner), and the fallback when a key has no live holder.

Memory: a receiving rank assembles the full tensors of the keys its new stage holds (one stage's
full state), then keeps only its shard.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class LocalState:
    """This rank's pieces of its stage's keys: ``index[k]`` the flat global indices it holds,
    ``values[k]`` (1 or 3, n): the parameter's values there, then each AdamW moment's (when stepped);
    ``start[k]``: where the indices begin when they are one ascending run (see ``_cut``), else None."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    index: dict[str, torch.Tensor] = field(default_factory=dict)
    start: dict[str, int | None] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    step: torch.Tensor | None = None
    hyper: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


_CUTS: dict[tuple, tuple[torch.Tensor, int | None]] = {}


def _cut(p: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The flat global indices of this rank's shard of ``p``, in the order of its local values,
    cut exactly as its values were, and where they start when they are one ascending run
    ``start, start + 1, …`` (a whole tensor, or a shard along dim 0: most of FSDP's), else None:
    such a piece lands and is taken by a slice copy rather than an indexed one, several times
    cheaper. Memoised per (shape, mesh, this rank's coordinate, placements): the layers of a
    stage share a handful of those, and each cut costs a DTensor."""
    if not isinstance(p, DTensor):
        key: tuple = (p.numel(),)
    else:
        key = (tuple(p.shape), p.device_mesh, tuple(p.device_mesh.get_coordinate() or ()), tuple(p.placements))
    cut = _CUTS.get(key)
    if cut is None:
        if isinstance(p, DTensor):
            whole = torch.arange(p.numel(), device=_local(p).device).view(p.shape)
            index = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
            index = index.reshape(-1).cpu()
        else:
            index = torch.arange(p.numel())
        start = int(index[0]) if index.numel() else 0
        run = torch.equal(index, torch.arange(start, start + index.numel()))
        cut = _CUTS[key] = (index, start if run else None)
    return cut


def local_state(params: Sequence[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer, sched: Any) -> LocalState:
    """Local only: no collective, the old mesh is only read. ``params`` are the stage's managed
    parameters by name as they were when it was built (``NativeRole.params``): after a failed
    iteration the module may still hold FSDP's gathered stand-ins, which the optimizer knows nothing of."""
    out = LocalState(scheduler=sched.state_dict())
    out.hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    stepped = all(p in opt.state and opt.state[p] for _, p in params)
    for k, p in params:
        parts = [_local(p).detach().reshape(-1)]
        if stepped:
            state = opt.state[p]
            parts += [_local(state[m]).detach().reshape(-1) for m in MOMENTS]
            out.step = state["step"].detach().cpu().clone()
        out.shapes[k] = tuple(p.shape)
        out.index[k], out.start[k] = _cut(p)
        out.values[k] = torch.stack(parts).cpu()
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters at full size (a gather per DTensor over its mesh; every rank of
    the stage calls it): what a run is compared with the single-process reference on."""
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for k, p in model.named_parameters()}


def needed_keys(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parameter names (and shapes) the freshly built stage ``model`` holds under the new plan."""
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


@dataclass
class Assembled:
    """Full tensors of the keys this rank needs: ``full[k]`` is (1 or 3, numel): the parameter
    and, when the job has stepped, its two AdamW moments."""

    full: dict[str, torch.Tensor] = field(default_factory=dict)
    step: torch.Tensor | None = None
    hyper: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)


Piece = tuple[tuple[int, ...], int, tuple[int, int, int, int], int | None]  # shape, count, signature, start
Route = dict[tuple[int, int], list[str]]  # (source, destination) → the keys whose pieces go that way
Message = tuple[int, list[str], torch.Tensor, torch.Tensor]  # source, keys, indices, (width, n) values


def exchange(mine: LocalState | None, needed: dict[str, tuple[int, ...]], group: dist.ProcessGroup,
             dtype: torch.dtype) -> tuple[Assembled, list[str]]:
    """Collective over ``group`` (every rank of the old and the new world): bring every key in
    ``needed`` to this rank from live pieces. Returns the assembled state and the keys no set of
    live pieces covers (the same list on every rank).

    The steps: every rank says what it holds and needs (:func:`_announce`); every rank computes
    the same route (:func:`_route`); the pieces are posted at once (:func:`_post`) and land in one
    buffer (:func:`_land`). A peer that dies meanwhile fails the collective on every rank."""
    me = dist.get_rank(group)
    everyone = _announce(mine, needed, group)
    holders = [r for r in range(len(everyone)) if everyone[r]["held"]]
    stepped = bool(holders) and all(everyone[r]["stepped"] for r in holders)
    width = 1 + len(MOMENTS) if stepped else 1
    route, missing = _route(everyone)
    out = Assembled()
    if holders:
        step, out.hyper, out.scheduler = everyone[holders[0]]["small"]
        out.step = torch.tensor(step[0], dtype=getattr(torch, step[1])) if step is not None else None
    # Every needed key's full tensor is a column range of one (width, total) buffer, so a message
    # (its keys' pieces side by side: n indices, and (width, n) values, per key) lands in one
    # indexed copy at its indices shifted by each key's offset.
    offset, total = {}, 0
    for k in sorted(needed):
        offset[k], total = total, total + math.prod(needed[k])
    landed = torch.empty(width, total, dtype=dtype)
    out.full = {k: landed[:, offset[k]:offset[k] + math.prod(needed[k])] for k in offset}
    messages = _post(route, me, mine, everyone, group, width, dtype)
    _land(messages, everyone, offset, landed)
    return out, sorted(missing)


def _announce(mine: LocalState | None, needed: dict[str, tuple[int, ...]], group: dist.ProcessGroup) -> list[Any]:
    """One small ``all_gather_object``: each rank's pieces (by signature: replicas of one shard
    are equal), the keys it needs, and its step, hyper-parameters and scheduler state."""
    held: dict[str, Piece] = {}
    if mine is not None:
        for k, idx in mine.index.items():
            held[k] = (mine.shapes[k], idx.numel(), (idx.numel(), int(idx[0]), int(idx[-1]), int(idx.sum())),
                       mine.start[k])
    # Plain Python only: a tensor in the gathered objects costs each receiver a nested torch.load.
    step = (mine.step.item(), str(mine.step.dtype).removeprefix("torch.")) if mine and mine.step is not None else None
    info = {"held": held, "needed": sorted(needed), "stepped": step is not None,
            "small": (step, mine.hyper, mine.scheduler) if mine is not None else None}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, info, group=group)
    return everyone


def _route(everyone: list[Any]) -> tuple[Route, set[str]]:
    """Which pieces each rank receives from which source, and the keys no live pieces cover:
    identical on every rank. Per key, its distinct pieces (replicas of one shard count once) by the
    first rank holding each; a rank takes its own piece first, then the fewest others."""
    distinct: dict[str, dict[tuple[int, int, int, int], int]] = {}
    for r, info in enumerate(everyone):
        for k, piece in info["held"].items():
            distinct.setdefault(k, {}).setdefault(piece[2], r)
    route: Route = {}
    missing: set[str] = set()
    for dst, info in enumerate(everyone):
        own = info["held"]
        for k in info["needed"]:
            first = [(own[k][2], dst)] if k in own else []
            others = [(sig, src) for sig, src in distinct.get(k, {}).items() if not first or sig != first[0][0]]
            covered = 0
            for sig, src in first + others:
                route.setdefault((src, dst), []).append(k)
                covered += sig[0]
                if covered == math.prod(everyone[src]["held"][k][0]):
                    break
            else:
                missing.add(k)
    return route, missing


def _post(route: Route, me: int, mine: LocalState | None, everyone: list[Any], group: dist.ProcessGroup,
          width: int, dtype: torch.dtype) -> list[Message]:
    """Send this rank's pieces and receive the ones routed to it, two raw tensors (indices,
    values) per (source, destination) pair, all posted in one batch; returns what arrived (its
    own pieces included) once every transfer is done."""
    messages: list[Message] = []
    ops: list[dist.P2POp] = []
    for (src, dst), keys in sorted(route.items()):
        if src == me and dst == me:
            assert mine is not None
            messages.append((src, keys, torch.cat([mine.index[k] for k in keys]),
                             torch.cat([mine.values[k] for k in keys], dim=1)))
        elif src == me:
            assert mine is not None
            ops += [dist.P2POp(dist.isend, torch.cat([mine.index[k] for k in keys]), group=group, group_peer=dst, tag=0),
                    dist.P2POp(dist.isend, torch.cat([mine.values[k] for k in keys], dim=1), group=group,
                               group_peer=dst, tag=1)]
        elif dst == me:
            n = sum(everyone[src]["held"][k][1] for k in keys)
            index, values = torch.empty(n, dtype=torch.int64), torch.empty(width, n, dtype=dtype)
            ops += [dist.P2POp(dist.irecv, index, group=group, group_peer=src, tag=0),
                    dist.P2POp(dist.irecv, values, group=group, group_peer=src, tag=1)]
            messages.append((src, keys, index, values))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return messages


def _land(messages: list[Message], everyone: list[Any], offset: dict[str, int], landed: torch.Tensor) -> None:
    """Copy each message into the buffer: slice copies when every piece is one ascending run,
    else one indexed copy at its indices shifted by each key's offset."""
    for src, keys, index, values in messages:
        pieces_of = [everyone[src]["held"][k] for k in keys]
        if all(piece[3] is not None for piece in pieces_of):
            at = 0
            for k, piece in zip(keys, pieces_of):
                n, begin = piece[1], offset[k] + piece[3]
                landed[:, begin:begin + n] = values[:, at:at + n]
                at += n
        else:
            shift = torch.repeat_interleave(torch.tensor([offset[k] for k in keys]),
                                            torch.tensor([piece[1] for piece in pieces_of]))
            landed[:, index + shift] = values


def load_full(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, state: Assembled) -> None:
    """Take this rank's shard of every assembled full tensor (the flat indices its new placement
    covers, ``_cut``) into the freshly built stage: the parameter in place (FSDP's and TP's
    shards are views of their own storage), the AdamW moments as fresh state of the parameter's
    placement. Local only."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            here = _local(p)
            index, start = _cut(p)
            full = state.full[k]
            mine = (full[:, start:start + index.numel()] if start is not None else full[:, index]).to(here.device)
            here.copy_(mine[0].view(here.shape))
            if mine.shape[0] > 1:
                assert state.step is not None
                opt.state[p] = {"step": state.step.clone(), **{
                    m: _placed_like(p, mine[1 + i].view(here.shape).clone()) for i, m in enumerate(MOMENTS)}}
    for group in opt.param_groups:
        group.update(state.hyper)
    sched.load_state_dict(state.scheduler)


def _placed_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's shard of a tensor placed like ``p`` (a plain tensor for a plain ``p``).
    An AdamW moment has the parameter's mesh, placements, shape, stride and dtype, so it takes
    ``p``'s own spec (as FSDP2 makes its shards): ``DTensor.from_local`` would build and check a
    new spec per moment through an autograd function, a fifth of loading the moved state."""
    if isinstance(p, DTensor):
        return DTensor(local, p._spec, requires_grad=False)
    return local


def save_dcp(directory: str | Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, iteration: int,
             group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` (the layout's world): a sharded DCP checkpoint (each rank writes
    its own shards, replicas deduplicated) plus the scheduler and iteration in ``meta.pt`` from
    the world's first rank."""
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(directory), process_group=group)
    if dist.get_rank(group) == 0:
        torch.save({"iteration": iteration, "scheduler": sched.state_dict()}, Path(directory) / "meta.pt")
    dist.barrier(group=group)


def load_dcp(directory: str | Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
             group: dist.ProcessGroup) -> int:
    """Every rank of ``group``: load a DCP checkpoint written by any layout into this layout's
    shards (DCP's default planner reshards: each rank reads the byte ranges of its own shards).
    Returns the checkpoint's iteration."""
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(directory), process_group=group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    meta = read_meta(directory)
    sched.load_state_dict(meta["scheduler"])
    return int(meta["iteration"])


def read_meta(directory: str | Path) -> dict[str, Any]:
    """A DCP checkpoint's ``meta.pt`` (iteration and scheduler state), unpickled with
    ``weights_only=True``: tensors and plain values only. A checkpoint directory is a file on disk
    anyone with write access to it can replace, and a full unpickle runs whatever code the file
    names. Raises ``ValueError`` naming the file when it holds anything else."""
    path = Path(directory) / "meta.pt"
    try:
        meta = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"checkpoint metadata {path} holds more than tensors and plain values, so it was not "
                         f"written by this trainer; refusing to unpickle it (it could run code): {exc}") from None
    if not isinstance(meta, dict) or "iteration" not in meta or "scheduler" not in meta:
        raise ValueError(f"checkpoint metadata {path} is not an iteration and a scheduler state; resume from "
                         "another checkpoint")
    return meta
