"""The detector's settings: defaults that work on one machine, overridable from a YAML file.

The statistic is a one-sided CUSUM on z, a rank's centred log-ratio of own compute to the cost
model's prediction (see analytics/detection/scoring.py):

    S ← max(0, S + min(z − k, cap·h)),  alarm when S > h
    k = max(k_sigma·σ, log(min_slowdown)),  h = max(h_sigma·σ, log(min_alarm_factor)),  cap = step_cap

σ is the robust spread (1.4826·MAD) of z over recent iterations of healthy ranks, floored at
``sigma_floor``, or the rank's own spread when that is larger (``rank_noise_iterations``): a rank
whose z is noisier than the job's is judged against its own noise. Why: after a reshape a TP group
may run a layer range nobody else runs; its cost class is then fitted on its own last few
iterations, so its z carries its own jitter twice (≈ 2.5× the job's σ in the simulator), and the
job's thresholds opened ×1.04 incidents on it every half hour or so. ``k`` ignores noise and
slowdowns below ``min_slowdown``; ``h`` sets how much accumulated excess is proof; ``step_cap`` < 1 means no single iteration can raise an alarm, so a
one-off spike (a GC pause, a checkpoint) never opens an incident, while ×1.2 and more are caught
on the second iteration.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class DetectorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    window_iterations: int = Field(default=8, ge=1)
    """cost-model and noise window"""
    k_sigma: float = Field(default=1.5, gt=0)
    h_sigma: float = Field(default=8.0, gt=0)
    min_slowdown: float = Field(default=1.02, gt=1.0)
    """drift allowance k never goes below log of this"""
    min_alarm_factor: float = Field(default=1.06, gt=1.0)
    """threshold h never goes below log of this"""
    min_incident_factor: float = Field(default=1.03, gt=1.0)
    """the detector's smallest incident: a fail-slow (rank, link, communication, a probe's find alike) opens and is
    confirmed only above this size. At or under it a reading is within what a healthy device or link reads (the
    probes' own bar, probe_confirm_ratio, is ×1.03); the smallest slowdown the accuracy suite grades, ×1.05, reads
    ×1.036 in chunk time where only one rank of its TP group is traced (megatron)"""
    step_cap: float = Field(default=0.6, gt=0, le=1.0)
    """largest CUSUM step, as a fraction of h"""
    sigma_floor: float = Field(default=0.004, gt=0)
    rank_noise_iterations: int = Field(default=64, ge=0)
    """span of each rank's own noise estimate (a running median of |Δz| between its iterations); a rank noisier
    than the job is judged with its own σ; 0: every rank with the job's σ"""
    mix_hold_iterations: int = Field(default=8, ge=0)
    """without sequence lengths: iterations in a row a replica slow on every stage at once is taken for its mix of
    long documents (a burst lasts a few); past that it is judged in full (0: never taken for its mix)"""
    confirm_iterations: int = Field(default=3, ge=1)
    """persistence needed to confirm"""
    resolve_iterations: int = Field(default=3, ge=1)
    """healthy iterations needed to resolve"""
    update_min_change: float = Field(default=0.10, ge=0)
    """relative factor change that earns an update"""
    refine_iterations: list[int] = Field(default=[8, 32, 128])
    """slow iterations after which a fail-slow's size is estimated again, as their median ([]: never): the size
    at opening comes from 3 iterations, one of which may be from before the onset; 8 correct that soon; where
    one iteration is noisy to ~1.5 % (1,024 GPUs) 32 are good to ~0.4 % (1 % at worst) and 128 (~40 s there) to
    ~0.2 %"""
    refine_min_change: float = Field(default=0.005, ge=0)
    """relative change that earns the refined size an update: 0.5 % in a chunk slowdown is about 1 % in the
    GPU's compute factor the planner reads (compute is about half a chunk at TP 8), and about the 8-iteration
    median's own error"""
    heartbeat_miss_intervals: float = Field(default=3.0, gt=0)
    """missed intervals that make a rank dead, in event time relative to the other ranks' progress
    (analytics/detection/fail_stop.py)"""
    reference_max_lag_intervals: float = Field(default=20.0, gt=0)
    """the job's reference time never trails its newest event by more than this many intervals, so a third or
    more of the job dying at once is still judged; a partition lagging longer than this while the job hangs
    looks dead"""
    hang_miss_intervals: float = Field(default=1.5, gt=0)
    """the same while the job is hung: no iteration completed for hang_stall_iterations typical iterations and
    one heartbeat interval"""
    hang_stall_iterations: float = Field(default=3.0, gt=0)
    """typical iterations without a completed one that make the job hung"""
    telemetry_lag_iterations: int = Field(default=3, ge=1)
    """iterations in a row a rank's own stream moved on without its report"""
    flush_lag_iterations: int = Field(default=2, ge=1)
    """only for ranks that never heartbeat: score an iteration without them once reports this many iterations
    later arrived (analytics/detection/arrival.py)"""
    unplanned_wait_iterations: int = Field(default=16, ge=1)
    """without the epoch's plan (plan.current): wait for reports this many iterations later before scoring an
    iteration with the ranks heard from"""
    max_wait_iterations: int = Field(default=64, ge=1)
    """memory guard: an iteration is scored once reports this far ahead arrived"""
    chunk_quantile: float | None = Field(default=0.5, gt=0, lt=1)
    """rank score: this quantile of its chunks' log(own/predicted) per kind (robust to OS preemption); null: log
    of the summed ratio"""
    cost_publish_change: float = Field(default=0.05, gt=0)
    """publish analytics.cost_model when a class's prediction moved this much"""
    cost_publish_min_iterations: int = Field(default=5, ge=1)
    """at most one analytics.cost_model per this many iterations (first of an epoch excepted)"""
    probes: bool = Field(default=False)
    """ask suspects to run a probe and confirm from its result"""
    probe_confirm_ratio: float = Field(default=1.03, gt=1.0)
    excluded_probe_iterations: int = Field(default=100, ge=0)
    """with probes: probe a slow rank the plan left out this many iterations after, then twice as long after
    each probe, and resolve its incident once it measures healthy (0: never)"""
    links: bool = Field(default=True)
    """score point-to-point links as well as ranks"""
    untraced_sweep_steps: int = Field(default=16, ge=0)
    """with probes and ranks nobody traces: probe those ranks' compute every this many traced iterations (0: never);
    each sweep pauses training for one probe, and finds a slowdown the job's lateness cannot show"""
    untraced_suspicion_rate: float = Field(default=0.02, ge=0, lt=1)
    """with probes and replicas nobody traces: a traced iteration later than a healthy one would be this often (the
    same predictive tail) brings the sweep forward, so a slow untraced GPU is named and sized by its probe at once; each
    costs a probe's pause, on about this share of a healthy job's traced iterations (0: only the periodic sweep)"""
    untraced_run_rate: float = Field(default=1e-6, gt=0, lt=1)
    """with replicas nobody traces: a run of 2-3 late traced iterations opens an incident on its own when a healthy
    run that late would come this rarely per traced iteration (the predictive tail of the job's own healthy excess,
    analytics/detection/untraced.py HiddenExcess); a smaller excess waits for 4 traced iterations"""

    @field_validator("refine_iterations")
    @classmethod
    def _refine_points_increase(cls, points: list[int]) -> list[int]:
        """Each point is a longer window of the same slow iterations: one out of order would size
        the incident again on fewer of them than the point before."""
        if any(n < 1 for n in points) or any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(f"refine_iterations must be positive and increasing, got {points}")
        return points

    @property
    def log_min_slowdown(self) -> float:
        return math.log(self.min_slowdown)

    @property
    def log_min_alarm(self) -> float:
        return math.log(self.min_alarm_factor)

    @classmethod
    def load(cls, path: str | Path | None) -> DetectorConfig:
        """Defaults, or the YAML mapping at ``path`` (unknown keys are an error that names them)."""
        if path is None:
            return cls()
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"detector config {path} does not exist; pass an existing YAML file or "
                                    "drop --detector-config for the defaults") from None
        return cls.model_validate(data)
