"""The orchestration of ``resihp demo``: one bus, one process per component, one story, one trace.

Order: write the story's files; open the bus (a fresh embedded log in the workdir, or a fresh
Kafka namespace); publish the auto-apply policy; start ``resihp analytics`` (with the detector),
``resihp remediate`` and, unless headless, ``resihp ui``; start the workload (the torch trainer or
the simulator); fold the log while it runs (progress line); when the workload is done, let the
last plan verify, stop analytics with SIGINT and let a second ``resihp analytics --exit-when-idle``
resume from its stored positions and drain the rest; stop remediation; count the telemetry in the
analytics DuckDB file (read-only, after its writer exited); print the summary.

What can go wrong, and what the demo then says: a component that exits early stops the demo with
the end of its log; a workload that hangs on a dead rank nobody reshaped gives up (exit 3) and the
summary shows which step of the story is missing; the exit code is 1 whenever the story is
incomplete (a fault not detected, no plan applied for it).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from collector.bus import Bus
from collector.private_files import private_dir
from collector.settings import environment
from collector.auth import Signer, create_keys, key_path, operator_key
from collector.events import EventFactory, PolicyChanged, PolicyMode, Severity
from resihp.demo.procs import ProcessGroup, bus_flags, resihp_argv
from resihp.demo.progress import Progress
from resihp.demo.story import DemoStory, native_story, story_for, torchtitan_story
from resihp.demo.summary import fault_stories, overall_tokens_per_s, summary_lines
from resihp.demo.watch import LogState, LogWatch

REPO = Path(__file__).resolve().parents[2]
TORCH_MODEL = "tiny"  # trainer preset: 4 layers, quick on CPU


@dataclass
class DemoOptions:
    bus: str = "embedded"
    scale: int | None = None  # None: the default story (8 ranks)
    workload: str = "sim"  # "torch" or "sim"
    headless: bool = False
    json: bool = False
    workdir: Path | None = None
    speed: float = 1.0  # simulator: simulated seconds per wall second
    short: bool = False
    port: int = 8501
    linger_s: float | None = None  # console mode: keep it up this long at the end (None: until Ctrl-C)
    timeout_s: float = 1200.0
    tp: int | None = None  # override the story's TP degree
    pace: float | None = None  # torch: emulated device s per layer-token (None: torch_workload's default)
    trainer: str = "reference"  # torch workload: the reference trainer or the PyTorch-native executor
    titan_layout: str = "replicas"  # torchtitan: replicas, fsdp or pp (resihp/demo/story.py)


def _open_bus(opts: DemoOptions, workdir: Path, env: dict[str, str]) -> tuple[Bus, Path | None, str]:
    if opts.bus == "embedded":
        from collector.embedded import EmbeddedBus

        path = workdir / "bus.sqlite"
        return EmbeddedBus(path), path, f"embedded log {path}"
    from collector.kafka_bus import KafkaBus

    settings = environment()
    bootstrap = settings.kafka_bootstrap if "kafka_bootstrap" in settings.model_fields_set else None
    if not bootstrap:  # no broker named: start the test broker
        from infra import broker

        bootstrap = broker.up()
    namespace = f"demo-{uuid.uuid4().hex[:8]}."
    env["RESIHP_KAFKA_NAMESPACE"] = namespace
    env["RESIHP_KAFKA_BOOTSTRAP"] = bootstrap
    return KafkaBus(bootstrap, namespace=namespace), None, f"Kafka {bootstrap}, topics {namespace}resihp.*"


def _workload_argv(opts: DemoOptions, story: DemoStory, files: dict[str, Path], flags: list[str]) -> list[str]:
    if opts.trainer == "torchtitan":
        return _torchtitan_argv(story, files, flags)
    if opts.trainer == "native":
        return [sys.executable, "-m", "resihp.demo.native_workload", *flags, "--job", story.job,
                "--dp", str(story.dp), "--microbatches", str(story.microbatches_per_replica),
                "--iterations", str(story.iterations), "--faults", str(files["faults"]),
                *([] if opts.pace is None else ["--pace", str(opts.pace)])]
    if opts.workload == "torch":
        pace = [] if opts.pace is None else ["--pace", str(opts.pace)]
        return [sys.executable, "-m", "resihp.demo.torch_workload", *flags, "--job", story.job,
                "--tp", str(story.tp), "--pp", str(story.pp), "--dp", str(story.dp),
                "--microbatches", str(story.microbatches_per_replica), "--iterations", str(story.iterations),
                "--model", TORCH_MODEL, "--faults", str(files["faults"]), *pace]
    return [sys.executable, "-m", "resihp.demo.sim_workload", str(files["scenario"]), "--speed", str(opts.speed),
            *flags]


def _torchtitan_argv(story: DemoStory, files: dict[str, Path], flags: list[str]) -> list[str]:
    """torchtitan's own entry point under ``resihp run`` (docs/torchtitan.md), its assets built here."""
    from trainer.torchtitan.assets import build_assets

    workdir = files["faults"].parent
    assets = build_assets(workdir / "torchtitan-assets")
    training = ["--module", "trainer.torchtitan", "--config", "llama3_debugmodel",
                "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(assets),
                # DDP-style replicas (no all-gather inside the forward) or FSDP2 shards; pipelines of
                # story.pp stages run a micro-batch of one sample per stage slot
                "--parallelism.data_parallel_replicate_degree", "1" if story.sharded else str(story.dp),
                "--parallelism.data_parallel_shard_degree", str(story.dp) if story.sharded else "1",
                "--parallelism.pipeline_parallel_degree", str(story.pp),
                "--parallelism.pipeline_parallel_microbatch_size", "1",
                "--training.local_batch_size", str(story.microbatches_per_replica if story.pp > 1 else 1),
                "--training.global_batch_size", str(story.microbatches_per_replica * story.dp),
                "--training.steps", str(story.iterations),
                "--dump_folder", str(workdir / "torchtitan"), "--resihp.faults", str(files["faults"])]
    (workdir / "torchtitan-argv.json").write_text(json.dumps(training))  # what `python -m torchtitan.train` got
    return resihp_argv("run", "--standalone", "--nproc-per-node", str(story.gpus), "--job", story.job, *flags,
                       "--preload", "torchtitan.trainer,trainer.torchtitan.config_registry",
                       "-m", "torchtitan.train", *training)


