"""Disk checkpoints in layout-free form: written by any layout, loaded into any layout.

Replica 0 of the plan gathers each unit (embeddings, a layer, the head) to full size inside its TP
groups and writes one file per unit (parameter + AdamW moments); every world member then meets at
a barrier, and only after it does world rank 0 write ``meta.json`` (iteration, epoch, run id), so a
directory with ``meta.json`` is complete. Any layout loads it by cutting its own shards.

Two uses:

* ``--save-dir D``: the final state at the end of the run, in ``D`` itself; ``--resume-dir`` starts
  a run from such a directory.
* ``--checkpoint-every K`` (with ``--save-dir D``): every K iterations a checkpoint in
  ``D/step-<iteration>`` (the two newest of this run are kept). This is the fallback of a reshape
  when no live copy of some unit survives (every replica lost a device that held it): the
  executor then loads :func:`latest_checkpoint` — the newest complete periodic checkpoint of this
  run, or the run's ``--resume-dir`` — on every rank, rolls the iteration back to it and re-runs
  the iterations since (the acknowledgement says so).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.reference.chunks import LayerRange, role_chunks, units_of_chunks
from trainer.reference.model import GPTConfig, GPTStage, shard, shard_rule
from trainer.reference.parallel import PlanWorld, gather_tp
from trainer.reference.state import ShardState, export_state, flatten, reassemble, unflatten, unit_names

KEEP_PERIODIC = 2


def periodic_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"step-{iteration:08d}"


def save_checkpoint(directory: str | Path, layout: PlanWorld, me: int, stage: GPTStage | None, opt, iteration: int,
                    tp_devices: tuple[int, ...] | None, barrier: Callable[[], None], run_id: str = "") -> None:
    """Every world member calls this. Replica 0 writes each unit at full size; after ``barrier``
    world rank 0 writes ``meta.json`` (the mark of a complete checkpoint)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = layout.plan
    role = plan.roles.get(me)
    if stage is not None and role is not None and role.replica == plan.pipelines[0].replica:
        state = export_state(stage, opt)
        for unit in units_of_chunks(plan.num_layers, role_chunks(plan, role)):
            names = unit_names(stage.cfg, unit)
            flat = flatten(state, names)
            if role.tp_degree > 1:
                assert tp_devices is not None, "a TP stage's checkpoint needs its group's devices"
                flats = gather_tp(flat, stage.tp, tp_devices, layout)
                pieces = [unflatten(stage.cfg, f, names, role.tp_degree) for f in flats]
            else:
                pieces = [unflatten(stage.cfg, flat, names, 1)]
            if role.tp_rank == 0:
                full = reassemble(stage.cfg, pieces, names, 1, 0)
                torch.save(full, directory / f"{unit}.pt.tmp")
                (directory / f"{unit}.pt.tmp").replace(directory / f"{unit}.pt")
    barrier()
    if layout.rank(me) == 0:
        meta = {"iteration": iteration, "epoch": plan.epoch, "run_id": run_id}
        (directory / "meta.json.tmp").write_text(json.dumps(meta))
        (directory / "meta.json.tmp").replace(directory / "meta.json")


def prune_periodic(save_dir: str | Path, run_id: str, keep: int = KEEP_PERIODIC) -> None:
    """Delete this run's periodic checkpoints but the ``keep`` newest (world rank 0 calls it)."""
    mine = sorted(d for d, meta in _periodic(save_dir) if meta.get("run_id") == run_id)
    for d in mine[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def _periodic(save_dir: str | Path) -> list[tuple[Path, dict]]:
    out = []
    for d in Path(save_dir).glob("step-*"):
        try:
            out.append((d, json.loads((d / "meta.json").read_text())))
        except (OSError, ValueError):
            continue  # incomplete (no meta yet) or unreadable: not a checkpoint
    return out


def latest_checkpoint(save_dir: str | None, resume_dir: str | None, run_id: str) -> tuple[Path, int] | None:
    """The newest complete checkpoint this run may fall back to, and its iteration (None: none)."""
    found: list[tuple[int, Path]] = []
    if save_dir:
        found += [(int(m["iteration"]), d) for d, m in _periodic(save_dir) if m.get("run_id") == run_id]
    if resume_dir and (Path(resume_dir) / "meta.json").exists():
        found.append((int(json.loads((Path(resume_dir) / "meta.json").read_text())["iteration"]), Path(resume_dir)))
    if not found:
        return None
    iteration, directory = max(found)
    return directory, iteration


def load_checkpoint(directory: str | Path, cfg: GPTConfig, chunks: tuple[LayerRange, ...], tp_degree: int,
                    tp_rank: int) -> tuple[ShardState, int]:
    """This rank's shards (of the units its ``chunks`` hold) of a checkpoint written by any
    layout, and the iteration it was taken at."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    out: ShardState = {}
    for unit in units_of_chunks(cfg.n_layer, chunks):
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
