"""The model being trained, in the terms the planner costs layouts with: the cost model's
α·N + β·Σlᵢ² + γ per layer, what TP, PP and DP communicate, and how many bytes of state a layer
carries.

Why this form: it is the form the analytics cost model fits online (``analytics.cost_model``,
published as ``analytics.cost_model`` events) and the form the simulator computes its truth in
(``trainer/sim/cost.py``), so a candidate layout is scored the way it will actually run. A stage
of ``n`` layers on a TP group of ``tp`` devices costs, per micro-batch (forward):

    compute  = n · (linear·N + attn·Σlᵢ²) / tp  (+ head·N / tp on the last stage)   × compute slowdown
    overhead = n · overhead_s                                                        (TP does not divide it)
    tp comm  = n · 2(tp−1)/tp · tp_bytes·N / bandwidth + latency                     × link slowdown

and the backward ``backward_factor`` × the compute, the same overhead and TP communication. Where
the numbers come from: ``remediation.cost_figures`` builds them from the fitted cost lines and the
running plan (production), a benchmark from the simulator's presets, ``uniform`` from one
per-layer time (tests, demos).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


@dataclass(frozen=True)
class PlannerModel:
    """Healthy per-layer costs of one micro-batch (the workload's mean N and Σlᵢ²). A model file
    (``resihp remediate --model``) in the cost model's form is this class's fields as JSON, checked
    here; an unknown key is an error."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    num_layers: int
    layer_state_bytes: int
    """weights + gradients + optimizer state of one layer (all TP shards together)"""
    tokens_per_microbatch: float
    linear_s_per_token: float
    """forward linear-layer compute of one layer at TP 1, per token (α's compute)"""
    attn_s_per_sq_token: float = 0.0
    """forward attention of one layer at TP 1, per Σlᵢ² (β)"""
    sum_sq_per_microbatch: float = 0.0
    overhead_s: float = 0.0
    """per layer per chunk (kernel launches; γ); not divided by TP"""
    head_s_per_token: float = 0.0
    """the LM head's forward at TP 1, on the last stage only"""
    tp_bytes_per_token: float = 0.0
    """bytes all-reduced inside the TP group per token per layer per chunk (the payload of all of a
    layer's all-reduces; a ring moves 2(tp−1)/tp of it over each link)"""
    activation_bytes_per_token: float = 0.0
    """what crosses a stage boundary per token (forward; the backward sends the same amount back)"""
    grad_bytes_per_layer: float | None = None
    """what the DP all-reduce moves per layer (all TP shards together)"""
    backward_factor: float = 2.0
    """backward compute / forward compute (2 for a transformer)"""
    makespan_cv: float = 0.0
    """relative spread of one pipeline's iteration from iteration to iteration, the part that scales
    with the pipeline's length; the iteration waits for the slowest replica, so the spread sets how
    much the many healthy replicas already lose to bad luck (remediation.costs.expected_slowest_s)"""
    makespan_sd_s: float = 0.0
    """the part of that spread that does not scale with the length (seconds), for figures that
    measure it; ``cost_figures.calibrate_spread`` fits ``makespan_cv`` instead"""
    microbatch_cv: float = 0.0
    """relative spread of one micro-batch's chunk time across micro-batches (the packed mix of N and
    Σlᵢ²), shared by that micro-batch's chunks at every stage. A pipeline of varying chunks takes
    longer on average than one of mean chunks (~9 % for 7B TP8·PP4 at the simulator's 0.2): the
    scorer takes the expectation over this spread (remediation.costs.ScheduleModelScorer). From the
    cost model's ``workload_cv``."""
    tail_s: float = 0.0
    """what rare long stalls (a GC pause, a retransmit) add to the mean iteration on top of the
    slowest replica's typical time (seconds). A stall on any rank holds the whole synchronous step,
    whatever the layout, so it is a constant, not a spread; as a spread it made a replica well
    behind the others look nearly free. Fitted with ``makespan_cv`` by
    ``cost_figures.calibrate_spread`` (mean minus the body the median sees)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("a model needs at least one layer")
        if self.tokens_per_microbatch <= 0:
            raise ValueError("tokens_per_microbatch must be > 0")
        if self.linear_s_per_token <= 0 and self.attn_s_per_sq_token <= 0 and self.overhead_s <= 0:
            raise ValueError("a layer must cost something: give linear_s_per_token, attn_s_per_sq_token or overhead_s > 0")
        if min(self.linear_s_per_token, self.attn_s_per_sq_token, self.overhead_s, self.head_s_per_token,
               self.tp_bytes_per_token, self.activation_bytes_per_token, self.layer_state_bytes,
               self.sum_sq_per_microbatch, self.grad_bytes_per_layer or 0.0) < 0:
            raise ValueError("cost figures and sizes must be ≥ 0")
        if self.backward_factor <= 0:
            raise ValueError("backward_factor (backward compute / forward compute) must be > 0")
        if min(self.makespan_cv, self.makespan_sd_s, self.microbatch_cv, self.tail_s) < 0:
            raise ValueError("spreads (makespan_cv, makespan_sd_s, microbatch_cv, tail_s) must be ≥ 0")

    @property
    def grad_bytes(self) -> float:
        """DP all-reduce bytes per layer (default: bf16 gradients, state / 8 with Adam's 16 B/param)."""
        return self.grad_bytes_per_layer if self.grad_bytes_per_layer is not None else self.layer_state_bytes / 8

    def layer_compute_s(self) -> float:
        """Forward compute of one layer at TP 1, one mean micro-batch."""
        return self.linear_s_per_token * self.tokens_per_microbatch + self.attn_s_per_sq_token * self.sum_sq_per_microbatch

    def head_compute_s(self) -> float:
        return self.head_s_per_token * self.tokens_per_microbatch

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        layer_time_s: float = 0.04,
        layer_state_bytes: int = 3 * 2**30,
        activation_bytes: int = 64 * 2**20,
        tokens_per_microbatch: int = 8192,
    ) -> PlannerModel:
        """Identical layers taking ``layer_time_s`` (forward + backward, TP 1) per micro-batch, all
        compute (no attention term, no TP traffic): a simple model for tests and demos."""
        return cls(
            num_layers=num_layers, layer_state_bytes=layer_state_bytes, tokens_per_microbatch=tokens_per_microbatch,
            linear_s_per_token=layer_time_s / 3 / tokens_per_microbatch,
            activation_bytes_per_token=activation_bytes / tokens_per_microbatch,
        )


class UniformModelFile(BaseModel):
    """The simple form of a model file: identical layers taking ``layer_time_s`` (forward +
    backward of a layer at TP 1) per micro-batch (see ``PlannerModel.uniform``)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(ge=1)
    layer_state_bytes: int = Field(ge=0)
    tokens_per_microbatch: int = Field(gt=0)
    layer_time_s: float = Field(gt=0)
    activation_bytes: int = Field(default=0, ge=0, description="per micro-batch")

    def spec(self) -> PlannerModel:
        return PlannerModel.uniform(self.num_layers, layer_time_s=self.layer_time_s,
                                    layer_state_bytes=self.layer_state_bytes, activation_bytes=self.activation_bytes,
                                    tokens_per_microbatch=self.tokens_per_microbatch)


_COST_MODEL_FILE = TypeAdapter(PlannerModel)


def read_model_file(text: str) -> PlannerModel:
    """A model file (``resihp remediate --model FILE``): JSON in the simple form (``layer_time_s``,
    :class:`UniformModelFile`) or the cost model's form (every field of :class:`PlannerModel`).
    Raises pydantic's ValidationError, naming the field, on a bad one."""
    data = json.loads(text)
    if isinstance(data, dict) and "layer_time_s" in data:
        return UniformModelFile.model_validate(data).spec()
    return _COST_MODEL_FILE.validate_python(data)


def model_file(spec: PlannerModel) -> dict[str, Any]:
    """The file form of ``spec`` (cost model's form): ``read_model_file(json.dumps(model_file(s))) == s``."""
    return asdict(spec)
