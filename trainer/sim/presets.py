"""What is simulated: a model, a GPU and a cluster, with presets.

Model presets are Llama-2/-style shapes (7B: 32 layers × 4096; 13B: 40 × 5120; 30B-class: 60 ×
6656; 70B: 80 × 8192); the FLOP counts in ``cost`` use a plain GPT block (4h MLP), which is close
enough for timing. GPU and link figures are H100-SXM data-sheet numbers derated to what training
jobs typically reach (``efficiency``), not measurements.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    vocab: int = Field(ge=1)
    bytes_per_value: int = Field(default=2, ge=1, description="bf16 activations and gradients")

    @property
    def params_per_layer(self) -> int:
        return 12 * self.hidden * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + 2 * self.vocab * self.hidden


MODEL_PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", layers=8, hidden=1024, heads=16, vocab=32_000),
    "7b": ModelSpec(name="7b", layers=32, hidden=4096, heads=32, vocab=32_000),
    "13b": ModelSpec(name="13b", layers=40, hidden=5120, heads=40, vocab=32_000),
    "30b": ModelSpec(name="30b", layers=60, hidden=6656, heads=52, vocab=32_000),
    "70b": ModelSpec(name="70b", layers=80, hidden=8192, heads=64, vocab=32_000),
}


class ClusterSpec(BaseModel):
    """Nodes of ``gpus_per_node`` GPUs; NVLink inside a node, one NIC per GPU between nodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    peak_flops: float = Field(default=989e12, gt=0, description="H100 SXM dense bf16")
    efficiency: float = Field(default=0.5, gt=0, le=1, description="fraction of peak a chunk reaches")
    intra_node_gbps: float = Field(default=2400.0, gt=0, description="NVLink, Gbit/s per GPU (~300 GB/s)")
    inter_node_gbps: float = Field(default=400.0, gt=0, description="one 400G NIC per GPU")
    link_latency_s: float = Field(default=10e-6, ge=0)
    layer_overhead_s: float = Field(default=40e-6, ge=0, description="kernel launches etc. per layer per chunk")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def node_of(self, device: int) -> int:
        return device // self.gpus_per_node

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.efficiency
