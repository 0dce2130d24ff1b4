"""The demo's component processes: start each with its own log file, watch them, stop them in order.

Each component (workload, analytics, remediation, console) is a real ``resihp`` subprocess, so
the demo proves the wiring an operator would run. Output goes to ``<workdir>/logs/<name>.log``;
when a component dies early the demo stops and shows the end of that log.

Stopping sends SIGINT first (the commands turn it into a clean shutdown: the analytics consumer
commits and closes its DuckDB file), then SIGTERM, then SIGKILL, each after a grace period. Every
process starts in its own session so that a Ctrl-C in the terminal reaches only the demo, which
then stops its children in order.

Every child dies with the demo, however the demo ends: each component runs under a guard
(resihp/demo/guard.py) that leads the component's process group and holds Linux's parent-death
signal, so a SIGKILLed demo (no ``finally`` runs) still takes every component and every process
they started with it. Only the main thread may start components: the kernel sends the parent-death
signal when the *thread* that forked the child ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from collector.bus import Bus
from resihp.demo.guard import set_parent_death_signal


def _child_setup(supervisor_pid: int) -> None:
    """In the child, before exec: SIGINT back to its default (a demo started in the background by a
    shell inherits SIGINT *ignored*, and Python then never raises KeyboardInterrupt, so the
    components' clean shutdown, which SIGINT triggers, would be skipped); and SIGTERM to the
    child when the demo dies (the guard turns it into the end of the component's group)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_parent_death_signal(signal.SIGTERM, supervisor_pid)


def guarded(argv: list[str]) -> list[str]:
    """``argv`` run under the guard that ends its process group when the demo (this process) dies."""
    return [sys.executable, "-m", "resihp.demo.guard", "--parent", str(os.getpid()), "--", *argv]


def resihp_argv(*args: str) -> list[str]:
    """A ``resihp`` command line run by this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "resihp.cli", *args]


def bus_flags(bus: Bus, embedded_path: Path | None) -> list[str]:
    """The flags that point a child at the demo's bus (Kafka's namespace travels in the environment)."""
    if bus.name == "embedded":
        assert embedded_path is not None
        return ["--bus", "embedded", "--bus-path", str(embedded_path)]
    from collector.kafka_bus import KafkaBus  # already loaded: a bus that is not embedded came from open_bus

    if not isinstance(bus, KafkaBus):
        raise TypeError(f"the demo's children reach the embedded log or Kafka, not {type(bus).__name__}")
    return ["--bus", "kafka", "--bootstrap", bus.bootstrap]


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


@dataclass
class ProcessGroup:
    """The running components, in start order; stopped in reverse unless told otherwise."""

    workdir: Path
    env: dict[str, str]
    components: dict[str, Component] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> Component:
        log_dir = self.workdir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        comp = Component(name, argv, log_dir / f"{name}.log")
        log = comp.log_path.open("ab")
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        me = os.getpid()
        comp.proc = subprocess.Popen(guarded(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=os.getcwd(),
                                     start_new_session=True, preexec_fn=lambda: _child_setup(me))
        log.close()
        comp.started_at = time.monotonic()
        self.components[name] = comp
        return comp

    def died(self, names: list[str]) -> Component | None:
        """The first of ``names`` that has exited (for components that should run until stopped)."""
        for n in names:
            c = self.components.get(n)
            if c is not None and c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL; returns the exit code."""
        c = self.components.get(name)
        if c is None or c.proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if c.proc.poll() is not None:
                break
            try:
                os.killpg(c.proc.pid, sig)  # the whole session: streamlit's server, the trainer's ranks
            except ProcessLookupError:
                break
            try:
                c.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        return c.proc.poll()

    def wait(self, name: str, timeout_s: float | None = None) -> int | None:
        c = self.components[name]
        assert c.proc is not None
        try:
            return c.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop_all(self) -> None:
        for name in reversed(list(self.components)):
            self.stop(name, grace_s=5.0)
