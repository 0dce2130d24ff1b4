"""Command-line flags several subcommands share: which bus, and where it lives."""

from __future__ import annotations

import argparse

from collector.bus import DEFAULT_EMBEDDED_PATH, DEFAULT_KAFKA_BOOTSTRAP, Bus, open_bus


def add_bus_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bus", choices=["embedded", "kafka"], default=None,
                        help="event bus backend (default: $RESIHP_BUS or embedded)")
    parser.add_argument("--bus-path", default=None,
                        help=f"embedded log file (default: $RESIHP_EMBEDDED_PATH or {DEFAULT_EMBEDDED_PATH})")
    parser.add_argument("--bootstrap", default=None,
                        help=f"Kafka bootstrap servers (default: $RESIHP_KAFKA_BOOTSTRAP or {DEFAULT_KAFKA_BOOTSTRAP})")


def bus_from_args(args: argparse.Namespace) -> Bus:
    return open_bus(args.bus, path=args.bus_path, bootstrap=args.bootstrap)


