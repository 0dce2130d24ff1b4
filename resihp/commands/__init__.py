"""Subcommands of ``resihp``, one module each (see resihp/cli.py)."""
