"""Every ``RESIHP_*`` environment variable the platform reads, in one place (docs/settings.md).

Defaults run on one machine. ``environment()`` reads the environment afresh on each call, so a
process (or a test) that changes a variable sees it at the next read; each reader still judges the
values it owns (``RESIHP_EMBEDDED_SYNC`` is checked by the embedded bus, ``RESIHP_GC`` by
collector/gc_policy.py) and names the fix. A variable that is not a number where a number is wanted
raises pydantic's ``ValidationError`` (a ``ValueError``) naming it.

infra/ (the Kafka broker tool) imports none of our packages and reads its own few variables
(``RESIHP_KAFKA_LIB_DIR``, ``RESIHP_KAFKA_DATA_DIR``, ``RESIHP_KAFKA_PORT``,
``RESIHP_KAFKA_CONTROLLER_PORT``, ``KAFKA_HEAP_OPTS``); they are listed in docs/settings.md too.
"""

from __future__ import annotations

import os

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_EMBEDDED_PATH = ".resihp/bus.sqlite"
DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:19092"
DEFAULT_USERS_PATH = ".resihp/ui-users.toml"
DEFAULT_TRACE_DIR = ".resihp/traces"
DEFAULT_KEYS_PATH = ".resihp/keys"


class Environment(BaseSettings):
    """The platform's environment variables: field ``x`` is ``RESIHP_X``."""

    model_config = SettingsConfigDict(env_prefix="RESIHP_", extra="ignore")

    # the bus (collector/bus.py, kafka_bus.py, embedded.py)
    bus: str = Field(default="embedded", description="the bus backend: embedded or kafka")
    embedded_path: str = Field(default=DEFAULT_EMBEDDED_PATH, description="the embedded log's SQLite file")
    embedded_sync: str = Field(default="normal", description="normal survives a process crash; full also power loss")
    embedded_telemetry_retention_s: str = Field(
        default="", description="seconds of telemetry the embedded log keeps (empty: all); the newest record always stays")
    kafka_bootstrap: str = Field(default=DEFAULT_KAFKA_BOOTSTRAP, description="Kafka bootstrap servers, host:port[,…]")
    kafka_namespace: str = Field(default="", description="prefix of every Kafka topic, so environments share a cluster")
    kafka_replication: int = Field(default=1, description="replication factor of the topics the platform creates")
    kafka_outage_limit_s: float = Field(
        default=0.0, ge=0, description="how long a publish waits out a broker outage before it fails (0: for ever)")
    kafka_security_protocol: str = Field(
        default="", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (empty: SASL_PLAINTEXT when a username is set)")
    kafka_sasl_mechanism: str = Field(default="SCRAM-SHA-256", description="SCRAM-SHA-256, SCRAM-SHA-512 or PLAIN")
    kafka_username: str = Field(default="", description="the SASL principal this process signs in as (docs/kafka.md)")
    kafka_password: str = Field(default="", description="that principal's password")
    kafka_ssl_cafile: str = Field(
        default="", description="PEM file of the CA that signed the brokers' certificates, for SSL / SASL_SSL "
        "(empty: the system's CAs); the broker's name is always checked against its certificate")
    # control-event keys (collector/auth.py, docs/security.md)
    keys: str = Field(default=DEFAULT_KEYS_PATH, description="the key directory (0700): public.json and the private "
                      "keys this host signs with, made on first use")
    key_engine: str = Field(default="", description="the engine's Ed25519 private key, 64 hex digits (instead of engine.key)")
    key_analytics: str = Field(default="", description="the analytics consumer's private key, hex (instead of analytics.key)")
    key_console: str = Field(default="", description="the web console's private key, hex (instead of console.key)")
    key_executor: str = Field(default="", description="the trainer's (executor's) private key, hex (instead of executor.key)")
    key_rank: str = Field(default="", description="the ranks' private key (probe results only), hex (instead of rank.key)")
    job: str = Field(default="", description="set by the node agent for its ranks: the job name on the bus (resihp run --job)")
    devices: str = Field(default="", description="set by the node agent when it restarts a job at a new layout: the "
                         "device id of each of its node's ranks by local rank, comma-separated (trainer/agent/relayout.py)")
    plan_epoch: int = Field(default=0, ge=0, description="set by the node agent with RESIHP_DEVICES: the plan epoch the "
                            "restarted world runs")
    store_scope: str = Field(default="", description="set by the node agent for its ranks: the rendezvous round their "
                             "signed store records belong to (trainer/agent/shrink.py)")
    ranks_store: str = Field(default="", description="set by the node agent under --rdzv-backend etcd: the store its ranks "
                             "meet in (etcd://HOST:PORT,.../PREFIX, trainer/agent/etcd_store.py); unset: the bootstrap "
                             "TCPStore at MASTER_ADDR:MASTER_PORT")
    legacy_keys: str = Field(default="", description="an HMAC key file of the earlier scheme: its signatures verify, "
                             "nothing is signed with it")
    # processes
    gc: str = Field(default="streaming", description="streaming (raised collector thresholds) or python (CPython's)")
    log: str = Field(default="WARNING", description="log level of the trainer's worker processes")
    log_format: str = Field(default="json", description="json (one object per line, collector/logs.py) or text")
    trace: str = Field(default="", description="non-empty: workers print timestamped progress lines to stderr")
    # the console (ui/settings.py; `resihp ui` passes them to Streamlit)
    ui_users: str = Field(default=DEFAULT_USERS_PATH, description="the console's users file")
    ui_password: str | None = Field(default=None, description="password for `resihp ui --add-user` (else asked)")
    ui_session_s: float = Field(default=8 * 3600.0, description="how long a sign-in lasts, seconds")
    ui_trace_dir: str = Field(default=DEFAULT_TRACE_DIR, description="where the Replay page looks for traces")
    ui_page_size: int = Field(default=25, description="rows per page of the incident list")
    ui_refresh_s: float = Field(default=5.0, description="auto-refresh period of the Jobs page, seconds")
    ui_alertmanager_url: str = Field(default="http://127.0.0.1:9093",
                                     description="the Alertmanager whose alerts the console shows on incidents ('' for none)")
    ui_telemetry: str = Field(default="1", description="0/false/no: the console skips per-rank telemetry")

    # the node agent (trainer/agent/), set by `resihp run` for the ranks it starts
    agent_pid: int | None = Field(default=None, description="set by the node agent: its pid, which a rank dies with")
    stack_dir: str = Field(default="", description="set by the node agent: where a rank's stack dumps go")
    flight_dir: str = Field(default="", description="set by the node agent: where a rank keeps its flight record")
    on_failure: str = Field(default="restart", description="set by the node agent: restart (torch restarts the worker "
                            "group) or shrink (survivors keep running and re-form the world without the lost ranks)")


_read: tuple[tuple[tuple[str, str], ...], Environment] | None = None


def environment() -> Environment:
    """The environment as it is now: read again whenever a ``RESIHP_`` variable changed. Building
    the settings costs milliseconds, and readers that check a signature per control event ask for
    the key settings each time; comparing the variables costs microseconds."""
    global _read
    now = tuple(sorted((k, v) for k, v in os.environ.items() if k[:7].upper() == "RESIHP_"))
    if _read is None or _read[0] != now:
        _read = (now, Environment())
    return _read[1]


class ElasticEnvironment(BaseSettings):
    """The variables torch.distributed.elastic sets for each rank it starts (torchrun's contract,
    not ours: no prefix). Defaults describe a process started outside an elastic agent."""

    model_config = SettingsConfigDict(env_prefix="", extra="ignore", case_sensitive=True)

    RANK: int = 0
    WORLD_SIZE: int = 1
    LOCAL_RANK: int = 0
    LOCAL_WORLD_SIZE: int = 1
    TORCHELASTIC_RESTART_COUNT: int = 0
    TORCHELASTIC_RUN_ID: str = ""  # the rendezvous id (--rdzv-id) the agent runs under
    MASTER_ADDR: str = "127.0.0.1"  # the ranks' bootstrap store, hosted by the rank-0 node's agent
    MASTER_PORT: int = 29500


def elastic_environment() -> ElasticEnvironment:
    """The elastic agent's variables as they are now (read on every call)."""
    return ElasticEnvironment()
