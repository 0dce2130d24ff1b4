"""The console's settings, read from the environment that ``resihp ui`` passes to Streamlit.

Streamlit runs ui/app.py as a script, so flags cannot reach it directly: the command turns them
into these variables. Defaults run on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from collector.bus import DEFAULT_EMBEDDED_PATH, DEFAULT_KAFKA_BOOTSTRAP

DEFAULT_USERS_PATH = ".resihp/ui-users.toml"
DEFAULT_TRACE_DIR = ".resihp/traces"


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

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        try:
            return cls(
                bus=env.get("RESIHP_BUS", "embedded"),
                embedded_path=env.get("RESIHP_EMBEDDED_PATH", DEFAULT_EMBEDDED_PATH),
                bootstrap=env.get("RESIHP_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP),
                kafka_namespace=env.get("RESIHP_KAFKA_NAMESPACE", ""),
                users_path=env.get("RESIHP_UI_USERS", DEFAULT_USERS_PATH),
                session_s=float(env.get("RESIHP_UI_SESSION_S", 8 * 3600.0)),
                trace_dir=env.get("RESIHP_UI_TRACE_DIR", DEFAULT_TRACE_DIR),
                page_size=int(env.get("RESIHP_UI_PAGE_SIZE", 25)),
                refresh_s=float(env.get("RESIHP_UI_REFRESH_S", 5.0)),
                telemetry=env.get("RESIHP_UI_TELEMETRY", "1").lower() not in ("0", "false", "no"),
            )
        except ValueError as exc:
            raise ValueError(f"bad console setting in the environment: {exc}; "
                             "RESIHP_UI_SESSION_S, RESIHP_UI_REFRESH_S and RESIHP_UI_PAGE_SIZE are numbers") from None

    def bus_key(self) -> tuple[str, str]:
        """Identifies the log this console reads (one Feed per log per process)."""
        if self.bus == "kafka":
            return ("kafka", f"{self.bootstrap}/{self.kafka_namespace}")
        return ("embedded", os.path.abspath(self.embedded_path))
