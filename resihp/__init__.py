"""The ``resihp`` command line: the composition root that wires the packages together.

It is the only place allowed to import ``trainer`` and ``ui`` (lazily, per subcommand).
"""
