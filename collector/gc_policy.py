"""The garbage collector's settings for a process that streams events.

A consumer decodes hundreds of thousands of small objects a minute (envelopes, chunk tables)
while it holds a large, long-lived heap: the detector's windows, DuckDB handles, the schemas.
CPython's default collects the youngest generation every 700 net allocations and promotes often,
so full collections run every few seconds and each walks that whole heap. In the closed loop at
1,024 ranks that was a third of the run's wall time, while the collections freed almost nothing
(docs/benchmarks.md). ``tune_for_streaming`` raises the thresholds so the young generation is
collected every 50,000 allocations and the oldest rarely. Reference cycles are still collected,
just in larger batches: memory stays bounded. (``gc.freeze`` on top gained nothing measurable.)

``RESIHP_GC=python`` keeps CPython's defaults (to compare, or to rule the setting out when a
process's memory grows).
"""

from __future__ import annotations

import gc

from collector.settings import environment

GC_ENV = "RESIHP_GC"
STREAMING_THRESHOLDS = (50_000, 20, 100)


def tune_for_streaming() -> tuple[int, int, int]:
    """Apply the streaming settings unless ``RESIHP_GC=python``; returns the thresholds in force.

    Idempotent. Raises ValueError for an unknown ``RESIHP_GC`` value."""
    mode = environment().gc.strip().lower() or "streaming"
    if mode == "python":
        return gc.get_threshold()
    if mode != "streaming":
        raise ValueError(f"{GC_ENV}={mode!r}: choose 'streaming' (the default) or 'python' (CPython's defaults)")
    gc.set_threshold(*STREAMING_THRESHOLDS)
    return STREAMING_THRESHOLDS
