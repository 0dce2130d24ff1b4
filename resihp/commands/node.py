"""``resihp node stop|join NODE --round ROUND --run RUN``: order one node agent of a ``resihp run`` job.

Publishes a ``command.node`` with your identity (``--as``, default ``cli:$USER``), signed with your
own key (``person.NAME``), to the commands topic the agents obey (docs/agent.md, "Node commands"). NODE is the
agent's node number and ROUND the rendezvous round, both as the agent prints them (``node 1 of 2
with ranks [2, 3] in rendezvous round 0``); RUN is the job's rendezvous id (``--rdzv-id``, which the
hosting agent prints as ``rendezvous RUN at …``): an agent of another run refuses the order. The
order expires ``--ttl`` seconds from now (default 600): an agent refuses it after that, so a copy
republished later does nothing. The agent answers on the control topic with a
``command.node_ack`` (applied, or why not); an unsigned or forged order is refused there and
reported as ``control.rejected``.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from resihp.commands.plans import _actor, _signed
from resihp.options import add_bus_flags, bus_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="order a node agent of a `resihp run` job: stop it, or let a spare join",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, text in (("stop", "stop the node's ranks (SIGTERM, then SIGKILL) and its agent; under "
                                   "--on-failure shrink the other nodes go on without it"),
                         ("join", "let a spare agent waiting with --join-running --join-on-command take the "
                                  "place that NODE left")):
        q = acts.add_parser(action, help=text)
        add_bus_flags(q)
        q.add_argument("node", type=int, metavar="NODE", help="the node number the agent prints (its group rank)")
        q.add_argument("--round", type=int, default=None, metavar="ROUND",
                       help="the rendezvous round the agent printed (required); an order for another round is "
                            "ignored as stale")
        q.add_argument("--epoch", dest="legacy_epoch", type=int, default=None, help=argparse.SUPPRESS)
        q.add_argument("--run", required=True, metavar="RUN",
                       help="the job's rendezvous id (--rdzv-id of its agents); an agent of another run refuses it")
        q.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                       help="the order expires this long from now (default 600, at most 3600: "
                            "collector/epoch_fence.py's COMMAND_TTL_S and COMMAND_TTL_MAX_S)")
        q.add_argument("--job", default="resihp", help="job name (default: resihp)")
        q.add_argument("--reason", default="", help="why (kept in the log)")
        q.add_argument("--command-id", default=None, help="the command's id (default: a new one)")
        q.add_argument("--as", dest="actor", default=None, help="your identity (default: cli:$USER; a bare NAME is cli:NAME)")
        if action == "join":
            q.add_argument("--spare", default=None, metavar="ID",
                           help="only the spare with this id takes the place (the id its node.spare events and its "
                                "log give); default: any spare waiting for an order")
        q.set_defaults(func=_order)


def _round(args: argparse.Namespace) -> int:
    """The rendezvous round the order names: ``--round``, or the deprecated ``--epoch`` (the plan's
    word elsewhere), still read with a warning."""
    if args.round is not None:
        return args.round
    if args.legacy_epoch is not None:
        print("resihp node: --epoch is deprecated (it names the rendezvous round); use --round", file=sys.stderr)
        return args.legacy_epoch
    raise SystemExit("resihp node: error: the following arguments are required: --round ROUND (the rendezvous "
                     "round the agent printed)")


def _order(args: argparse.Namespace) -> int:
    from collector.epoch_fence import COMMAND_TTL_MAX_S, COMMAND_TTL_S, run_of
    from collector.events import NodeCommand

    ttl_s = COMMAND_TTL_S if args.ttl is None else args.ttl
    round_ = _round(args)
    if args.node < 0 or round_ < 0:
        raise SystemExit("resihp node: error: NODE and --round are numbers from 0, as the agent prints them")
    if not 0 < ttl_s <= COMMAND_TTL_MAX_S:
        raise SystemExit(f"resihp node: error: --ttl is seconds in (0, {COMMAND_TTL_MAX_S:g}]; agents refuse longer")
    command_id = args.command_id or f"node-{args.action}-{uuid.uuid4().hex[:12]}"
    event = _signed(args, NodeCommand(command_id=command_id, node=args.node, action=args.action, round=round_,
                                      reason=args.reason, actor=_actor(args), run=run_of(args.run),
                                      expires_at_s=time.time() + ttl_s, spare=getattr(args, "spare", None)))
    with bus_from_args(args) as bus:
        bus.publish([event])
    print(f"{args.action} node {args.node} (round {round_}) ordered as {command_id} by {event.source}; "
          "the agent answers with command.node_ack")
    return 0
