"""``resihp plans``: list remediation plans (a fold of the log) and approve or reject them.

Approving publishes a ``plan.decision`` event with your identity (``--as``, default ``cli:$USER``);
the remediation engine then commands the trainer. A decision on a plan that is no longer waiting
is refused here, and would be ignored by every fold anyway (a decision applies once).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import TYPE_CHECKING

from resihp.options import add_bus_flags, bus_from_args

if TYPE_CHECKING:
    from collector.events import Envelope, Payload


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plans", help="list, approve or reject remediation plans", description=__doc__)
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    ls = acts.add_parser("list", help="plans and their lifecycle state, folded from the log")
    add_bus_flags(ls)
    ls.add_argument("--job", default="resihp", help="job name (default: resihp)")
    ls.add_argument("--json", action="store_true", help="one JSON object per plan")
    ls.add_argument("--verbose", "-v", action="store_true", help="show each plan's diff and the reports")
    ls.set_defaults(func=_list)

    for name, approve in (("approve", True), ("reject", False)):
        q = acts.add_parser(name, help=f"{name} a proposed plan")
        add_bus_flags(q)
        q.add_argument("plan_id", metavar="PLAN_ID")
        q.add_argument("--job", default="resihp", help="job name (default: resihp)")
        q.add_argument("--comment", default="", help="why (kept in the log)")
        q.add_argument("--as", dest="actor", default=None, help="your identity (default: cli:$USER; a bare NAME is cli:NAME)")
        q.set_defaults(func=_decide, approve=approve)

    pol = acts.add_parser("policy", help="set the approval policy: propose (wait for a person) or auto")
    add_bus_flags(pol)
    pol.add_argument("mode", choices=["propose", "auto"])
    pol.add_argument("--severities", default="high,critical",
                     help="comma-separated severities auto-applied in auto mode (default: high,critical)")
    pol.add_argument("--job", default="resihp", help="job name (default: resihp)")
    pol.add_argument("--as", dest="actor", default=None, help="your identity (default: cli:$USER; a bare NAME is cli:NAME)")
    pol.set_defaults(func=_policy)


def _actor(args: argparse.Namespace) -> str:
    """Who decides: ``--as`` or the login name, always as ``cli:NAME`` or ``ui:NAME`` (a console
    signature names a person; collector/auth.py)."""
    actor = args.actor or getpass.getuser()
    return actor if actor.startswith(("cli:", "ui:")) else f"cli:{actor}"


def _signed(args: argparse.Namespace, payload: Payload) -> Envelope:
    """``payload`` as an operator writes it: by the actor, signed with that person's own key
    (``person.NAME`` for cli:NAME, made by ``resihp keys add-person NAME``; docs/security.md).
    Without ``--as`` the login user's key is made on first use where they can write the key
    directory (they could add any person there anyway); ``--as`` someone else needs their key."""
    from collector.auth import KeyFileError, Signer, operator_key
    from collector.events import EventFactory

    actor = _actor(args)
    try:
        return Signer(EventFactory(args.job, actor), operator_key(actor, create=args.actor is None)).make(payload)
    except (KeyFileError, OSError) as exc:
        raise SystemExit(f"resihp {args.command}: cannot sign as {actor}: {exc}") from None


def _fold(args: argparse.Namespace):
    from remediation.log_view import fold_log

    with bus_from_args(args) as bus:
        return fold_log(bus, args.job)


def _list(args: argparse.Namespace) -> int:
    state = _fold(args)
    if args.json:
        for r in state.plans.values():
            print(json.dumps({
                "plan_id": r.plan_id, "status": r.status.value, "strategy": r.proposal.strategy,
                "base_epoch": r.proposal.base_epoch, "epoch": r.epoch, "severity": r.proposal.severity.value,
                "current_tokens_per_s": r.proposal.current_tokens_per_s,
                "predicted_tokens_per_s": r.proposal.predicted_tokens_per_s,
                "measured_tokens_per_s": r.measured_tokens_per_s, "reshape_cost_s": r.proposal.reshape_cost_s,
                "decided_by": r.decided_by, "diff": r.proposal.diff, "verdict": r.verdict,
            }))
        return 0
    print(f"job {args.job}: running epoch {state.running_epoch}, policy {state.policy_mode.value}"
          + (f" (auto: {', '.join(s.value for s in state.auto_severities)})" if state.auto_severities else ""))
    if not state.plans:
        print("no plans")
    else:
        print(f"{'PLAN':<22} {'STATUS':<12} {'EPOCH':>9} {'GAIN':>7} {'COST_S':>7} {'SEVERITY':<9} DECIDED BY")
        for r in state.plans.values():
            p = r.proposal
            gain = (f"{p.predicted_tokens_per_s / p.current_tokens_per_s - 1:+.0%}" if p.current_tokens_per_s
                    else "resume")
            print(f"{r.plan_id:<22} {r.status.value:<12} {p.base_epoch:>4}→{r.epoch:<4} {gain:>7} "
                  f"{p.reshape_cost_s:>7.1f} {p.severity.value:<9} {r.decided_by or '-'}")
            if args.verbose:
                for line in p.diff:
                    print(f"    {line}")
                if r.verdict:
                    print(f"    verdict: {r.verdict}")
    withheld = [w for w in state.withheld if w.base_epoch == state.running_epoch][-5:]
    if withheld:
        print(f"not planned at epoch {state.running_epoch} (latest {len(withheld)}):")
        for w in withheld:
            print(f"  {'waits' if w.waiting else 'withheld'}: {w.reason}")
    if args.verbose and state.reports:
        print("reports (not applied):")
        for rep in state.reports:
            print(f"  {rep.kind}: {rep.message}")
    return 0


def _decide(args: argparse.Namespace) -> int:
    from remediation.lifecycle import PlanStatus
    from remediation.log_view import fold_log

    with bus_from_args(args) as bus:
        state = fold_log(bus, args.job)
        record = state.plans.get(args.plan_id)
        if record is None:
            known = ", ".join(list(state.plans)[-5:]) or "none"
            print(f"no plan {args.plan_id!r} in job {args.job}; recent plans: {known} (see `resihp plans list`)",
                  file=sys.stderr)
            return 1
        if record.status != PlanStatus.PROPOSED:
            by = f" by {record.decided_by}" if record.decided_by else ""
            print(f"plan {args.plan_id} is already {record.status.value}{by}; a decision applies once", file=sys.stderr)
            return 1
        # bound to the proposal it answers (its event id and plan digest): it cannot approve another
        event = _signed(args, record.decision(approve=args.approve, actor=_actor(args), comment=args.comment))
        bus.publish([event])
    print(f"{'approved' if args.approve else 'rejected'} {args.plan_id} as {_actor(args)}")
    return 0


def _policy(args: argparse.Namespace) -> int:
    from collector.events import PolicyChanged, PolicyMode, Severity

    try:
        severities = [Severity(s.strip()) for s in args.severities.split(",") if s.strip()]
    except ValueError as exc:
        print(f"{exc}; choose from {', '.join(s.value for s in Severity)}", file=sys.stderr)
        return 2
    with bus_from_args(args) as bus:
        bus.publish([_signed(args,
            PolicyChanged(mode=PolicyMode(args.mode), auto_severities=severities, actor=_actor(args)))])
    print(f"policy for job {args.job}: {args.mode}" + (f" ({args.severities})" if args.mode == "auto" else ""))
    return 0
