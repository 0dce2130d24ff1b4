"""``resihp run``'s flags: torchrun's own parser, plus the platform's.

The torchrun flags (``--nnodes``, ``--nproc-per-node``, ``--rdzv-backend``, ``--rdzv-endpoint``,
``--rdzv-id``, ``--rdzv-conf``, ``--max-restarts``, ``--node-rank``, ``--standalone`` …) come from
``torch.distributed.run.get_args_parser`` and mean what they mean there, so a torchrun command
line works unchanged after ``resihp run``. The bus flags are added by the caller (resihp/commands/run.py).
"""

from __future__ import annotations

import argparse
import uuid


def agent_parser(prog: str = "resihp run") -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = ("Start this node's ranks under the ResiHP node agent (torch.distributed.elastic): "
                          "torchrun's flags, plus heartbeats on the bus, hang reports and ranks that never "
                          "outlive the agent. See docs/agent.md.")
    ours = parser.add_argument_group("resihp")
    ours.add_argument("--job", default="resihp", help="job name on the bus")
    ours.add_argument("--rdzv-bind", default=None, metavar="ADDR",
                      help="address the hosting agent's rendezvous store listens on (default: the endpoint's own "
                           "address; loopback for localhost and --standalone; 0.0.0.0 for every interface)")
    ours.add_argument("--work-dir", default=None,
                      help="flight records, stack dumps and hang reports (default: a new temporary directory)")
    ours.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between heartbeats for each rank")
    ours.add_argument("--hang-factor", type=float, default=3.0,
                      help="a step is hung past this many expected step times")
    ours.add_argument("--hang-floor-s", type=float, default=5.0, help="never judge a step hung before this")
    ours.add_argument("--expected-step-s", type=float, default=None,
                      help="the expected step time; default: the cost model's newest prediction for --job on the "
                           "bus (analytics.prediction), else the median of the ranks' recent steps")
    ours.add_argument("--on-hang", choices=["report", "restart"], default="report",
                      help="after a hang report: only report, or kill the stuck rank and restart the worker "
                           "group (needs --max-restarts)")
    ours.add_argument("--on-failure", choices=["restart", "shrink"], default="restart",
                      help="when a rank dies: restart the worker group from the last checkpoint (torch's elastic "
                           "restart), or shrink: keep the survivors running and let the job re-form its world "
                           "without the lost rank (trainer/agent/shrink.py; the script must support it)")
    ours.add_argument("--join-running", action="store_true",
                      help="take the place of an agent that died in a running job (--on-failure shrink): this "
                           "node's ranks replace the dead node's and the world takes them back at its next step; "
                           "pass the job's other flags unchanged")
    ours.add_argument("--join-on-command", action="store_true",
                      help="with --join-running: wait for a signed join order (resihp node join NODE --round ROUND) "
                           "and take the place that node left, and no other")
    ours.add_argument("--stop-grace-s", type=float, default=5.0,
                      help="on a node command to stop, this node's ranks get SIGTERM and, after this many seconds, "
                           "SIGKILL (docs/agent.md, node commands)")
    ours.add_argument("--drain-s", type=float, default=60.0,
                      help="under --on-failure shrink, a node command to stop first lets this node's ranks finish the "
                           "step they are in and leave the world after it, waiting up to this many seconds, so no work "
                           "is lost; ranks still running then are stopped as --stop-grace-s says (0: no drain)")
    ours.add_argument("--preload", default=None, metavar="MODULES",
                      help="comma-separated modules (e.g. torch,train) imported once by a fork server the ranks are "
                           "forked from, so starting and restarting ranks costs no imports; default: a fresh "
                           "interpreter per rank, as torchrun")
    ours.add_argument("--no-telemetry", action="store_true", help="publish nothing on the bus")
    return parser


def normalise(args: argparse.Namespace) -> argparse.Namespace:
    """torchrun's rewrites before ``config_from_args``: ``--standalone`` and a one-node static job
    become a c10d rendezvous on a free loopback port with a new id."""
    from torch.distributed.run import parse_min_max_nnodes

    single_static = (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                     and parse_min_max_nnodes(args.nnodes)[1] == 1)
    if args.standalone or single_static:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", uuid.uuid4().hex
    if args.master_port is None:
        args.master_port = 29500
    return args
