"""``resihp bench NAME``: run one of the benchmarks under bench/ (each prints a table).

bench/ sits above the ``resihp`` composition root, so ``resihp`` never imports it: this module is
registered as a ``resihp.commands`` entry point in pyproject.toml and resihp/cli.py loads every
such entry point after its own subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import bench


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a table; --json adds one JSON line)",
                       description=(__doc__ or "").split("\n\n")[0])
    sub_bench = p.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{info.name}")
        doc = (module.__doc__ or "").strip().splitlines()
        q = sub_bench.add_parser(info.name, help=doc[0] if doc else info.name, description=module.__doc__)
        q.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        module.add_arguments(q)
        q.set_defaults(func=module.run)
