"""Benchmarks that print tables (never timed tests). One module per benchmark, run by
``resihp bench NAME``: each defines ``add_arguments(parser)`` and ``run(args) -> int``, prints a
table, and with ``--json`` prints one JSON object as its last line."""
