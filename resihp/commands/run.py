"""``resihp run``: a drop-in for ``torchrun``, one node agent per node (trainer/agent/, docs/agent.md).

Every torchrun flag is parsed by torch's own parser, built only when the command runs (importing
torch at every ``resihp`` start would cost seconds), so this subcommand hands its whole command
line to that parser: ``resihp run --help`` prints torchrun's flags with ours.
"""

from __future__ import annotations

import argparse
import os

from resihp.options import add_bus_flags


class _TorchrunArgs(argparse.ArgumentParser):
    """Keeps the subcommand's arguments as they are, for torch's parser in :func:`run`."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.argv = list(args or [])
        namespace.func = run
        return namespace, []


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="torchrun-compatible node agent: start this node's ranks (see docs/agent.md)",
                       description=__doc__, add_help=False)
    p.__class__ = _TorchrunArgs  # argparse builds subparsers itself; this one defers to torch's parser


def run(args: argparse.Namespace) -> int:
    # c10d's C++ logging prints a stack of frames for every failed connect; our errors are one line.
    # Set for the agent only (before torch loads) and taken back so the ranks log as usual.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ.update(TORCH_CPP_LOG_LEVEL="FATAL")
    from trainer.agent.options import agent_parser

    parser = agent_parser()
    add_bus_flags(parser)
    parsed = parser.parse_args(args.argv)
    if quiet:
        os.environ.pop("TORCH_CPP_LOG_LEVEL")

    from trainer.agent.launch import run_agent
    from trainer.spec import BusSpec

    return run_agent(parsed, BusSpec(backend=parsed.bus, path=parsed.bus_path, bootstrap=parsed.bootstrap))