def _remediate_argv(opts: DemoOptions, story: DemoStory, files: dict[str, Path], flags: list[str]) -> list[str]:
    argv = resihp_argv("remediate", *flags, "--job", story.job)
    if opts.trainer == "torchtitan":
        return argv + ["--tp", "1", "--pp", str(story.pp), "--dp", str(story.dp), "--layers", "6",
                       "--microbatches", str(story.microbatches_per_replica), "--devices", str(story.gpus)]
    if opts.trainer == "native":
        from trainer.native.model import LlamaConfig

        return argv + ["--tp", "1", "--pp", "1", "--dp", str(story.dp), "--layers", str(LlamaConfig().n_layers),
                       "--microbatches", str(story.microbatches_per_replica), "--devices", str(story.gpus)]
    if opts.workload == "torch":
        from trainer.reference.model import PRESETS

        layers = PRESETS[TORCH_MODEL].n_layer
        return argv + ["--tp", str(story.tp), "--pp", str(story.pp), "--dp", str(story.dp), "--layers", str(layers),
                       "--microbatches", str(story.microbatches_per_replica)]
    return argv + ["--model", str(files["model"])]


def _free_or_any(port: int) -> int:
    """``port`` if nothing listens there, else a free one (a second demo on the machine)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _duckdb_telemetry(db: Path) -> tuple[int, int]:
    """(telemetry rows, distinct telemetry ids) in the analytics file, opened read-only."""
    import duckdb

    with duckdb.connect(str(db), read_only=True) as conn:
        n, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT id) FROM events WHERE kind LIKE 'telemetry.%'").fetchall()[0]
    return int(n), int(distinct)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the demo the way Ctrl-C does: through ``run_demo``'s ``finally``, which stops
    every component in order (Python's default for SIGTERM is to die on the spot)."""
    raise SystemExit(128 + signum)


