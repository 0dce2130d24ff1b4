"""A slow replica group in a torchft job, found and evicted through torchft: seconds and tokens/s.

Runs the whole loop on the embedded bus: ``python -m trainer.torchft`` (torchft's lighthouse and
three replica groups of torchtitan's torchft trainer, one CPU rank each, the executor that evicts a
group), the analytics consumer with the detector, and the engine with auto-apply. Group 1's device
turns ×3 slow at a set step for a set number of steps (the platform's fault file). Measured:

* onset → detection → eviction, in seconds of the host clock: the fault's ``truth.fault`` (the
  group's first slowed step began), the incident that names device 1, the command, and the
  eviction acknowledged (the group stopped at a step boundary and the others committed a step in
  the smaller quorum);
* the job's tokens/s (every group's committed steps, from the executor's progress log) healthy,
  slowed, while the group is out, and after it healed back from a peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = "torchft"
SLOW_DEVICE = 1
SEQ_LEN = 256  # trainer/torchtitan/config_registry.py's debug model
LOCAL_BATCH = 1
MICROBATCHES = 2  # per group and step: the engine's uniform plans must be able to keep a global batch of 2·G on G−1 groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=None, help="where the run goes (default: a temporary folder)")
    parser.add_argument("--groups", type=int, default=3, help="replica groups (an eviction needs 3: see membership.py)")
    parser.add_argument("--warmup", type=int, default=10, help="healthy steps before the fault")
    parser.add_argument("--slow-steps", type=int, default=20, help="how many of group 1's steps are ×3 slow")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--probation", type=float, default=15.0, help="seconds the evicted group stays out")
    parser.add_argument("--timeout", type=float, default=900.0)


@dataclass(frozen=True)
class Story:
    groups: int = 3
    warmup: int = 10
    slow_steps: int = 20
    steps: int = 60
    probation_s: float = 15.0
    timeout_s: float = 900.0

    @property
    def tokens_per_group_step(self) -> int:
        return SEQ_LEN * LOCAL_BATCH * MICROBATCHES


def run_story(story: Story, workdir: Path) -> dict[str, Any]:
    """Run the loop once in ``workdir``; returns the bus's events, the progress log and the exit
    code of the torchft job (the bench and the end-to-end test read the same run)."""
    import yaml

    from collector import topics
    from collector.auth import Signer, create_keys, key_path, operator_key
    from collector.embedded import EmbeddedBus
    from collector.events import EventFactory, PolicyChanged, PolicyMode, Severity
    from collector.private_files import private_dir
    from collector.stream import EventStream
    from resihp.demo.procs import ProcessGroup, bus_flags, resihp_argv
    from trainer.torchtitan.assets import build_assets

    private_dir(workdir)
    keys = key_path().resolve()  # one key set for every part, as `resihp demo` uses (docs/security.md)
    create_keys(keys)
    bus_path = workdir / "bus.sqlite"
    assets = build_assets(workdir / "assets")
    faults = workdir / "faults.yaml"
    faults.write_text(yaml.safe_dump({"faults": [{"id": "torchft-fail-slow", "kind": "slow_compute",
                                                  "device": SLOW_DEVICE, "factor": 3.0, "at_iteration": story.warmup,
                                                  "duration_iterations": story.slow_steps}]}))
    detector = workdir / "detector.yaml"
    detector.write_text(yaml.safe_dump({}))
    env = dict(os.environ, RESIHP_BUS="embedded", RESIHP_EMBEDDED_PATH=str(bus_path), RESIHP_KEYS=str(keys),
               PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    group = ProcessGroup(workdir, env)
    code: int | None = None
    with EmbeddedBus(bus_path) as bus:
        flags = bus_flags(bus, bus_path)
        bus.publish([Signer(EventFactory(JOB, "cli:bench"), operator_key("cli:bench", create=True)).make(PolicyChanged(
            mode=PolicyMode.AUTO, auto_severities=list(Severity), actor="cli:bench"))])
        try:
            group.start("analytics", resihp_argv("analytics", *flags, "--db", str(workdir / "analytics.duckdb"),
                                                 "--detector-config", str(detector)))
            group.start("remediate", resihp_argv("remediate", *flags, "--job", JOB, "--tp", "1", "--pp", "1",
                                                 "--dp", str(story.groups), "--layers", "6",
                                                 "--microbatches", str(MICROBATCHES), "--devices", str(story.groups)))
            group.start("job", [sys.executable, "-m", "trainer.torchft", "--job", JOB, "--groups", str(story.groups),
                                "--steps", str(story.steps), "--assets", str(assets), "--workdir", str(workdir / "job"),
                                "--faults", str(faults), "--probation", str(story.probation_s), "--",
                                "--training.local_batch_size", str(LOCAL_BATCH),
                                "--training.global_batch_size", str(LOCAL_BATCH * MICROBATCHES * story.groups)])
            code = group.wait("job", timeout_s=story.timeout_s)
        finally:
            group.stop_all()
        stream = EventStream(bus, "bench", [topics.CONTROL, topics.TELEMETRY, topics.ANALYTICS, topics.TRUTH],
                             on_assign=lambda ps: {tp: 0 for tp in ps})
        events = []
        while batch := stream.poll(timeout_s=0.2):
            events += [d.event for d in batch]
        stream.close()
    progress_path = workdir / "job" / "progress.jsonl"
    progress = [json.loads(line) for line in progress_path.read_text().splitlines()] if progress_path.exists() else []
    return {"events": events, "progress": progress, "code": code}


def measure(story: Story, events: list[Any], progress: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run: onset → detection → eviction → heal (seconds) and tokens/s per phase."""
    from collector.events import (AckStatus, CommandAck, FaultInjected, IncidentOpened, ReconfigureCommand,
                                  ReshapePhase)

    def first(kind: type, pred: Any = lambda p: True) -> Any:
        return next((e for e in events if isinstance(e.payload, kind) and pred(e.payload)), None)

    onset = first(FaultInjected, lambda p: p.location.rank == SLOW_DEVICE)
    found = first(IncidentOpened, lambda p: any(loc.rank == SLOW_DEVICE for loc in p.locations))
    command = first(ReconfigureCommand)
    evicted = first(CommandAck, lambda p: p.status == AckStatus.APPLIED)
    healed = first(ReshapePhase, lambda p: p.phase == "redistribute")
    t = {name: (e.time_s if e is not None else None)
         for name, e in (("onset", onset), ("detected", found), ("commanded", command), ("evicted", evicted),
                         ("healed", healed))}
    end = max((p["at_s"] for p in progress), default=None)
    # the last healthy steps before the fault: the first ones share the host with the platform's start-up
    start = min((p["at_s"] for p in progress if p["step"] >= max(2, story.warmup - 5)), default=None)
    windows = {"healthy": (start, t["onset"]), "slowed": (t["onset"], t["commanded"]),
               "evicted": (t["evicted"], t["healed"]), "healed": (t["healed"], end)}
    tokens_per_s = {name: _tokens_per_s(progress, a, b, story.tokens_per_group_step) for name, (a, b) in windows.items()}
    quorum = {name: _participants(progress, a, b) for name, (a, b) in windows.items()}

    def since(a: str, b: str) -> float | None:
        start, stop = t[a], t[b]
        return None if start is None or stop is None else stop - start

    return {"onset_to_detection_s": since("onset", "detected"), "detection_to_command_s": since("detected", "commanded"),
            "command_to_eviction_s": since("commanded", "evicted"), "onset_to_eviction_s": since("onset", "evicted"),
            "eviction_to_heal_s": since("evicted", "healed"), "tokens_per_s": tokens_per_s, "quorum": quorum,
            "detected_step": found.payload.iteration if found else None,
            "ack": evicted.payload.detail if evicted else None}


