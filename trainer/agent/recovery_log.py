"""How long each recovery took, as one JSON line per phase on the agent's stderr.

Two recoveries, two records: a restart (torch stops every rank and starts them again) is timed by
the agent itself from the failure's detection (:class:`RecoveryTimeline`); an in-job recovery
(``--on-failure shrink``) is timed by the new world's rank 0, which leaves its phases in the
flight directory for its agent to log and publish as ``telemetry.recovery``
(:func:`publish_shrink_recoveries`). ``resihp bench agent`` reads both.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from collector.events import RecoveryPhase
from trainer.agent.shrink import PHASES
from trainer.telemetry import TelemetryPublisher


@dataclass
class RecoveryTimeline:
    """Seconds from the failure's detection to each phase of one restart (this host's clock)."""

    detected_at: float
    restart: int
    phases: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.monotonic() - self.detected_at
        print(json.dumps({"event": "recovery", "restart": self.restart, "phase": phase,
                          "since_detected_s": round(self.phases[phase], 4)}), file=sys.stderr, flush=True)


def publish_shrink_recoveries(flight_dir: Path, telemetry: TelemetryPublisher | None) -> list[dict]:
    """The recoveries this node's new-world rank 0 reported since the last call (their files are
    consumed): one JSON line and, with ``telemetry``, one ``telemetry.recovery`` event per phase."""
    recoveries = []
    for path in sorted(flight_dir.glob("recovery-g*.json")):
        rec = json.loads(path.read_text())
        path.unlink()
        recoveries.append(rec)
        since = 0.0
        for phase in PHASES:
            duration = rec["durations_s"].get(phase)
            if duration is None:
                continue
            since += duration if phase != "detected" else 0.0
            print(json.dumps({"event": "recovery", "mode": "shrink", "generation": rec["generation"],
                              "phase": phase, "duration_s": round(duration, 4),
                              "since_detected_s": round(since, 4), "world": rec["world"], "lost": rec["lost"]}),
                  file=sys.stderr, flush=True)
            if telemetry is not None:
                telemetry.publish(RecoveryPhase(
                    generation=rec["generation"], phase=phase, duration_s=duration, since_detected_s=since,
                    iteration=rec["step"], world=rec["world"], lost=rec["lost"], failed_op=rec["failed_op"]))
    return recoveries
