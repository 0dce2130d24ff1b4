"""Every process the demo starts dies with it: SIGTERM (its ``finally`` stops the components in
order) and SIGKILL (nothing of the demo runs; the guards' parent-death signal ends each
component's process group) leave 0 orphans. The real ``resihp demo`` on the embedded bus, killed
once its components run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py

REPO = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has finished)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals and /proc are Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_the_demo_leaves_no_process_behind(sig: signal.Signals, tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "demo", "--headless", "--short", "--workload", "sim", "--speed", "1",
         "--bus", "embedded", "--workdir", str(workdir), "--timeout", "300"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Wait until every component and the workload run (the workload starts last).
        deadline = time.monotonic() + 120
        while not (workdir / "logs" / "workload.log").exists() and demo.poll() is None:
            assert time.monotonic() < deadline, "the demo never started its workload"
            time.sleep(0.2)
        time.sleep(1.0)  # let the guards start their components
        spawned = _descendants(demo.pid)
        assert len(spawned) >= 6, spawned  # analytics, remediation, workload: each a guard and its component
        demo.send_signal(sig)
        demo.wait(60)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p for p in spawned if _alive(p))
        assert left == [], f"orphans after {sig.name}: " + "; ".join(
            Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120] for p in left)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
