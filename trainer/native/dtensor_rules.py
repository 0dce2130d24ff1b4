"""Shortcuts in DTensor's and FSDP2's set-up that cost most of building a stage on a new mesh.

Why: every new layout is a mesh DTensor has not seen, so its caches are cold and a stage build
pays, per parameter, for work whose answer is known in advance (measured with cProfile on the
TP1·PP2·DP4 → TP2·PP2·DP2 reshape of ``resihp bench reshape``, 8 ranks on 2 cores):

* ``detach`` — FSDP2 and the TP plan wrap every shard in an ``nn.Parameter``, which detaches it.
  torch 2.15 answers that by expanding a generic per-dimension strategy over the whole mesh, then
  runs the op under a fresh ``FakeTensorMode`` to learn the output's shape and stride. Detach is
  the identity on data, layout and metadata, so its rule is the input's spec and its metadata the
  input's: registered here as a plain propagation rule, with the metadata taken from the input.
* ``DeviceMesh._concatenate`` — FSDP2 over a TP-sharded parameter builds the (dp, tp) mesh of
  its sharding spec once *per parameter*, each a new ``DeviceMesh`` (layout algebra and a rank
  map remapped). The same two meshes give the same mesh, so it is built once per pair of meshes
  (keyed by the meshes' identities, which the memo keeps alive, so an id is never reused).

* ``inspect.signature`` in ``distribute_module`` — every TP style hands it two
  ``functools.partial`` hooks per linear, and it reads each one's signature only to count its
  arguments: on a partial of a bound method that is a fresh ``Signature`` built through
  ``_signature_get_partial`` each time, a tenth of the DP change's CPU (TP2·PP1·DP4, 8 ranks). The
  signature of a partial depends only on the function under it and which arguments it binds, so
  it is built once per (function, bound-method or not, number of positional arguments bound,
  keywords bound).

* ``make_contiguous_strides_for`` in FSDP2's per-parameter set-up — pure Python with a
  symbolic ``max`` per dimension, called twice per parameter for a handful of distinct shapes:
  memoised per shape of plain ints (a symbolic shape goes to torch's own).

Nothing else changes: every other op keeps torch's strategies. Each shortcut checks that this
torch has the hook it replaces and is skipped (the build is only slower) where it does not.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._op_schema import OpSchema

_SAME_META_OPS = (torch.ops.aten.detach.default,)


def install_stage_build_shortcuts() -> bool:
    """Idempotent; returns False where this torch lacks a hook (that shortcut is then skipped)."""
    return all([_install_detach_rule(), _install_concatenate_memo(), _install_signature_memo(),
                _install_strides_memo()])


def _install_detach_rule() -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    prop = DTensor._op_dispatcher.sharding_propagator
    needed = ("op_single_dim_strategy_funcs", "op_strategy_funcs", "register_op_strategy",
              "_propagate_tensor_meta_non_cached")
    if not all(hasattr(prop, name) for name in needed):
        return False

    def same_as_input(schema: OpSchema) -> OpStrategy:
        given = schema.args_schema[0]
        assert isinstance(given, OpStrategy)
        return OpStrategy([OpSpec(output_specs=s.output_spec, input_specs=(s.output_spec,),
                                  redistribute_cost=[[0.0] * len(given.strategies)]) for s in given.strategies])

    for op in _SAME_META_OPS:
        if getattr(prop.op_strategy_funcs.get(op), "__name__", "") == same_as_input.__name__:
            continue
        prop.op_single_dim_strategy_funcs.pop(op, None)
        prop.register_op_strategy(op, same_as_input)

    if not isinstance(prop._propagate_tensor_meta_non_cached, _InputMetaForIdentityOps):
        # mypy forbids replacing a method; replacing this propagator's is the shortcut
        prop._propagate_tensor_meta_non_cached = _InputMetaForIdentityOps(  # type: ignore[method-assign]
            prop._propagate_tensor_meta_non_cached)
    return True


class _InputMetaForIdentityOps:
    """The propagator's metadata step with the input's metadata for ``_SAME_META_OPS``; every other op
    runs torch's own step (``fake_run``). Being this class is how a second install sees the first."""

    def __init__(self, fake_run: Callable[[OpSchema], Any]) -> None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        self.fake_run = fake_run
        self.spec_type = DTensorSpec

    def __call__(self, op_schema: OpSchema) -> Any:
        given = op_schema.args_schema[0] if op_schema.args_schema else None
        if op_schema.op in _SAME_META_OPS and isinstance(given, self.spec_type) and given.tensor_meta is not None:
            return given.tensor_meta
        return self.fake_run(op_schema)


