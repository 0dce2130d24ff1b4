"""Whether an applied plan did what it promised: the verification rule of the lifecycle.

Judged on the *measured change* against the *predicted change*, both relative to the layout that
ran before, so a cost model that is mis-scaled — a uniform guess before the analytics consumer's
fits arrive, hardware faster or slower than assumed — neither fails a good plan nor passes a bad
one. Pure: a function of the fold (remediation.lifecycle) and, for a plan that resumed a hung job,
one number the engine computes from its model. See :func:`verdict` for the rule.

A layout's rate is the *median* of its iterations' rates, not their sum over their time. An
iteration is synchronous: one GC pause or OS hiccup on any of the job's ranks stalls all of it, so
stalls grow with the job (the simulator's 0.1 % per stage and iteration is one iteration in eight
at 1,024 GPUs) and one 1-s stall in five 0.3-s iterations reads as a 40 % loss. The median
ignores stalls in fewer than half the samples, which are the layout's noise, not its speed; a
layout that slows every iteration still shows in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remediation.lifecycle import LifecycleState, PlanRecord


@dataclass(frozen=True)
class Verification:
    """How an applied plan is judged (see :func:`verdict`)."""

    iterations: int = 5  # samples needed after the warm-up
    warmup_iterations: int = 1  # iterations right after a reshape that are not counted
    tolerance: float = 0.15  # the measured gain may fall this far short of the predicted one and still verify
    max_loss: float = 0.02  # ... but a plan that promised a gain may not measure a loss larger than this
    kept_gain: float = 0.15  # a plan short of its prediction that measured this much faster than the layout it
    # replaced is kept: rolling back would restore a layout measured slower


def _rate(samples: dict[int, tuple[int, float]], iterations: list[int]) -> float:
    """The median of the iterations' tokens/s (see the module's docstring); an iteration that
    reports no time is no measurement and is left out."""
    rates = [samples[i][0] / samples[i][1] for i in iterations if samples[i][1] > 0]
    return median(rates) if rates else 0.0


def _against_predicted_change(record: PlanRecord, verification: Verification, after: float, before: float,
                              unfaulted: float) -> tuple[bool, str]:
    """Rule 1 of :func:`verdict`: the measured change ``after / before`` against the predicted one;
    ``unfaulted`` is what the base epoch measured before the fault (0: nothing)."""
    prop, tol = record.proposal, verification.tolerance
    expected = prop.predicted_tokens_per_s / prop.current_tokens_per_s
    achieved = after / before if before > 0 else float("inf")
    floor = (1 - tol) * expected
    no_loss = 1 - verification.max_loss if expected > 1 else 0.0
    restored = unfaulted > 0 and after >= (1 - tol) * unfaulted
    faster = achieved >= 1 + verification.kept_gain
    ok = achieved >= no_loss and (achieved >= floor or restored or faster)
    why = (f"measured ×{achieved:.3f} ({before:,.0f} → {after:,.0f} tokens/s) against the predicted "
           f"×{expected:.3f} (needs ×{max(floor, no_loss):.3f})")
    if restored and achieved < floor:
        why += (f", but back to {after / unfaulted:.0%} of the {unfaulted:,.0f} tokens/s before the fault "
                f"(tolerance {tol:.0%})")
    elif faster and achieved < floor:
        why += (f", but faster than the layout it replaced by more than {verification.kept_gain:.0%}: "
                "a roll-back would only be slower")
    return ok, why


def verdict(state: LifecycleState, record: PlanRecord,
            verification: Verification = Verification()) -> tuple[bool, float, str] | None:
    """(verified?, measured tokens/s, why) for an applied plan, or None while samples are missing.

    The rule judges the *measured change* against the *predicted change*, both relative, so a cost
    model that is mis-scaled (a uniform guess before analytics fits arrive, a GPU faster than
    assumed) cannot fail a good plan or pass a bad one:

    1. The old layout was running under the faults the plan answers (its predicted tokens/s > 0
       and the base epoch has samples since the newest of the plan's incidents opened): verified
       when after / before ≥ (1 − tolerance) · predicted / current, "before" being the median of the
       base epoch's last ``iterations`` samples since the latest update of those incidents (since
       the opening when none came after it: an incident that got worse, a second GPU of its TP
       group slow, has run slower since its update, and samples from before it would credit the
       old layout with a speed it no longer had), and, when the plan promised a gain,
       after / before ≥ 1 − ``max_loss``: the tolerance is for a model that over-promised, not
       for a plan that made the job slower than the faulty layout it replaced. A plan short of
       the predicted change that brought the job back to ≥ (1 − tolerance) of what the base
       epoch measured before the fault is verified all the same: the layout it replaced is the
       faulty one, and rolling back to it would only be slower. ("before" may be one or two
       iterations when the plan was applied right after the detection, so the predicted-change
       rule alone can fail a plan that restored the job on one noisy sample.) For the same reason
       a plan short of the predicted change that measured ≥ 1 + ``kept_gain`` times the faulty
       layout's rate is verified: the model over-promised, but a roll-back would go back to a
       layout measured slower (the torch demo's ×3 GPU measures ×1.68 against ×2.00 predicted: a
       roll-back would take the job from 588 tokens/s back to the faulty layout's 350).
    2. The old layout was hung on a dead device (predicted 0): the reference is what the base
       epoch measured before the fail-stop; with the proposal's ``fraction_of_before`` (the
       engine's prediction of the new plan over the old layout before the fault) verified when
       after / before ≥ (1 − tolerance) · fraction_of_before; without it (a proposal of schema 1),
       verified once the job trains again (a hung layout cannot be rolled back to anyway).
    3. Nothing was measured on the base epoch: the absolute rule, measured ≥ (1 − tolerance) ·
       predicted tokens/s (trusts the model's scale; only when nothing better exists).
    """
    usable = sorted(record.samples)[verification.warmup_iterations:]
    if len(usable) < verification.iterations:
        return None
    after = _rate(record.samples, usable)
    prop = record.proposal
    tol = verification.tolerance
    base = state.epoch_samples.get(prop.base_epoch, {})
    answered = [state.incidents[i] for i in prop.incident_ids if i in state.incidents]
    since = max((i.opened_iteration for i in answered), default=None)
    changed = max((i.changed_iteration for i in answered), default=None)
    ordered = sorted(base)
    faulted = ([i for i in ordered if changed is not None and i >= changed]
               or [i for i in ordered if since is None or i >= since])[-verification.iterations:]
    healthy = [i for i in ordered if since is not None and i < since][-verification.iterations:]
    if prop.current_tokens_per_s > 0 and faulted:
        ok, why = _against_predicted_change(record, verification, after, _rate(base, faulted),
                                            _rate(base, healthy) if healthy else 0.0)
    elif prop.current_tokens_per_s <= 0 and healthy and prop.fraction_of_before is not None:
        before = _rate(base, healthy)
        achieved = after / before if before > 0 else float("inf")
        ok = achieved >= (1 - tol) * prop.fraction_of_before
        why = (f"measured {achieved:.3f} of the {before:,.0f} tokens/s before the fail-stop against the predicted "
               f"{prop.fraction_of_before:.3f} (tolerance {tol:.0%})")
    elif prop.current_tokens_per_s <= 0:
        ok = after > 0
        why = f"training resumed at {after:,.0f} tokens/s (no measured reference to check the predicted change on)"
    else:
        predicted = prop.predicted_tokens_per_s
        ok = after >= (1 - tol) * predicted
        why = (f"measured {after:,.0f} tokens/s against the predicted {predicted:,.0f} (tolerance {tol:.0%}; nothing "
               "measured on the old layout to compare with)")
    return ok, after, why
