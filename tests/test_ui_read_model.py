"""The console's fold, its users file and its figures: unit tests on plain values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from collector.embedded import EmbeddedBus
from collector.events import (
    EventFactory, Evidence, FaultCategory, IncidentOpened, Location, PlanDecision, PlanWithheld, PolicyMode, Severity,
)
from ui.actions import ActionRefused, change_policy, decide_plan
from ui.auth import AuthError, NotAllowed, Session, SessionExpired, User, UsersFile, UsersFileError, verify_password
from ui.charts import downsample, plan_cells
from tests.fixtures.console_demo import DemoSpec, demo_events
from tests.fixtures.signing import signed
from ui.feed import Feed
from ui.read_model import ReadModel
from tests.fixtures.signing import factory


def test_ui_fold_follows_the_whole_lifecycle_and_is_idempotent() -> None:
    events = demo_events(DemoSpec(iterations=90, lifecycle="verified"))
    model = ReadModel()
    for e in events + events:  # a replayed log changes nothing
        model.apply(e)
    (inc,) = model.incidents.values()
    assert model.incident_state(inc) == "resolved"
    steps = [(s.label, s.time_s is not None) for s in model.timeline(inc)]
    assert steps == [("opened", True), ("confirmed", True), ("plan proposed", True), ("auto-applied", True),
                     ("applied", True), ("verified", True), ("resolved", True)]
    plan = model.plans[inc.plan_ids[0]]
    assert len(plan.decisions) == 1 and plan.status == "verified"
    verified = next(s for s in model.timeline(inc) if s.label == "verified")
    assert plan.verified is not None
    assert verified.detail.endswith(f"tokens/s measured: {plan.verified[1].reason}")
    assert "against the predicted" in verified.detail
    job = model.jobs["demo"]
    assert job.current_plan is not None and job.current_plan.epoch == 1
    assert len(job.predictions) == 90 and list(job.predictions.arrays()["iteration"]) == list(range(90))
    assert [m.kind for m in job.marks] == ["incident", "reshape"]
    assert job.marks[1].iteration == 72  # the ack's time mapped onto the iteration then running


def test_ui_fold_attaches_why_no_plan_was_made_to_its_incident_even_when_it_comes_first() -> None:
    """plan.withheld travels on control, the incident on analytics: either may be read first."""
    engine, analytics = factory("demo", "remediation"), factory("demo", "analytics")
    withheld = engine.make(PlanWithheld(reason="plan refused: 3 devices cannot hold 32 layers", base_epoch=2,
                                        incident_ids=["i-late", "i-early"]), time_s=20.0)
    opened = [analytics.make(IncidentOpened(
        incident_id=iid, category=FaultCategory.FAIL_STOP, severity=Severity.CRITICAL, iteration=5,
        locations=[Location(target="compute", rank=r)], evidence=Evidence(), summary="rank stopped"), time_s=10.0)
        for iid, r in (("i-early", 3), ("i-late", 4))]
    model = ReadModel()
    for e in [opened[0], withheld, opened[1], withheld]:  # the second copy is a replay: ignored
        model.apply(e)
    for iid in ("i-early", "i-late"):
        ((at, why),) = model.incidents[iid].withheld
        assert at == 20.0 and not why.waiting and why.reason.startswith("plan refused")
        assert not model.incidents[iid].plan_ids


def test_ui_fold_shows_a_pending_plan_and_the_slow_rank_in_the_heatmap() -> None:
    model = ReadModel()
    for e in demo_events(DemoSpec(iterations=80, fault_rank=5, fault_factor=2.0, fault_at=60)):
        model.apply(e)
    (inc,) = model.incidents.values()
    assert model.incident_state(inc) == "awaiting decision"
    iterations, ranks, matrix = model.jobs["demo"].slowdown(50, 79)  # the detector's factors
    assert list(ranks) == list(range(8))
    assert matrix.shape == (8, 30) and iterations[0] == 50
    after = matrix[:, iterations >= 60]
    assert np.all(after[5] > 1.6) and np.all(np.delete(after, 5, axis=0) < 1.2)
    q = model.jobs["demo"].ranks.seq_len_quantiles(50, 79)
    assert len(q["p50"]) == 30 and np.all(q["p5"] <= q["p95"])


def test_ui_cells_mark_unused_and_slow_devices() -> None:
    model = ReadModel()
    for e in demo_events(DemoSpec(iterations=70)):
        model.apply(e)
    job = model.jobs["demo"]
    plan = next(iter(model.plans.values()))
    cells = {c.device: c for c in plan_cells(plan.proposed.plan, job.layout, job.health)}
    assert cells[5].health == "unused" and cells[4].health == "healthy"
    current = {c.device: c for c in plan_cells(None, job.layout, job.health)}
    assert current[5].health == "slow" and current[5].factor == 2.0 and current[5].stage == 0


def test_ui_downsample_keeps_the_worst_value_of_each_bucket() -> None:
    x = np.arange(10_000)
    y = np.ones(10_000)
    y[4321] = 9.0
    out = downsample({"iteration": x, "observed_s": y}, 100, worst=["observed_s"])
    assert len(out["iteration"]) == 100 and out["observed_s_max"].max() == 9.0
    assert out["observed_s"].max() < 1.1


def test_ui_users_file_hashes_and_refuses(tmp_path: Path) -> None:
    users = UsersFile(tmp_path / "u.toml")
    with pytest.raises(UsersFileError, match="resihp ui --add-user"):
        users.authenticate("alice", "pw")
    users.add_user("alice", "operator", "s3cret")
    users.add_user("bob", "viewer", "hunter2")
    text = (tmp_path / "u.toml").read_text()
    assert "s3cret" not in text and "scrypt$" in text
    assert users.authenticate("alice", "s3cret") == User("alice", "operator")
    assert users.authenticate("bob", "hunter2").role == "viewer"
    for name, pw in (("alice", "wrong"), ("carol", "s3cret")):
        with pytest.raises(AuthError, match="wrong user name or password"):
            users.authenticate(name, pw)
    assert not verify_password("x", "md5$abc")
    with pytest.raises(ValueError, match="role"):
        users.add_user("eve", "admin", "pw")
    (tmp_path / "edited.toml").write_text('[users.mallory]\nrole = "admin"\npassword = "scrypt$x"\n')
    with pytest.raises(UsersFileError, match="user 'mallory' needs role = one of"):
        UsersFile(tmp_path / "edited.toml").authenticate("mallory", "pw")


def _feed_with_pending_plan(tmp_path: Path) -> Feed:
    path = tmp_path / "bus.sqlite"
    with EmbeddedBus(path) as bus:
        bus.publish(demo_events(DemoSpec(iterations=70)))
    feed = Feed(lambda: EmbeddedBus(path), topics_read=["resihp.analytics", "resihp.control"])
    feed.refresh()
    return feed


def test_ui_actions_check_role_expiry_and_state_before_publishing(tmp_path: Path) -> None:
    feed = _feed_with_pending_plan(tmp_path)
    plan_id = next(iter(feed.model.plans))
    viewer = Session(User("bob", "viewer"), 0, 100)
    operator = Session(User("alice", "operator"), 0, 100)
    with pytest.raises(NotAllowed, match="bob is a viewer"):
        decide_plan(feed, viewer, plan_id, approve=True, now_s=50)
    with pytest.raises(SessionExpired):
        decide_plan(feed, operator, plan_id, approve=True, now_s=100)
    with pytest.raises(ActionRefused, match="no proposed plan"):
        decide_plan(feed, operator, "plan-nope", approve=True, now_s=50)
    assert feed.model.plans[plan_id].pending
    event = decide_plan(feed, operator, plan_id, approve=False, comment=" too costly ", now_s=50)
    assert isinstance(event.payload, PlanDecision) and event.payload.comment == "too costly"
    assert feed.model.plans[plan_id].status == "rejected"
    with pytest.raises(ActionRefused, match="already rejected by ui:alice"):
        decide_plan(feed, operator, plan_id, approve=True, now_s=50)
    with pytest.raises(ActionRefused, match="at least one severity"):
        change_policy(feed, operator, "demo", mode=PolicyMode.AUTO, auto_severities=[], now_s=50)
    e1 = change_policy(feed, operator, "demo", mode=PolicyMode.AUTO, auto_severities=[Severity.CRITICAL], now_s=50)
    policy = feed.model.jobs["demo"].policy
    assert policy is not None and policy.mode == PolicyMode.AUTO
    assert e1.source == "ui:alice" and e1.seq == event.seq + 1  # per-source numbering continues
    feed.close()


def test_ui_fold_ignores_decisions_for_unknown_plans_and_keeps_the_first_verdict() -> None:
    model = ReadModel()
    for e in demo_events(DemoSpec(iterations=70)):
        model.apply(e)
    plan_id = next(iter(model.plans))
    f = factory("demo", "ui:alice")
    model.apply(f.make(PlanDecision(plan_id="plan-unknown", approve=True, actor="ui:alice")))
    record = model.plans[plan_id].record
    assert record is not None
    model.apply(f.make(record.decision(approve=True, actor="ui:alice")))  # bound to the proposal it answers
    model.apply(factory("demo", "ui:bob").make(record.decision(approve=False, actor="ui:bob")))
    assert model.plans[plan_id].status == "approved"
    assert model.next_seq("demo", "ui:alice") == 2 and model.next_seq("demo", "ui:bob") == 1


def test_ui_replay_reads_a_parquet_trace_without_telemetry(tmp_path: Path) -> None:
    from collector.trace import TraceWriter
    from ui.trace_source import load_trace

    events = demo_events(DemoSpec(iterations=90, lifecycle="verified"))
    with TraceWriter(tmp_path / "run.parquet") as w:
        w.write(events)
    loaded = load_trace(tmp_path / "run.parquet")
    assert loaded.skipped == 0
    assert len(loaded.events) == sum(e.kind != "telemetry.iteration" for e in events)
    assert [e.time_s for e in loaded.events] == sorted(e.time_s for e in loaded.events)
    assert {"incident.opened", "plan.proposed", "command.ack", "plan.verified"} <= {e.kind for e in loaded.events}


def test_ui_fold_takes_the_running_plan_from_plan_current_without_telemetry() -> None:
    from collector.events import PlanCurrent
    from collector.plan import Plan

    start = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4)
    reshaped = Plan.uniform(tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4, epoch=1, first_device=8)
    trainer = factory("grid-job", "trainer")
    model = ReadModel()
    model.apply(trainer.make(PlanCurrent(plan=start, reason="start")))
    assert model.job("grid-job").current_plan == start
    model.apply(trainer.make(PlanCurrent(plan=reshaped, reason="reshape")))
    model.apply(trainer.make(PlanCurrent(plan=start, reason="start")))  # a late duplicate of an older epoch
    assert model.job("grid-job").current_plan == reshaped


def _incident(incident_id: str, summary: str = "rank 5 slow") -> IncidentOpened:
    return IncidentOpened(incident_id=incident_id, category=FaultCategory.FAIL_SLOW, severity=Severity.HIGH,
                          iteration=10, locations=[Location(target="compute", rank=5)], evidence=Evidence(),
                          summary=summary)


def test_ui_fold_shows_rejected_control_events_from_a_plain_dict_payload() -> None:
    """control.rejected is folded by kind, whether its payload is the contract's class or a dict."""
    from collector.events import Envelope
    rejected = Envelope.model_construct(
        id="rej-1", kind="control.rejected", schema_version=1, job="demo", source="remediation", seq=0, time_s=5.0,
        payload={"event_id": "forged-7", "kind": "plan.decision", "source": "ui:alice",  # type: ignore[arg-type]
                 "reason": "no valid signature for ui:alice"})  # the point: a dict payload folds like the class
    by_trainer = Envelope.model_construct(
        id="rej-2", kind="control.rejected", schema_version=1, job="demo", source="trainer", seq=0, time_s=6.0,
        payload={"event_id": "forged-8", "kind": "command.reconfigure", "source": "mallory",  # type: ignore[arg-type]
                 "reason": "unsigned command.reconfigure", "reader": "trainer:rank-0"})  # a dict payload, as above
    model = ReadModel()
    model.apply(rejected)
    model.apply(rejected)  # a duplicate adds nothing
    model.apply(by_trainer)
    assert [(r.by, r.source) for r in model.security.rejected][1:] == [("trainer:rank-0", "mallory")]
    row = model.security.rejected[0]
    assert (row.job, row.by, row.event_id, row.kind, row.source, row.reason) == (
        "demo", "remediation", "forged-7", "plan.decision", "ui:alice", "no valid signature for ui:alice")
    assert "demo" not in model.jobs and not model.plans