def _replace(owner: Any, name: str, kind: type, make: Callable[[Any], Any]) -> bool:
    """``owner.name`` becomes ``make(its torch original)`` unless it is a ``kind`` already (a second
    install); False where this torch has no such name (the shortcut is then skipped)."""
    current = getattr(owner, name, None)
    if current is None:
        return False
    if not isinstance(current, kind):
        setattr(owner, name, make(current))
    return True


def _install_concatenate_memo() -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return _replace(DeviceMesh, "_concatenate", _MemoisedConcatenate,
                    lambda concatenate: staticmethod(_MemoisedConcatenate(concatenate)))


class _MemoisedConcatenate:
    """``DeviceMesh._concatenate`` built once per list of meshes. The key is the meshes' identities;
    the memo keeps the meshes alive, so an id is never reused. Being this class is how a second
    install sees the first."""

    def __init__(self, concatenate: Callable[[list[DeviceMesh]], DeviceMesh]) -> None:
        self.concatenate = concatenate
        self.made: dict[tuple[int, ...], tuple[list[DeviceMesh], DeviceMesh]] = {}

    def __call__(self, device_mesh_list: list[DeviceMesh]) -> DeviceMesh:
        key = tuple(id(m) for m in device_mesh_list)
        hit = self.made.get(key)
        if hit is None:
            hit = self.made[key] = (list(device_mesh_list), self.concatenate(device_mesh_list))
        return hit[1]


def _install_signature_memo() -> bool:
    from torch.distributed.tensor import _api

    return _replace(_api, "inspect", _MemoisedSignatures, lambda _: _MemoisedSignatures())  # its module-level name


class _MemoisedSignatures:
    """The ``inspect`` module as ``distribute_module`` sees it, with ``signature`` of a
    ``functools.partial`` built once per (function under it, bound-method or not, positional
    arguments bound, keywords bound), the only things that signature depends on. Anything else
    is ``inspect``'s own. Being this class is how a second install sees the first."""

    def __init__(self) -> None:
        self.made: dict[tuple, inspect.Signature] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    def signature(self, fn: Callable[..., Any]) -> inspect.Signature:
        if not isinstance(fn, functools.partial):
            return inspect.signature(fn)
        under = fn.func
        key = ((under.__func__, True) if isinstance(under, types.MethodType) else (under, False),
               len(fn.args), tuple(sorted(fn.keywords)))
        try:
            hit = self.made.get(key)
        except TypeError:  # an unhashable callable under the partial
            return inspect.signature(fn)
        if hit is None:
            hit = self.made[key] = inspect.signature(fn)
        return hit


def _install_strides_memo() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return _replace(_fsdp_param, "make_contiguous_strides_for", _MemoisedStrides, _MemoisedStrides)


class _MemoisedStrides:
    """``make_contiguous_strides_for`` once per (shape, row_major) of plain ints. Being this class is
    how a second install sees the first."""

    def __init__(self, strides: Callable[..., tuple]) -> None:
        self.strides = strides
        self.made: dict[tuple, tuple] = {}

    def __call__(self, shape: Any, row_major: bool = True) -> tuple:
        key = (tuple(shape), row_major)
        if not all(type(d) is int for d in key[0]):
            return self.strides(shape, row_major)
        hit = self.made.get(key)
        if hit is None:
            hit = self.made[key] = self.strides(shape, row_major)
        return hit
