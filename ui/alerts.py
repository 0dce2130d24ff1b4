"""The alerts Alertmanager holds for each incident, read from its API (``GET /api/v2/alerts``).

The alert rules (infra/prometheus/rules.yml) fire one alert per open incident and label it with the
incident's id, so the console can show, on an incident's page, whether anyone is being paged for it
and which runbook applies, and list the firing alerts with a way into each incident. Alertmanager
is the source of truth for what fired (silences and inhibitions included), so the console asks it
rather than evaluating the rules itself.

What can go wrong: no Alertmanager at the URL (``resihp ops up`` starts one) or one that answers
something else: :class:`AlertmanagerUnreachable`, with a one-line reason the page shows instead.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class AlertmanagerUnreachable(RuntimeError):
    """No usable answer from Alertmanager's API."""


@dataclass(frozen=True)
class FiringAlert:
    name: str
    incident_id: str
    job: str
    severity: str
    summary: str
    runbook_url: str
    incident_url: str
    starts_at: str
    state: str  # active, suppressed (silenced or inhibited), unprocessed


def firing_alerts(alertmanager_url: str, timeout_s: float = 2.0) -> list[FiringAlert]:
    """Every alert Alertmanager holds now that names an incident (alerts without an incident_id —
    lag, dead letters, goodput — belong to no incident page and are left out)."""
    url = f"{alertmanager_url.rstrip('/')}/api/v2/alerts?active=true&silenced=true&inhibited=true"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except (OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise AlertmanagerUnreachable(f"no alerts from Alertmanager at {alertmanager_url} ({reason}); "
                                      "`resihp ops up` starts one, RESIHP_UI_ALERTMANAGER_URL points elsewhere") from None
    if not isinstance(body, list):
        raise AlertmanagerUnreachable(f"{url} did not answer a list of alerts: is it Alertmanager's API v2?")
    out = []
    for a in body:
        labels, notes = a.get("labels", {}), a.get("annotations", {})
        if not labels.get("incident_id"):
            continue
        out.append(FiringAlert(
            name=labels.get("alertname", "?"), incident_id=labels["incident_id"], job=labels.get("job", ""),
            severity=labels.get("severity", ""), summary=notes.get("summary", ""),
            runbook_url=notes.get("runbook_url", ""), incident_url=notes.get("incident_url", ""),
            starts_at=a.get("startsAt", ""), state=a.get("status", {}).get("state", "")))
    return sorted(out, key=lambda f: (f.starts_at, f.name, f.incident_id))


def by_incident(alerts: list[FiringAlert]) -> dict[str, list[FiringAlert]]:
    out: dict[str, list[FiringAlert]] = {}
    for a in alerts:
        out.setdefault(a.incident_id, []).append(a)
    return out
