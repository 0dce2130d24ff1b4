"""Run the detector over a recorded trace, offline: the same code path as the live consumer.

Any trace in the platform's format (simulated, recorded by the trainer, or converted from another
tool) can be scored this way. Ground-truth events (``truth.*``) are never shown to the detector.
Probes cannot be answered offline, so a suspect that telemetry can only narrow to a TP group stays
a TP group (``rank`` unset, ``tp_group`` set) in the output.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

from analytics.detection.detector import Detector
from analytics.detection.config import DetectorConfig
from collector.auth import Signer, load_keyring
from collector.events import Envelope, EventFactory

_NS = uuid.UUID("a3b7e5d1-2c4f-4e8a-9b6d-7f1e3c5a9d20")  # the live consumer's: same ids offline and live


def detect_events(events: Iterable[Envelope], config: DetectorConfig | None = None, *,
                  kinds_prefix: tuple[str, ...] = ("incident.",)) -> Iterator[Envelope]:
    """Detector output for ``events`` (every job in them), wrapped as analytics events, filtered to
    kinds starting with ``kinds_prefix`` (all kinds: pass ``("",)``)."""
    config = config or DetectorConfig()
    detectors: dict[str, Detector] = {}
    counters: dict[str, int] = {}
    last_time: dict[str, float] = {}
    keyring = load_keyring()  # what it yields may be published: signed as analytics, as the live consumer's

    def wrap(job: str, payloads: list, time_s: float) -> Iterator[Envelope]:
        for p in payloads:
            n = counters.get(job, 0)
            counters[job] = n + 1
            if p.KIND.startswith(kinds_prefix):
                yield Signer(EventFactory(job, "analytics", first_seq=n), "analytics", keyring).make(
                    p, time_s=time_s, event_id=uuid.uuid5(_NS, f"{job}/{n}").hex)

    for e in events:
        if e.kind.startswith("truth.") or e.source == "analytics":
            continue
        det = detectors.get(e.job)
        if det is None:
            det = detectors[e.job] = Detector(e.job, config)
        last_time[e.job] = e.time_s
        yield from wrap(e.job, det.on_event(e), e.time_s)
    for job, det in detectors.items():
        yield from wrap(job, det.flush(), last_time[job])
