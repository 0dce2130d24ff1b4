"""The process groups of a native job: one world for the whole run, sub-groups made once and kept.

A reshape used to destroy the default group and rendezvous a new one, then let DeviceMesh create
a sub-group for every slice of every dimension — a world-wide store barrier and a gloo full-mesh
connect each time, most of a pause. Instead the default group spans the job's first world for
the whole run, and every group a layout needs (a stage mesh's dimension, the devices of one stage
across replicas, the running world, the union of an old and a new world for moving state) is created once, by its members only
(``use_local_synchronization``), and reused by every later layout that has the same ranks: a
reshape back to a layout seen before creates nothing, and the old layout's groups stay alive
until the new one is committed, which is what lets a failed reshape roll back.

Why the salt: torch names a locally synchronised group after its ranks and the process's
running group count, and only members count it, so two ranks with different histories would
name the same group differently and wait for each other forever. Every group is created with
the count set to a value all its members agree on (the epoch and the group's role), so the name
depends on what the group is, not on who created what before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ROLES = ("dp", "stage", "tp", "world", "moves", "solo")


class GroupCache:
    """This rank's groups by (role, ranks); ranks are default-group ranks."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        self.created = 0  # how many groups this rank has created (the benchmark reports it)
        self.generation = 0  # bumped by ``forget``: part of the salt, so a group made after a loss is new
        self.abandoned: list[dist.ProcessGroup] = []  # kept alive: dropping one may join a blocked thread
        self._bound: dict[int, int] = {}  # thread → the generation its work began under (``bind``)

    def bind(self) -> None:
        """The calling thread starts work (a reshape on the loss watch's pool) under the current
        generation: if a loss makes this rank abandon that work (``forget``), the thread gets no
        group of the next generation, which the survivors' recovery is creating meanwhile."""
        self._bound[threading.get_ident()] = self.generation

    def get(self, role: str, ranks: Sequence[int], epoch: int) -> dist.ProcessGroup:
        """The group of ``ranks`` for ``role``, created now by its members if it is new. Every
        member calls this for the same (role, ranks) in the same reshape; non-members never do.
        ``moves`` groups are gloo whatever the job's backend: the state they carry and the votes
        they take are CPU tensors (NCCL moves only GPU ones)."""
        generation = self._bound.get(threading.get_ident(), self.generation)
        if generation != self.generation:
            raise RuntimeError(f"group {role} {list(ranks)}: this work was abandoned when a rank was lost")
        key = (role, tuple(sorted(ranks)))
        if key[1] == tuple(range(dist.get_world_size())) and role in ("world",):
            world = dist.group.WORLD
            if world is None:
                raise RuntimeError("no default process group: call torch.distributed.init_process_group first")
            return world
        group = self._groups.get(key)
        if group is None:
            # The salt (see the module doc): the same on every member, distinct per epoch and role;
            # the count is put back after, so groups torch creates world-wide still agree on theirs.
            count = c10d._world.group_count
            c10d._world.group_count = (1_000_000 + generation * 100_000_000 + epoch * len(ROLES)
                                       + ROLES.index(role))
            try:
                made = dist.new_group(list(key[1]), timeout=self.timeout, use_local_synchronization=True,
                                      backend="gloo" if role == "moves" else None)
            finally:
                c10d._world.group_count = count
            assert isinstance(made, dist.ProcessGroup)
            if generation != self.generation:  # forgotten while it formed: not the survivors' group
                self.abandoned.append(made)
                raise RuntimeError(f"group {role} {list(ranks)}: this work was abandoned when a rank was lost")
            group = self._groups[key] = made
            self.created += 1
        return group

    def forget(self) -> None:
        """A rank was lost: no cached group is reused, since any of them may hold a half-done
        collective (a send nobody received) that a later one would match. Every survivor calls
        this once per loss, so the salts stay in step."""
        self.abandoned += self._groups.values()
        self._groups.clear()
        self.generation += 1