def run_demo(opts: DemoOptions) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    workdir = opts.workdir or Path(".resihp/demo") / time.strftime("%Y%m%d-%H%M%S")
    if (workdir / "analytics.duckdb").exists() or (workdir / "bus.sqlite").exists():
        print(f"{workdir} already holds a demo run; pass a new --workdir (or delete it)", file=sys.stderr)
        return 2
    story = (native_story(short=opts.short) if opts.trainer == "native"
             else torchtitan_story(short=opts.short, layout=opts.titan_layout) if opts.trainer == "torchtitan"
             else story_for(opts.scale or 8, short=opts.short, tp=opts.tp))
    private_dir(workdir)  # the bus and DuckDB files go here: only this user may enter it
    files = story.write(workdir)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    progress = Progress()
    bus, bus_path, bus_text = _open_bus(opts, workdir, env)
    flags = bus_flags(bus, bus_path)
    db = workdir / "analytics.duckdb"
    trace_path = workdir / "traces" / "demo-trace.parquet"
    progress.message(f"resihp demo: {_workload_text(opts, story)} on the {bus_text}; workdir {workdir}")
    progress.message(f"story: {story.told()}; policy: auto-apply every severity")
    # Every part signs and checks control events with one key set (docs/security.md), made here on
    # first use; children find it through RESIHP_KEYS, whatever their working directory.
    keys = key_path().resolve()
    if create_keys(keys):
        progress.message(f"made the control-event keys in {keys} (a 0700 directory)")
    env["RESIHP_KEYS"] = str(keys)
    bus.publish([Signer(EventFactory(story.job, "cli:demo"), operator_key("cli:demo", create=True)).make(PolicyChanged(
        mode=PolicyMode.AUTO, auto_severities=list(Severity), actor="cli:demo"))])
    group = ProcessGroup(workdir, env)
    ports = (_free_or_any(9464), _free_or_any(9465))  # the ports `resihp ops up` scrapes by default
    analytics_argv = resihp_argv("analytics", *flags, "--db", str(db), "--detector-config", str(files["detector"]),
                                 "--metrics-port", str(ports[0]))
    names = ["analytics", "remediate"]
    watch: LogWatch | None = None
    try:
        group.start("analytics", analytics_argv)
        group.start("remediate", _remediate_argv(opts, story, files, flags) + ["--metrics-port", str(ports[1])])
        progress.message(f"metrics: http://127.0.0.1:{ports[0]}/metrics (analytics), http://127.0.0.1:{ports[1]}/metrics "
                         f"(engine); `resihp ops up --targets 127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}` scrapes them")
        password = None
        if not opts.headless:
            password = _start_console(group, opts, workdir, flags, env)
            names.append("console")
        watch = LogWatch(bus, story.job, trace_path)
        group.start("workload", _workload_argv(opts, story, files, flags))
        components = ", ".join(["workload", *names])
        failure = _watch_workload(watch, progress, components, names, group, opts.timeout_s)
        workload_rc = group.stop("workload", grace_s=10.0)
        if failure is None and workload_rc != 0:
            wl = group.components["workload"]
            progress.message(f"the workload exited with {workload_rc}; the end of {wl.log_path}:\n{wl.log_tail(8)}")
        _settle(watch, progress, components, names, group)
        progress.close()
        _drain(watch, progress, group, analytics_argv)
        result = _report(watch.state, progress, opts, story, failure, workdir, db, trace_path)
        complete = bool(result["complete"])
        (workdir / "summary.json").write_text(json.dumps(result, indent=2))
        if not opts.headless and failure is None:
            _linger(opts, password, progress)
        if opts.json:
            print(json.dumps(result), flush=True)
        return 0 if complete else 1
    finally:
        progress.close()
        if watch is not None:
            watch.close()
        group.stop_all()
        bus.close()


def _workload_text(opts: DemoOptions, story: DemoStory) -> str:
    if opts.trainer == "torchtitan":
        kind = "FSDP2 shards" if story.sharded else "pipelines" if story.pp > 1 else "data-parallel replicas"
        return f"torchtitan (llama3 debug model, {story.gpus} CPU ranks as {kind}, {story.layout}, resihp run)"
    if opts.trainer == "native":
        return f"the native executor (Llama-style decoder, {story.layout}, {story.gpus} CPU ranks)"
    if opts.workload == "torch":
        return f"the torch trainer ({TORCH_MODEL} GPT, {story.layout}, 8 CPU ranks)"
    return f"the simulator ({story.gpus} GPUs, {story.model}, {story.layout})"


def _watch_workload(watch: LogWatch, progress: Progress, components: str, names: list[str], group: ProcessGroup,
                    timeout_s: float) -> str | None:
    """Follow the log until the workload ends; why the demo must stop early (a component died, the
    timeout passed), or None when the workload ended by itself."""
    deadline = time.monotonic() + timeout_s
    while True:
        watch.poll(timeout_s=0.3)
        progress.update(watch.state, components)
        dead = group.died(names)
        if dead is not None:
            return f"{dead.name} exited with {dead.returncode}; the end of {dead.log_path}:\n{dead.log_tail()}"
        if not group.components["workload"].running:
            return None
        if time.monotonic() > deadline:
            return f"the demo ran past --timeout {timeout_s:.0f} s"


def _drain(watch: LogWatch, progress: Progress, group: ProcessGroup, analytics_argv: list[str]) -> None:
    """Stop analytics and let a fresh one read what it had not (so every telemetry record reaches
    DuckDB), stop the engine, and read the log to its end."""
    progress.message("stopping analytics (SIGINT) and draining what it has not read yet")
    group.stop("analytics")
    group.start("analytics-drain", analytics_argv + ["--exit-when-idle", "3"])
    if group.wait("analytics-drain", timeout_s=300) is None:
        group.stop("analytics-drain")
    group.stop("remediate")
    watch.drain()
    watch.close()