def test_ui_fold_keeps_failed_sign_ins_out_of_the_job_list() -> None:
    from collector.events import SignInFailed
    from ui.read_model import CONSOLE_JOB, CONSOLE_SOURCE
    factory = EventFactory(CONSOLE_JOB, CONSOLE_SOURCE)
    model = ReadModel()
    model.apply(factory.make(SignInFailed(user="alice", client="10.0.0.1", reason="wrong_password",
                                          user_failures=4, client_failures=4)))
    model.apply(factory.make(SignInFailed(user="alice", client="10.0.0.1", reason="wrong_password",
                                          user_failures=5, client_failures=5, locks=["user"], locked_until_s=99.0)))
    assert len(model.security.signin_failures) == 2 and len(model.security.lockouts) == 1
    assert model.jobs == {} and model.next_seq(CONSOLE_JOB, CONSOLE_SOURCE) == 2


def test_ui_fold_warns_when_two_analytics_writers_publish_incidents_for_one_job() -> None:
    model = ReadModel()
    first = signed(EventFactory("demo", "analytics").make(_incident("inc-1"), event_id="e1"))
    for e in (first, first):  # a republished record is not a second writer
        model.apply(e)
    assert model.security.writer_warnings("demo") == []
    # A second consumer with the same source name and deterministic ids: same id, other content.
    model.apply(signed(EventFactory("demo", "analytics").make(_incident("inc-1", "rank 2 slow"), event_id="e1")))
    (conflict,) = model.security.writer_warnings("demo")
    assert conflict.startswith("1 incident events of job demo reuse another event's id with different content")
    # A second consumer with its own source name.
    model.apply(signed(EventFactory("demo", "analytics-b").make(_incident("inc-2"))))
    warnings = model.security.writer_warnings("demo")
    assert any("come from 2 sources (analytics, analytics-b)" in w for w in warnings)
    assert model.security.writer_warnings("other-job") == []


