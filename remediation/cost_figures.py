"""The planner's cost figures from what the job publishes: the analytics cost model's fitted lines
(``analytics.cost_model`` events: α·N + β·Σlᵢ² + γ per stage and chunk kind) and the running plan
with its model facts (``plan.current``).

A fitted line describes a stage as it runs now — n layers on a TP group of tp devices — so its
α mixes the layers' compute (which TP divides) with the TP all-reduces (which it does not). To
cost the same layers on a different group (a smaller TP after a failure, more layers after a
re-split) the two must be told apart. The all-reduce payload follows from the model width, which
follows from the state bytes of a layer (12·h² parameters at 16 bytes each, bf16 values), and
its time from the hardware's bandwidth; the rest of α is compute. The same for γ (launch overhead
vs all-reduce latency), β (attention only), the LM head (what the last stage costs beyond the
others), and the backward's factor (B over F).

What can go wrong: with fixed-length packing N never varies and the fit cannot tell α from γ (it
puts α·N in γ, whether or not Σl² varies); such a line is read as per-token cost at the mean N.
Fits from too few samples, or a plan whose stages differ, give noisy figures — the median over
stages is used; a stage whose α is smaller than the all-reduce estimate means the
bandwidth is underestimated, and then everything is counted as compute (tp_bytes_per_token = 0).
Without fits the caller keeps its fallback (``--model``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median

from collector.events import CostFit, PlanCurrent
from collector.plan import Plan
from remediation.cluster import ClusterState, Hardware
from remediation.costs import ALLREDUCES_PER_LAYER, ring_factor
from remediation.model import PlannerModel

BYTES_PER_PARAMETER_STATE = 16  # bf16 weights + grads, fp32 master + two Adam moments
BYTES_PER_VALUE = 2  # bf16 activations and gradients


def hidden_size(layer_state_bytes: int) -> int:
    """The model width implied by a transformer layer's state (12·h² parameters)."""
    return int(round(math.sqrt(layer_state_bytes / BYTES_PER_PARAMETER_STATE / 12))) if layer_state_bytes else 0


def model_from_fits(
    fits: Sequence[CostFit], current: PlanCurrent, hardware: Hardware, *,
    tokens_per_microbatch: float | None = None, sum_sq_per_microbatch: float | None = None,
    mean_document_tokens: float = 1024.0,
) -> PlannerModel:
    """A PlannerModel from the fitted lines of the running plan's stages.

    tokens_per_microbatch / sum_sq_per_microbatch: the workload's means (N and Σlᵢ²); default the
    plan's packing budget and the forward lines' ``mean_sum_sq_len`` (their median), or without
    it N × ``mean_document_tokens`` (Σlᵢ² = N · E[l²]/E[l]), a guess that can be 2× off.
    Raises ValueError naming what is missing when the fits cannot describe the model.
    """
    plan = current.plan
    stages = plan.pipelines[0].stages
    n_tok0 = tokens_per_microbatch or float(current.tokens_per_microbatch or 0)
    by_key = {}
    for f in fits:
        if f.alpha_s_per_token <= 0 and f.gamma_s > 0 and n_tok0 > 0:
            # Fixed-length packing: N never varied, so the fit put α·N in γ (β, fitted on Σl², which
            # still varies, is the attention's). A layer's time is compute, not launch overhead:
            # read γ as per-token cost at the mean N. As overhead it would neither shrink with TP
            # nor slow with a throttled GPU, and a ×3 GPU would be read as ×5 in compute.
            f = f.model_copy(update={"alpha_s_per_token": f.gamma_s / n_tok0, "gamma_s": 0.0})
        by_key[(f.stage, str(f.kind))] = f
    if not any((s, "F") in by_key for s in range(len(stages))):
        raise ValueError("no forward (F) cost fit for any stage of the running plan; wait for the analytics "
                         "consumer's analytics.cost_model event or pass --model")
    n_tok = tokens_per_microbatch or float(current.tokens_per_microbatch or 0)
    if n_tok <= 0:
        raise ValueError("tokens per micro-batch unknown: plan.current carries none; pass tokens_per_microbatch")
    # a document cannot be longer than its micro-batch: with 64-token rows (the torch demo) the default
    # 1024 made Σlᵢ² 16× too large and the attention term swamped the prediction
    s2 = sum_sq_per_microbatch if sum_sq_per_microbatch is not None else _forward_median(fits, "mean_sum_sq_len")
    if s2 is None:
        s2 = n_tok * min(mean_document_tokens, n_tok)
    h = hidden_size(current.layer_state_bytes)
    tp_bytes = 2.0 * h * BYTES_PER_VALUE  # two all-reduces of h values per token per layer

    def tp_comm(tp: int, n_layers: int) -> tuple[float, float]:
        """(per-token, fixed) seconds of a stage's TP all-reduces inside a node."""
        if tp <= 1:
            return 0.0, 0.0
        return (n_layers * ring_factor(tp) * tp_bytes / hardware.intra_node_bandwidth_Bps,
                n_layers * ALLREDUCES_PER_LAYER * 2 * (tp - 1) * hardware.link_latency_s)

    last = len(stages) - 1
    lin, att, over, bfs = [], [], [], []
    for s, st in enumerate(stages):
        forward = by_key.get((s, "F"))
        if forward is None or s == last and len(stages) > 1:
            continue
        c_tok, c_fix = tp_comm(st.tp, st.num_layers)
        lin.append(st.tp * (forward.alpha_s_per_token - c_tok) / st.num_layers)
        att.append(st.tp * forward.beta_s_per_token_sq / st.num_layers)
        over.append(max(0.0, (forward.gamma_s - c_fix) / st.num_layers))
        b = by_key.get((s, "B"))
        w = by_key.get((s, "W"))
        if b is not None:
            back = b.alpha_s_per_token - c_tok + (w.alpha_s_per_token if w is not None else 0.0)
            fwd = forward.alpha_s_per_token - c_tok
            if fwd > 0:
                bfs.append(back / fwd)
    linear = median(lin)
    if linear <= 0:  # the all-reduce estimate exceeds the fit: count everything as compute
        tp_bytes = 0.0
        linear = median(stages[s].tp * by_key[(s, "F")].alpha_s_per_token / stages[s].num_layers
                        for s in range(len(stages)) if (s, "F") in by_key and (s != last or len(stages) == 1))
    head = 0.0
    f_last = by_key.get((last, "F"))
    if f_last is not None and len(stages) > 1:
        st = stages[last]
        c_tok, _ = tp_comm(st.tp, st.num_layers) if tp_bytes else (0.0, 0.0)
        head = max(0.0, st.tp * (f_last.alpha_s_per_token - c_tok) - st.num_layers * linear)
    return PlannerModel(
        num_layers=plan.num_layers, layer_state_bytes=current.layer_state_bytes, tokens_per_microbatch=n_tok,
        linear_s_per_token=max(linear, 1e-18), attn_s_per_sq_token=max(0.0, median(att)), sum_sq_per_microbatch=s2,
        overhead_s=median(over), head_s_per_token=head, tp_bytes_per_token=tp_bytes,
        activation_bytes_per_token=float(h * BYTES_PER_VALUE), grad_bytes_per_layer=None,
        backward_factor=median(bfs) if bfs else 2.0, microbatch_cv=_forward_median(by_key.values(), "workload_cv") or 0.0,
    )


