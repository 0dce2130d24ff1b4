"""Structured logs: one JSON object per line, with the job, rank and epoch a line belongs to.

Every process the platform starts logs through the standard ``logging`` module; ``configure``
installs ``JsonFormatter`` on the root logger with the process's context (``job``, ``rank`` …),
so a line from any library logger carries it too. Fields passed per call with
``extra={"epoch": 3}`` are added to that line. Messages are formatted by ``logging`` (``%``-style
arguments) and then JSON-escaped, so a quote or newline in a message cannot break the line.
``RESIHP_LOG_FORMAT=text`` keeps ``logging``'s plain format for people reading a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

# attributes every LogRecord has; anything else on a record came from ``extra=`` and is emitted
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: time, level, logger, msg, the context, the extras."""

    def __init__(self, context: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.context = dict(context or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time_s": round(record.created, 6), "level": record.levelname,
                                "logger": record.name, **self.context, "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure(level: str | int = "WARNING", *, fmt: str = "json", stream: Any = None, **context: Any) -> None:
    """Send every logger's records to ``stream`` (stderr) as JSON lines carrying ``context``
    (or plain text with ``fmt="text"``). Replaces handlers installed before, so calling it again
    (a worker learning its rank) re-labels what follows."""
    if fmt not in ("json", "text"):
        raise ValueError(f"unknown log format {fmt!r}; use json or text (RESIHP_LOG_FORMAT)")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(context) if fmt == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
