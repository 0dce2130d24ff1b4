"""Each of trainer/torchtitan/cpu.py's adaptations removes one failure of torchtitan 0.3 on a CPU host.

Every test first shows the failure (the same call without the adaptation), then that the adaptation
removes it; the attention test also checks that the replacement computes exactly what a
per-document causal attention computes, forward and backward. They import torchtitan (seconds), so
they are in the slow tier; the FSDP one runs two gloo ranks.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch

from trainer.torchtitan import cpu

pytestmark = pytest.mark.skipif(cpu.has_accelerator(), reason="the adaptations apply only without an accelerator")


@pytest.mark.slow
def test_the_device_adaptation_points_torchtitan_at_the_cpu() -> None:
    from torchtitan.components import metrics
    from torchtitan.tools import utils

    if utils.device_type == "cuda":  # not adapted yet in this process: torchtitan picked CUDA and fails on it
        with pytest.raises((RuntimeError, AssertionError, AttributeError)):
            metrics.DeviceMemoryMonitor("cuda:0")
    cpu.use_cpu_device()
    assert utils.device_type == metrics.device_type == "cpu"
    monitor = metrics.DeviceMemoryMonitor("cpu:0")
    assert monitor.device_capacity > 0 and monitor.get_peak_stats().max_reserved_gib <= 0


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: list[list[int]]) -> torch.Tensor:
    """Attention computed document by document, causal inside each: what packing must equal."""
    out = torch.zeros_like(q)
    for b, lengths in enumerate(docs):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            qd, kd, vd = (t[b, sl].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
            out[b, sl] = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1)
            start += n
    return out


@pytest.mark.slow
def test_the_attention_adaptation_is_document_causal_attention_with_a_backward() -> None:
    from torchtitan.models.common.attention import (VarlenAttention, VarlenMetadata,
                                                    create_varlen_metadata_for_document)

    torch.manual_seed(0)
    docs = [[5, 3, 8], [16]]
    positions = torch.tensor([[*range(5), *range(3), *range(8)], list(range(16))])
    q, k, v = (torch.randn(2, 16, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    meta = create_varlen_metadata_for_document(positions)
    with pytest.raises(Exception):  # noqa: B017 - varlen attention is a CUDA flash kernel: any error will do
        VarlenAttention(VarlenAttention.Config())(q, k, v, attention_masks=meta)

    masked: Any = cpu._masked_sdpa_class()
    layer = masked(masked.Config())
    out = layer(q, k, v, attention_masks=VarlenMetadata(*meta[:4]))
    ref = _reference_attention(q, k, v, docs)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref_grads))


@pytest.mark.slow
def test_the_cuda_graph_adaptation_lets_a_pipelined_config_parse() -> None:
    from trainer.torchtitan.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.pipeline_parallel_degree = 2
    config.training.disable_cuda_graphs = False
    with pytest.raises(ValueError, match="CUDA graphs do not support pipeline parallelism"):
        config.__post_init__()
    cpu.disable_cuda_graphs(config)
    config.__post_init__()


def _fsdp_rank(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))

    def sharded() -> Any:  # a Linear that fully_shard made an FSDPModule
        model: Any = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        model.set_gradient_divide_factor(1.0)  # what torchtitan does: the loss is divided by the global token count
        return model

    x = torch.full((2, 4), float(rank + 1))
    try:
        sharded()(x).sum().backward()
        results[f"before-{rank}"] = "ok"
    except RuntimeError as exc:
        results[f"before-{rank}"] = str(exc)
    model = sharded()
    results[f"adapted-{rank}"] = cpu.force_sum_reduction([model])
    model(x).sum().backward()
    results[f"grad-{rank}"] = model.bias.grad.full_tensor().tolist()
    dist.destroy_process_group()
    # no interpreter teardown: a gloo or store thread still joinable there can abort the process
    # (SIGABRT) after the test's work is done (trainer/agent/sample_job.py's exit_now)
    os._exit(0)


@pytest.mark.processes
def test_the_fsdp_adaptation_reduces_gradients_with_a_sum_gloo_runs() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_rank, args=(port, results), nprocs=2)
        got = dict(results)
    assert "PREMUL_SUM" in got["before-0"] and "PREMUL_SUM" in got["before-1"]
    assert got["adapted-0"] == got["adapted-1"] == 1
    assert got["grad-0"] == got["grad-1"] == [4.0] * 4  # the bias gradient summed over both ranks' 2 rows
