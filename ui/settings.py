"""The console's settings, read from the environment that ``resihp ui`` passes to Streamlit.

Streamlit runs ui/app.py as a script, so flags cannot reach it directly: the command turns them
into these variables. Defaults run on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from collector.settings import (
    DEFAULT_EMBEDDED_PATH, DEFAULT_KAFKA_BOOTSTRAP, DEFAULT_TRACE_DIR, DEFAULT_USERS_PATH, environment,
)


@dataclass(frozen=True)
class Settings:
    bus: str = "embedded"  # RESIHP_BUS
    embedded_path: str = DEFAULT_EMBEDDED_PATH  # RESIHP_EMBEDDED_PATH
    bootstrap: str = DEFAULT_KAFKA_BOOTSTRAP  # RESIHP_KAFKA_BOOTSTRAP
    kafka_namespace: str = ""  # RESIHP_KAFKA_NAMESPACE
    users_path: str = DEFAULT_USERS_PATH  # RESIHP_UI_USERS
    session_s: float = 8 * 3600.0  # RESIHP_UI_SESSION_S: how long a sign-in lasts
    trace_dir: str = DEFAULT_TRACE_DIR  # RESIHP_UI_TRACE_DIR: where Replay looks for traces
    page_size: int = 25  # RESIHP_UI_PAGE_SIZE: rows per page of the incident list
    refresh_s: float = 5.0  # RESIHP_UI_REFRESH_S: auto-refresh period of the Jobs page
    telemetry: bool = True  # RESIHP_UI_TELEMETRY=0: skip per-rank telemetry (no heatmap / sequence lengths)
    alertmanager_url: str = "http://127.0.0.1:9093"  # RESIHP_UI_ALERTMANAGER_URL: alerts per incident ('' for none)

    @classmethod
    def from_env(cls) -> Settings:
        try:
            env = environment()
            return cls(
                bus=env.bus,
                embedded_path=env.embedded_path,
                bootstrap=env.kafka_bootstrap,
                kafka_namespace=env.kafka_namespace,
                users_path=env.ui_users,
                session_s=env.ui_session_s,
                trace_dir=env.ui_trace_dir,
                page_size=env.ui_page_size,
                refresh_s=env.ui_refresh_s,
                telemetry=env.ui_telemetry.lower() not in ("0", "false", "no"),
                alertmanager_url=env.ui_alertmanager_url,
            )
        except ValueError as exc:
            raise ValueError(f"bad console setting in the environment: {exc}; "
                             "RESIHP_UI_SESSION_S, RESIHP_UI_REFRESH_S and RESIHP_UI_PAGE_SIZE are numbers") from None

    def bus_key(self) -> tuple[str, str]:
        """Identifies the log this console reads (one Feed per log per process)."""
        if self.bus == "kafka":
            return ("kafka", f"{self.bootstrap}/{self.kafka_namespace}")
        return ("embedded", os.path.abspath(self.embedded_path))
