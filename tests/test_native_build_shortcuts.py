"""The stage-build shortcuts (trainer/native/dtensor_rules.py) answer exactly what torch's own
functions answer; the reshape tests prove the whole build still trains like the reference."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.distributed.tensor import _api

from trainer.native.dtensor_rules import install_stage_build_shortcuts


class _Style:
    def hook(self, a, b, module, inputs, mesh):  # the shape of a TP style's input/output hook
        return inputs

    def other(self, a, module, inputs, mesh):
        return inputs


def test_a_partial_hook_has_the_signature_inspect_gives_whatever_it_binds():
    install_stage_build_shortcuts()
    memo = _api.inspect
    assert memo is not inspect
    cases: list[Callable[..., Any]] = [functools.partial(_Style().hook, 1, 2), functools.partial(_Style().hook, 1, 2),
             functools.partial(_Style().hook, 1), functools.partial(_Style().other, 1),
             functools.partial(_Style().hook, 1, b=2), functools.partial(lambda m, i, d: i),
             lambda m, i, d: i]
    for fn in cases:
        assert list(memo.signature(fn).parameters) == list(inspect.signature(fn).parameters), fn
    assert memo.Parameter is inspect.Parameter  # the rest of inspect is inspect's


def test_fsdp_contiguous_strides_are_torchs():
    install_stage_build_shortcuts()
    strides = _fsdp_param.make_contiguous_strides_for
    assert strides is not make_contiguous_strides_for
    for shape in [(), (3,), (4, 5), (2, 0, 3), torch.Size([7, 1, 2])]:
        for row_major in (True, False):
            assert strides(shape, row_major) == make_contiguous_strides_for(shape, row_major), (shape, row_major)
        assert strides(shape) == strides(shape)