def _forward_median(fits, name: str) -> float | None:
    """The median over the forward lines of an optional CostFit field (the mix's spread
    ``workload_cv``, the mean Σlᵢ² ``mean_sum_sq_len``); None when no line carries it — an older
    analytics consumer, or no sequence lengths."""
    values = [getattr(f, name) for f in fits if str(f.kind) == "F" and getattr(f, name) is not None]
    return median(values) if values else None


def calibrate_spread(model: PlannerModel, plan: Plan, cluster: ClusterState, observed_s: Sequence[float]) -> PlannerModel:
    """``model`` with the replicas' spread and the stalls' tail fitted to the healthy ``plan``'s
    observed iteration times (``analytics.prediction``'s observed_s, or the summaries').

    Why: the job waits for its slowest replica every iteration. Its typical time sits above the
    per-replica mean by how much the replicas vary (the micro-batch mix, jitter), and a fix for
    one slightly slow replica among many gains less than its mean says. Rare long stalls add on
    top, whichever replica they hit. The two behave differently when one replica is well behind
    the others: the spread then barely matters, the stalls still do. So they are fitted apart:

    * ``makespan_cv`` (relative, ``makespan_sd_s`` set to 0) so that the predicted *median*
      iteration equals the observed median — the body, which stalls barely move;
    * ``tail_s`` = observed mean − the predicted mean with that spread (≥ 0).

    The pipelines' means already include the micro-batch mix's bias (``microbatch_cv``, through
    the scorer). Given one time (a mean, say) the whole gap goes to the spread and ``tail_s`` is 0.

    What can go wrong: the times must come from enough healthy iterations — rare stalls are a
    large part of the mean, and a few dozen iterations may see none or several. A body at or
    below the prediction leaves no spread; a mean below the body's leaves no tail."""
    from dataclasses import replace as _replace

    from remediation.costs import expected_slowest_s, median_slowest_s
    from remediation.throughput import expected_iteration_s, plan_spans

    base = _replace(model, makespan_cv=0.0, makespan_sd_s=0.0, tail_s=0.0)
    scored = plan_spans(cluster, base, plan)
    if scored is None:
        return base
    spans, dp_s = scored
    if not observed_s:
        return base
    mean_s = sum(observed_s) / len(observed_s)
    body_s = median(observed_s)
    typical = median_slowest_s if len(observed_s) > 1 else expected_slowest_s
    if body_s - dp_s <= typical(spans.items(), 0.0):
        return base
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if typical(spans.items(), mid) + dp_s < body_s:
            lo = mid
        else:
            hi = mid
    fitted = _replace(base, makespan_cv=lo)
    if len(observed_s) > 1:
        fitted = _replace(fitted, tail_s=max(0.0, mean_s - expected_iteration_s(fitted, spans, dp_s)))
    return fitted
