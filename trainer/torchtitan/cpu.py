"""torchtitan on a machine with no accelerator: the four adaptations, in one place.

torchtitan 0.3 is written for GPUs. On a CPU-only host it trains its debug Llama with gloo once four
things change; each function below removes one failure, and :func:`adapt` applies them only when
torch sees no accelerator, so a GPU job runs torchtitan untouched.

1. **Device type** (:func:`use_cpu_device`). ``torchtitan.tools.utils`` picks ``cuda`` when torch
   reports no accelerator, and several modules copy that name (and ``torch.cuda``) at import; the
   first ``torch.cuda.set_device`` then fails ("Torch not compiled with CUDA enabled" or "no CUDA GPUs
   are available"). Every copy is pointed at ``cpu`` and at :class:`CpuDeviceModule`, which answers
   the calls torchtitan's memory monitor makes (device name, capacity, peak statistics).
2. **Attention** (:func:`use_masked_sdpa`). The debug model's FlexAttention needs a compiled kernel
   whose backward does not exist on CPU, and varlen attention is a CUDA flash kernel. Both are
   replaced by :class:`MaskedSDPAttention`: the same document-causal attention (a token sees earlier
   tokens of its own packed document) computed by building the mask from the documents' offsets and
   calling ``scaled_dot_product_attention``; exact, and quadratic in each document's length as the
   detector's cost model expects.
3. **FSDP2's gradient reduction** (:func:`force_sum_reduction`). torchtitan turns FSDP's division
   off and reduce-scatters with ``PREMUL_SUM``, which gloo does not implement ("unsupported reduce
   op"); a plain SUM is the same reduction here (the loss is already divided by the global token
   count).
4. **CUDA graphs** (:func:`disable_cuda_graphs`): captured only on CUDA; a pipeline-parallel config
   is refused unless they are off.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

# torchtitan modules that copy ``device_type`` / ``device_module`` at import (torchtitan 0.3.0).
_DEVICE_NAME_HOLDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)


def has_accelerator() -> bool:
    """What torchtitan asks: does torch see a CUDA, XPU, MPS … device?"""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


class _CpuProperties:
    def __init__(self) -> None:
        self.name = "cpu"
        self.total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CpuDeviceModule(types.SimpleNamespace):
    """``torch.cpu`` plus the device calls torchtitan makes of ``torch.cuda``: no statistics, so its
    memory lines read 0 GiB instead of failing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(_device: object) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(_device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(_device: object = None) -> _CpuProperties:
        return _CpuProperties()

    @staticmethod
    def reset_peak_memory_stats(_device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(_device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def synchronize(_device: object = None) -> None:
        return None


def use_cpu_device() -> None:
    """Point every torchtitan module that named the device at ``cpu`` (adaptation 1)."""
    import importlib

    module = CpuDeviceModule()
    for name in _DEVICE_NAME_HOLDERS:
        holder = sys.modules.get(name) or importlib.import_module(name)
        if hasattr(holder, "device_type"):
            setattr(holder, "device_type", "cpu")  # noqa: B010 - a module attribute other modules read
        if hasattr(holder, "device_module"):
            setattr(holder, "device_module", module)  # noqa: B010


def _masked_sdpa_class() -> type:
    """Defined on first use: its base class is torchtitan's, imported only when torchtitan runs."""
    global _MASKED_SDPA
    if _MASKED_SDPA is not None:
        return _MASKED_SDPA
    import torch.nn.functional as F
    from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
    from torchtitan.protocols.module import Module

    class MaskedSDPAttention(VarlenAttention):
        """Document-causal attention as a mask and ``scaled_dot_product_attention`` (adaptation 2).

        It keeps VarlenAttention's contract (the trainer hands it the documents' cumulative offsets,
        ``VarlenMetadata``, built from each sample's positions) so torchtitan builds the same
        metadata it builds on a GPU; the mask is (B, 1, L, L), True where query and key are in the
        same document and the key is not later than the query."""

        @dataclass(kw_only=True, slots=True)
        class Config(VarlenAttention.Config):
            pass

        def __init__(self, config: Config) -> None:
            Module.__init__(self)  # VarlenAttention's own __init__ selects a CUDA flash kernel
            self.window_size = config.window_size

        def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                    attention_masks: VarlenMetadata, scale: float | None = None, **kwargs: Any) -> torch.Tensor:
            B, L = q_BLNH.shape[0], q_BLNH.shape[1]
            mask = document_causal_mask(attention_masks.cu_seq_q, B, L)  # (B, 1, L, L)
            out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2),
                                                 v_BLNH.transpose(1, 2), attn_mask=mask, scale=scale,
                                                 enable_gqa=bool(kwargs.get("enable_gqa", False)))
            return out.transpose(1, 2)  # (B, L, N, H)

    _MASKED_SDPA = MaskedSDPAttention
    return MaskedSDPAttention


_MASKED_SDPA: type | None = None


def document_causal_mask(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(B, 1, L, L) boolean mask from packed cumulative offsets over the B·L tokens of a batch
    (``[0, l0, l0+l1, …, B·L]``, each sample's first document starting at a multiple of L)."""
    total = batch * seq_len
    starts = torch.zeros(total, dtype=torch.int64, device=cu_seqlens.device)
    inner = cu_seqlens[1:-1].to(torch.int64)
    starts[inner[inner < total]] = 1
    doc = torch.cumsum(starts, 0).view(batch, seq_len)  # document index of every token
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)  # (B, L, L)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (same_doc & causal).unsqueeze(1)


def use_masked_sdpa(config: Any) -> None:
    """Swap every FlexAttention or varlen inner attention of the model config for
    :class:`MaskedSDPAttention` (adaptation 2). ``config`` is torchtitan's ``Trainer.Config``."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    masked: Any = _masked_sdpa_class()
    for cls in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, found, parent, attr in list(config.model_spec.model.traverse(cls)):
            if isinstance(found, masked.Config) or parent is None:
                continue
            replacement = masked.Config()
            if isinstance(attr, int):
                parent[attr] = replacement
            else:
                setattr(parent, attr, replacement)


def force_sum_reduction(model_parts: list[torch.nn.Module]) -> int:
    """Reduce FSDP2 gradients with SUM, not PREMUL_SUM (adaptation 3); returns how many FSDP modules."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                n += 1
    return n


def disable_cuda_graphs(config: Any) -> None:
    """Adaptation 4."""
    config.training.disable_cuda_graphs = True


def adapt(config: Any) -> bool:
    """Apply the config-time adaptations when no accelerator is present; returns whether it did.
    :func:`force_sum_reduction` runs later, on the parallelised model."""
    if has_accelerator():
        return False
    use_cpu_device()
    use_masked_sdpa(config)
    disable_cuda_graphs(config)
    return True
