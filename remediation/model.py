"""The model being trained, in the terms the planner needs: how long each layer takes, how many
bytes of state it carries, and how many tokens a micro-batch holds.

Why a separate, small description rather than the torch model: the planner runs next to the bus,
not next to the GPUs, and at 100,000 GPUs it only needs prefix sums over per-layer numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class ModelSpec:
    """Per-layer costs of one micro-batch on one healthy device at TP 1.

    layer_time_s: forward + backward compute of each layer for one micro-batch (TP 1). The
        forward takes ``forward_fraction`` of it; under zero-bubble the backward splits evenly
        into B (input gradient) and W (weight gradient).
    layer_state_bytes: weights + gradients + optimizer state of one layer (all TP shards together).
    activation_bytes: what crosses a stage boundary per micro-batch (forward activations; the
        backward sends the same amount of gradients back).
    grad_bytes_per_layer: what the DP all-reduce moves per layer (default: state / 8, i.e. bf16
        gradients with mixed-precision Adam's 16 bytes per parameter).
    """

    layer_time_s: tuple[float, ...]
    layer_state_bytes: int
    activation_bytes: int
    tokens_per_microbatch: int
    forward_fraction: float = 1 / 3
    grad_bytes_per_layer: int | None = None
    _prefix: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_time_s:
            raise ValueError("a model needs at least one layer")
        if any(t <= 0 for t in self.layer_time_s):
            raise ValueError("every layer_time_s must be > 0")
        object.__setattr__(self, "_prefix", (0.0, *accumulate(self.layer_time_s)))

    @property
    def num_layers(self) -> int:
        return len(self.layer_time_s)

    @property
    def grad_bytes(self) -> int:
        return self.grad_bytes_per_layer if self.grad_bytes_per_layer is not None else self.layer_state_bytes // 8

    def layers_time_s(self, first: int, end: int) -> float:
        """Σ layer_time_s[first:end] in O(1)."""
        return self._prefix[end] - self._prefix[first]

    @property
    def prefix_s(self) -> tuple[float, ...]:
        return self._prefix

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        layer_time_s: float = 0.04,
        layer_state_bytes: int = 3 * 2**30,
        activation_bytes: int = 64 * 2**20,
        tokens_per_microbatch: int = 8192,
    ) -> ModelSpec:
        """A transformer of identical layers (defaults: roughly a 13B-class layer, 8k tokens/mb)."""
        return cls((layer_time_s,) * num_layers, layer_state_bytes, activation_bytes, tokens_per_microbatch)


class ModelSpecFile(BaseModel):
    """The JSON form of a ModelSpec (``resihp remediate --model FILE``); uniform layers."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(ge=1)
    layer_time_s: float = Field(gt=0)
    layer_state_bytes: int = Field(ge=0)
    activation_bytes: int = Field(ge=0)
    tokens_per_microbatch: int = Field(ge=1)

    def spec(self) -> ModelSpec:
        return ModelSpec.uniform(
            self.num_layers, layer_time_s=self.layer_time_s, layer_state_bytes=self.layer_state_bytes,
            activation_bytes=self.activation_bytes, tokens_per_microbatch=self.tokens_per_microbatch,
        )
