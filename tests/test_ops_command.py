"""``resihp ops up|down`` with the real binaries: up starts Prometheus (with our rules) and
Alertmanager on loopback with their data under the workdir; down stops them; and if ``ops up`` is
killed outright, its children die with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from infra import monitoring

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.monitoring]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up(workdir: Path) -> tuple[subprocess.Popen, int]:
    if monitoring.missing_binaries():
        pytest.fail("install Debian's prometheus and prometheus-alertmanager (`make test` does)")
    prom = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "ops", "up", "--workdir", str(workdir), "--targets", "127.0.0.1:1",
         "--prometheus-port", str(prom), "--alertmanager-port", str(_free_port()), "--webhook-port", str(_free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        if (workdir / "prometheus.pid").exists():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return proc, prom
            except OSError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("ops up did not bring Prometheus up within 60 s")


def _pids(workdir: Path) -> list[int]:
    return [int((workdir / f"{n}.pid").read_text()) for n in ("prometheus", "alertmanager")]


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if stat == "Z":
                return True  # exited; its parent (killed) never reaped it
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_up_serves_our_rules_and_down_stops_both(tmp_path: Path) -> None:
    workdir = tmp_path / "ops"
    proc, prom = _up(workdir)
    pids = _pids(workdir)
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}/api/v1/rules", timeout=5) as r:
        rules = [rule["name"] for g in json.loads(r.read())["data"]["groups"] for rule in g["rules"]]
    assert "ResihpFailStop" in rules and len(rules) == 6
    assert (workdir / "prometheus-data").is_dir() and (workdir / "alertmanager-data").is_dir()
    assert "127.0.0.1:1" in (workdir / "prometheus.yml").read_text()
    down = subprocess.run([sys.executable, "-m", "resihp.cli", "ops", "down", "--workdir", str(workdir)],
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "stopped prometheus, alertmanager" in down.stderr
    assert proc.wait(30) == 0
    assert all(_gone(pid) for pid in pids)


def test_the_servers_die_with_ops_up(tmp_path: Path) -> None:
    workdir = tmp_path / "ops"
    proc, _ = _up(workdir)
    pids = _pids(workdir)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must do it
    proc.wait(10)
    assert all(_gone(pid) for pid in pids)