def _tokens_per_s(progress: list[dict[str, Any]], a: float | None, b: float | None, per_step: int) -> float | None:
    """Tokens of every group's committed steps that ended in (a, b], over b − a."""
    if a is None or b is None or b <= a:
        return None
    steps = sum(1 for p in progress if a < p["at_s"] <= b and p["committed"])
    return steps * per_step / (b - a)


def _participants(progress: list[dict[str, Any]], a: float | None, b: float | None) -> list[int]:
    if a is None or b is None:
        return []
    return sorted({p["participants"] for p in progress if a < p["at_s"] <= b})


def run(args: argparse.Namespace) -> int:
    story = Story(groups=args.groups, warmup=args.warmup, slow_steps=args.slow_steps, steps=args.steps,
                  probation_s=args.probation, timeout_s=args.timeout)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="resihp-bench-torchft-")) / "run"
    started = time.monotonic()
    result = run_story(story, workdir)
    figures = measure(story, result["events"], result["progress"])
    print(f"\ntorchft: {story.groups} replica groups of torchtitan's debug model (1 CPU rank each), ×3 slow device "
          f"{SLOW_DEVICE} for steps {story.warmup}–{story.warmup + story.slow_steps - 1}, probation "
          f"{story.probation_s:.0f} s; job exit {result['code']}, {time.monotonic() - started:.0f} s wall")
    print(f"{'seconds':<28}{'':>8}")
    for key in ("onset_to_detection_s", "detection_to_command_s", "command_to_eviction_s", "onset_to_eviction_s",
                "eviction_to_heal_s"):
        print(f"{key.removesuffix('_s').replace('_', ' '):<28}{_f(figures[key], 1):>8}")
    print(f"\n{'tokens/s':<12}{'healthy':>10}{'slowed':>10}{'evicted':>10}{'healed':>10}")
    tps = figures["tokens_per_s"]
    print(f"{'job':<12}" + "".join(f"{_f(tps[k]):>10}" for k in ("healthy", "slowed", "evicted", "healed")))
    print(f"{'quorum':<12}" + "".join(f"{','.join(map(str, figures['quorum'][k])) or '-':>10}"
                                      for k in ("healthy", "slowed", "evicted", "healed")))
    print(f"\nworkdir {workdir}")
    if args.json:
        print(json.dumps({**figures, "code": result["code"], "workdir": str(workdir)}))
    return 0 if result["code"] == 0 and figures["onset_to_eviction_s"] is not None else 1


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