def _report(state: LogState, progress: Progress, opts: DemoOptions, story: DemoStory, failure: str | None,
            workdir: Path, db: Path, trace_path: Path) -> dict:
    """Print the run's story and return the summary (``summary.json``, ``--json``)."""
    rows, distinct = _duckdb_telemetry(db)
    stories = fault_stories(state)
    for line in summary_lines(state, stories):
        progress.message(line)
    tps = overall_tokens_per_s(state, stories)
    complete = failure is None and bool(stories) and all(st.detected and st.plan is not None for st in stories)
    lost = state.telemetry_records - distinct
    progress.message(f"telemetry: {state.telemetry_records:,} events published, {rows:,} rows in DuckDB "
                     f"({distinct:,} distinct; {'nothing lost' if lost == 0 else f'{lost:,} MISSING'})")
    progress.message(f"trace: {trace_path} ({state.records:,} events) — replay it with "
                     f"`resihp replay {trace_path} --speed 10` or open it on the console's Replay page")
    if failure is not None:
        progress.message(f"the demo stopped early: {failure}")
    elif not complete:
        progress.message("the story is incomplete: see the lines above marked NO / none applied, and "
                         f"the component logs in {workdir / 'logs'}")
    return {
        "injected": [{"fault_id": st.fault.fault_id, "category": st.fault.category,
                      "device": st.fault.location.rank, "iteration": st.fault.start_iteration} for st in stories],
        "detected": [_detected_json(st) for st in stories if st.incident is not None],
        "plans_applied": sum(1 for p in state.plans.values() if p.applied_time_s is not None),
        "plans_verified": sum(1 for p in state.plans.values() if p.status == "verified"),
        "tokens_per_s": {k: (None if v is None else round(v, 1)) for k, v in tps.items()},
        "events_published": state.telemetry_records,
        "events_in_duckdb": rows,
        "distinct_events_in_duckdb": distinct,
        "incidents": len(state.incidents),
        "workload": opts.workload, "trainer": opts.trainer if opts.workload == "torch" else None, "bus": opts.bus,
        "gpus": story.gpus, "layout": story.layout,
        "complete": complete, "workdir": str(workdir), "trace": str(trace_path),
    }


def _detected_json(st) -> dict:
    inc = st.incident
    ranks = sorted({loc.rank for loc in inc.locations if loc.rank is not None})
    groups = [list(loc.tp_group) for loc in inc.locations if loc.rank is None and loc.tp_group]
    return {"incident_id": inc.incident_id, "category": inc.category, "ranks": ranks, "tp_groups": groups,
            "matches": st.fault.fault_id, "localised": st.localisation, "iteration": inc.opened_iteration,
            "iterations_after_onset": inc.opened_iteration - st.fault.start_iteration, "confirmed_by": inc.confirmed_by}


def _settle(watch: LogWatch, progress: Progress, components: str, names: list[str], group: ProcessGroup,
            limit_s: float = 20.0) -> None:
    """After the workload ends: give plans in flight and the detector's last words a moment."""
    t_end = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < t_end and group.died(names) is None:
        if watch.poll(timeout_s=0.3):
            quiet_since = time.monotonic()
        progress.update(watch.state, components)
        in_flight = watch.state.plans_with("proposed", "approved", "commanded")
        if not in_flight and time.monotonic() - quiet_since > 3.0:
            return


def _start_console(group: ProcessGroup, opts: DemoOptions, workdir: Path, flags: list[str],
                   env: dict[str, str]) -> str:
    """Write a users file with one operator and start ``resihp ui``; returns the password."""
    users = workdir / "ui-users.toml"
    password = secrets.token_urlsafe(9)
    add_env = dict(env, RESIHP_UI_PASSWORD=password)
    import subprocess

    subprocess.run(resihp_argv("ui", "--add-user", "demo", "--role", "operator", "--users", str(users)),
                   env=add_env, check=True, stdout=subprocess.DEVNULL)
    group.start("console", resihp_argv("ui", *flags, "--port", str(opts.port), "--users", str(users),
                                       "--traces", str(workdir / "traces")))
    print(f"console: http://127.0.0.1:{opts.port}  (sign in as demo / {password}; an operator)",
          file=sys.stderr, flush=True)
    return password


def _linger(opts: DemoOptions, password: str | None, progress: Progress) -> None:
    progress.message(f"the console stays up at http://127.0.0.1:{opts.port} (demo / {password}): Jobs, Incidents, "
                     "Replay (pick demo-trace.parquet)" + (" — Ctrl-C to stop" if opts.linger_s is None
                                                           else f" for {opts.linger_s:.0f} s"))
    try:
        if opts.linger_s is None:
            while True:
                time.sleep(3600)
        time.sleep(opts.linger_s)
    except KeyboardInterrupt:
        pass
