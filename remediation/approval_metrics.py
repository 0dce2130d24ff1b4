"""The engine's ``/metrics``: plans waiting for an operator's decision, and how long the oldest has
waited (the alert "plan waiting for approval longer than N minutes" reads it).

The age is on the wall clock for a live job; a job on a simulated clock (its events stamped far
from now, like a replayed trace or the simulator) is measured on the engine's own clock, the newest
event time it has read, so a replay of last week's log does not page anyone for a week-old wait.
"""

from __future__ import annotations

import sys
import time

from analytics.service.metrics import ApprovalCollector, MetricsServer
from collector.plan_lifecycle import PlanStatus
from remediation.engine import RemediationEngine

LIVE_CLOCK_TOLERANCE_S = 3600.0  # events stamped within this of the wall clock: the job runs live


def waiting_ages(engine: RemediationEngine, wall_s: float) -> list[float]:
    """Seconds each proposed, undecided plan has waited. Read from the server's thread while the
    engine folds on its own: a copy that fails because the fold grew meanwhile is taken again."""
    for _ in range(10):
        try:
            proposed = [r.proposed_at_s for r in list(engine.state.plans.values()) if r.status == PlanStatus.PROPOSED]
            break
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    else:
        proposed = []
    clock = engine.clock_s
    now = wall_s if abs(wall_s - clock) <= LIVE_CLOCK_TOLERANCE_S or clock == float("-inf") else clock
    return [max(now - t, 0.0) for t in proposed]


def serve_approval_metrics(engine: RemediationEngine, port: int, host: str = "127.0.0.1") -> MetricsServer:
    collector = ApprovalCollector(lambda: (engine.config.job, waiting_ages(engine, time.time())))
    server = MetricsServer(collector, host, port).start()
    print(f'{{"event": "metrics", "url": "{server.url}"}}', file=sys.stderr, flush=True)
    return server
