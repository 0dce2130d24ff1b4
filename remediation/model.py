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

from dataclasses import dataclass, fields

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class PlannerModel:
    """Healthy per-layer costs of one micro-batch (the workload's mean N and Σlᵢ²).

    linear_s_per_token: forward linear-layer compute of one layer at TP 1, per token (α's compute).
    attn_s_per_sq_token: forward attention of one layer at TP 1, per Σlᵢ² (β).
    overhead_s: per layer per chunk (kernel launches; γ); not divided by TP.
    head_s_per_token: the LM head's forward at TP 1, on the last stage only.
    tp_bytes_per_token: bytes all-reduced inside the TP group per token per layer per chunk (the
        payload of all of a layer's all-reduces; a ring moves 2(tp−1)/tp of it over each link).
    activation_bytes_per_token: what crosses a stage boundary per token (forward; the backward
        sends the same amount back).
    layer_state_bytes: weights + gradients + optimizer state of one layer (all TP shards together).
    grad_bytes_per_layer: what the DP all-reduce moves per layer (all TP shards together).
    backward_factor: backward compute / forward compute (2 for a transformer).
    makespan_cv: relative spread of one pipeline's iteration from iteration to iteration, the
        part that scales with the pipeline's length; the iteration waits for the slowest replica,
        so the spread sets how much the many healthy replicas already lose to bad luck
        (remediation.costs.expected_slowest_s).
    makespan_sd_s: the part of that spread that does not scale with the length (seconds), for
        figures that measure it; ``cost_figures.calibrate_spread`` fits ``makespan_cv`` instead.
    microbatch_cv: relative spread of one micro-batch's chunk time across micro-batches (the packed
        mix of N and Σlᵢ²), shared by that micro-batch's chunks at every stage. A pipeline of
        varying chunks takes longer on average than one of mean chunks (~9 % for 7B TP8·PP4 at
        the simulator's 0.2): the scorer takes the expectation over this spread
        (remediation.costs.ScheduleModelScorer). From the cost model's ``workload_cv``.
    tail_s: what rare long stalls (a GC pause, a retransmit) add to the mean iteration on top of
        the slowest replica's typical time (seconds). A stall on any rank holds the whole
        synchronous step, whatever the layout, so it is a constant, not a spread; as a spread it
        made a replica well behind the others look nearly free. Fitted with ``makespan_cv`` by
        ``cost_figures.calibrate_spread`` (mean minus the body the median sees).
    """

    num_layers: int
    layer_state_bytes: int
    tokens_per_microbatch: float
    linear_s_per_token: float
    attn_s_per_sq_token: float = 0.0
    sum_sq_per_microbatch: float = 0.0
    overhead_s: float = 0.0
    head_s_per_token: float = 0.0
    tp_bytes_per_token: float = 0.0
    activation_bytes_per_token: float = 0.0
    grad_bytes_per_layer: float | None = None
    backward_factor: float = 2.0
    makespan_cv: float = 0.0
    makespan_sd_s: float = 0.0
    microbatch_cv: float = 0.0
    tail_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("a model needs at least one layer")
        if self.tokens_per_microbatch <= 0:
            raise ValueError("tokens_per_microbatch must be > 0")
        if self.linear_s_per_token <= 0 and self.attn_s_per_sq_token <= 0 and self.overhead_s <= 0:
            raise ValueError("a layer must cost something: give linear_s_per_token, attn_s_per_sq_token or overhead_s > 0")
        if min(self.linear_s_per_token, self.attn_s_per_sq_token, self.overhead_s, self.head_s_per_token,
               self.tp_bytes_per_token, self.activation_bytes_per_token) < 0:
            raise ValueError("cost figures must be ≥ 0")
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


class ModelSpecFile(BaseModel):
    """The JSON form of a PlannerModel (``resihp remediate --model FILE``).

    Either the simple form (``layer_time_s``: forward + backward of a layer at TP 1) or the cost
    model's form (``linear_s_per_token`` and the rest, see :class:`PlannerModel`)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(ge=1)
    layer_state_bytes: int = Field(ge=0)
    tokens_per_microbatch: float = Field(gt=0)
    layer_time_s: float | None = Field(default=None, gt=0)
    activation_bytes: int = Field(default=0, ge=0, description="per micro-batch (simple form)")
    linear_s_per_token: float | None = Field(default=None, ge=0)
    attn_s_per_sq_token: float = Field(default=0.0, ge=0)
    sum_sq_per_microbatch: float = Field(default=0.0, ge=0)
    overhead_s: float = Field(default=0.0, ge=0)
    head_s_per_token: float = Field(default=0.0, ge=0)
    tp_bytes_per_token: float = Field(default=0.0, ge=0)
    activation_bytes_per_token: float | None = Field(default=None, ge=0)
    grad_bytes_per_layer: float | None = Field(default=None, ge=0)
    backward_factor: float = Field(default=2.0, gt=0)
    makespan_cv: float = Field(default=0.0, ge=0)
    makespan_sd_s: float = Field(default=0.0, ge=0)
    microbatch_cv: float = Field(default=0.0, ge=0)
    tail_s: float = Field(default=0.0, ge=0)

    @classmethod
    def of(cls, spec: PlannerModel) -> ModelSpecFile:
        """The file form of ``spec`` (cost-model form); ``ModelSpecFile.of(s).spec() == s``."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(PlannerModel)})

    def spec(self) -> PlannerModel:
        if self.linear_s_per_token is None:
            if self.layer_time_s is None:
                raise ValueError("a model file needs layer_time_s (simple form) or linear_s_per_token (cost-model form)")
            return PlannerModel.uniform(self.num_layers, layer_time_s=self.layer_time_s,
                                     layer_state_bytes=self.layer_state_bytes, activation_bytes=self.activation_bytes,
                                     tokens_per_microbatch=int(self.tokens_per_microbatch))
        act = (self.activation_bytes_per_token if self.activation_bytes_per_token is not None
               else self.activation_bytes / self.tokens_per_microbatch)
        return PlannerModel(
            num_layers=self.num_layers, layer_state_bytes=self.layer_state_bytes,
            tokens_per_microbatch=self.tokens_per_microbatch, linear_s_per_token=self.linear_s_per_token,
            attn_s_per_sq_token=self.attn_s_per_sq_token, sum_sq_per_microbatch=self.sum_sq_per_microbatch,
            overhead_s=self.overhead_s, head_s_per_token=self.head_s_per_token,
            tp_bytes_per_token=self.tp_bytes_per_token, activation_bytes_per_token=act,
            grad_bytes_per_layer=self.grad_bytes_per_layer, backward_factor=self.backward_factor,
            makespan_cv=self.makespan_cv, makespan_sd_s=self.makespan_sd_s, microbatch_cv=self.microbatch_cv,
            tail_s=self.tail_s,
        )