def test_ui_replay_names_every_decision_of_a_run_and_what_the_trainer_runs() -> None:
    from collector.events import PlanCurrent
    from collector.plan import Plan
    from ui.views.replay import describe

    events = demo_events(DemoSpec(iterations=90, lifecycle="verified"))
    events += [EventFactory("demo", "rank-0").make(PlanCurrent(plan=Plan.uniform(
                   tp=2, pp=2, dp=2, num_layers=8, microbatches_per_replica=4), reason="reshape")),
               EventFactory("demo", "remediation").make(PlanWithheld(reason="too few devices", base_epoch=0))]
    named = {e.kind: describe(e) for e in events}
    assert named["plan.current"] == ("trainer", "runs epoch 0 (TP2·PP2·DP2, reshape)")
    assert named["plan.withheld"] == ("planner", "withheld: too few devices")
    assert {k for k, (who, _) in named.items() if who} >= {
        "incident.opened", "plan.proposed", "plan.decision", "command.reconfigure", "command.ack", "plan.verified"}


def test_recovery_phases_fold_into_one_timeline_per_new_world_and_a_mark() -> None:
    """``telemetry.recovery`` events (the node agent's, one per phase) become the job page's
    recovery timeline: one recovery per generation, phases in order, replay changes nothing."""
    from collector.events import RecoveryPhase
    from ui.views.jobs import recovery_rows

    make = EventFactory("elastic", "agent-host-1").make
    since, events = 0.0, []
    for phase, took in [("detected", 0.05), ("rendezvous closed", 0.2), ("new world", 0.1), ("state restored", 0.02),
                        ("first step", 0.3)]:
        since += took if phase != "detected" else 0.0
        events.append(make(RecoveryPhase(generation=1, phase=phase, duration_s=took, since_detected_s=since,
                                         iteration=7, world=[0, 1, 2], lost=[3], failed_op="all_reduce(gradients)")))
    model = ReadModel()
    for e in events[:3] + events + events[3:]:
        model.apply(e)
    (rec,) = model.jobs["elastic"].recoveries.values()
    assert list(rec.phases) == ["detected", "rendezvous closed", "new world", "state restored", "first step"]
    assert rec.total_s == pytest.approx(0.62) and rec.lost == [3] and rec.world == [0, 1, 2]
    assert [m.kind for m in model.jobs["elastic"].marks] == ["recovery"]
    rows = recovery_rows(model.jobs["elastic"])
    assert [r["phase"] for r in rows][-1] == "first step" and rows[-1]["since detected s"] == pytest.approx(0.62)
    assert {r["lost ranks"] for r in rows} == {"3"}


def test_ui_fold_remembers_a_bounded_number_of_refused_ids_under_a_flood_of_forgeries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgeries cost a writer nothing: the read model keeps the newest refused ids only (as every
    reader does, collector/auth.py Refusals; 50 here instead of 10,000 to keep the test short), lists
    each once while it is kept, and one that comes back after its id fell out is listed again."""
    import collector.auth
    from collector.auth import load_keyring

    monkeypatch.setattr(collector.auth, "REFUSALS_KEPT", 50)
    forger = EventFactory("demo", "ui:mallory")
    first = forger.make(PlanDecision(plan_id="p0-1", approve=True, actor="ui:mallory"))
    model = ReadModel(keyring=load_keyring())
    model.apply(first)
    model.apply(first)  # kept: listed once
    assert len(model.security.rejected) == 1
    for i in range(60):
        model.apply(forger.make(PlanDecision(plan_id=f"p0-{i + 2}", approve=True, actor="ui:mallory")))
    assert len(model._refused) == 50 and first.id not in model._refused
    before = len(model.security.rejected)
    model.apply(first)
    assert first.id in model._refused and len(model.security.rejected) == before + 1
    assert model.security.rejected[-1].event_id == first.id
    assert "demo" not in model.jobs and not model.plans
