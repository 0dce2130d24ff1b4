"""``resihp``: one entry point; each subcommand lives in its own module under resihp/commands/.

A command module defines ``register(subparsers)``, which adds its parser and sets ``func`` to a
callable taking the parsed arguments and returning an exit code. Modules are discovered, so adding
a subcommand never touches this file. Heavy imports (torch, streamlit) stay inside ``func``.

Packages above the composition root (bench/) add their subcommands through the ``resihp.commands``
entry-point group (pyproject.toml), so resihp imports nothing that sits on top of it.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from importlib.metadata import entry_points

import resihp.commands

COMMAND_ENTRY_POINTS = "resihp.commands"  # each names a register(subparsers) function


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resihp",
        description="ResiHP: detect failing and slow GPUs in hybrid-parallel training and reshape the job around them.",
        epilog="Every command runs with the garbage collector set for streaming (collector/gc_policy.py); "
        "RESIHP_GC=python keeps CPython's defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(resihp.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"resihp.commands.{info.name}")
        module.register(sub)
    for entry_point in sorted(entry_points(group=COMMAND_ENTRY_POINTS), key=lambda e: e.name):
        entry_point.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from collector.gc_policy import tune_for_streaming

    try:
        tune_for_streaming()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `resihp detect TRACE | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
