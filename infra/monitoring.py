"""Prometheus and Alertmanager from Debian's packages, on loopback, for ResiHP's /metrics.

Writes ``prometheus.yml`` and ``alertmanager.yml`` from the templates beside the rules
(``infra/prometheus/``, ``infra/alertmanager/``), starts ``prometheus`` and
``prometheus-alertmanager`` with their data under a work directory, and waits until each answers
``/-/ready``. The children are bound to the process that started them (Linux ``PR_SET_PDEATHSIG``):
if it dies, so do they. ``resihp ops up|down`` and tests/test_metrics_prometheus.py use it.

What can go wrong: a binary is missing (install Debian's ``prometheus`` and
``prometheus-alertmanager``: ``make test`` does), a port is taken (pass others), a config is refused
(the error names the log file holding the server's own words).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import string
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE / "prometheus" / "rules.yml"
BINARIES = ("prometheus", "promtool", "prometheus-alertmanager")
_PR_SET_PDEATHSIG = 1
CONSOLE_URL = "http://127.0.0.1:8501"  # `resihp ui`'s default: where the alerts' incident links point


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def prometheus_config(targets: list[str], alertmanager: str, *, scrape_interval: str = "5s",
                      evaluation_interval: str = "5s", rules: Path = RULES, console_url: str = CONSOLE_URL) -> str:
    text = (HERE / "prometheus" / "prometheus.template.yml").read_text()
    return string.Template(text).substitute(
        scrape_interval=scrape_interval, evaluation_interval=evaluation_interval, rules=str(rules),
        alertmanager=alertmanager, targets=", ".join(f"'{t}'" for t in targets),
        console_url=console_url.rstrip("/").replace("'", "%27"))


def alertmanager_config(webhook_url: str, *, group_wait: str = "10s", group_interval: str = "1m") -> str:
    text = (HERE / "alertmanager" / "alertmanager.template.yml").read_text()
    return string.Template(text).substitute(webhook_url=webhook_url, group_wait=group_wait,
                                            group_interval=group_interval)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _start(name: str, argv: list[str], url: str, workdir: Path, timeout_s: float) -> Server:
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)
    server = Server(name, proc, url, log_path)
    (workdir / f"{name}.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} at start; its log {log_path} ends:\n"
                               + log_path.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1.0) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"{name} did not answer {url}/-/ready within {timeout_s:.0f} s; see {log_path}")


def start_alertmanager(workdir: Path, webhook_url: str, *, port: int = 9093, group_wait: str = "10s",
                       group_interval: str = "1m", timeout_s: float = 30.0) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "alertmanager.yml"
    config.write_text(alertmanager_config(webhook_url, group_wait=group_wait, group_interval=group_interval))
    data = workdir / "alertmanager-data"
    data.mkdir(exist_ok=True)
    argv = ["prometheus-alertmanager", f"--config.file={config}", f"--storage.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    return _start("alertmanager", argv, f"http://127.0.0.1:{port}", workdir, timeout_s)


def start_prometheus(workdir: Path, targets: list[str], alertmanager: str, *, port: int = 9090,
                     scrape_interval: str = "5s", evaluation_interval: str = "5s", console_url: str = CONSOLE_URL,
                     timeout_s: float = 30.0) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(prometheus_config(targets, alertmanager, scrape_interval=scrape_interval,
                                        evaluation_interval=evaluation_interval, console_url=console_url))
    data = workdir / "prometheus-data"
    data.mkdir(exist_ok=True)
    argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}"]
    return _start("prometheus", argv, f"http://127.0.0.1:{port}", workdir, timeout_s)


def stop_recorded(workdir: Path) -> list[str]:
    """``resihp ops down``: stop the servers whose pid files ``workdir`` holds (only if the pid still
    runs the binary it was started as); returns what was stopped."""
    stopped = []
    for name, binary in (("prometheus", "prometheus"), ("alertmanager", "prometheus-alertmanager")):
        pid_file = workdir / f"{name}.pid"
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text())
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            cmdline = ""
        if os.path.basename(cmdline) == binary:
            os.kill(pid, signal.SIGTERM)
            stopped.append(name)
        pid_file.unlink()
    return stopped
