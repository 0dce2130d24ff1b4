"""Keys that let their holder do its own job and nothing more (collector/auth.py, collector/keys.py,
docs/security.md "Keys"): a host given only the rank key signs probe results and nothing a reader
acts on otherwise; a host given public keys only verifies but cannot sign; a person's key signs only
that person's decisions; an old HMAC-signed log verifies only against the old key file, read-only."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

import pytest

from collector.auth import Gate, KeyFileError, Signer, canonical_bytes, load_keyring, operator_key
from collector.embedded import EmbeddedBus
from collector.events import EventFactory, PlanDecision, PolicyChanged, PolicyMode, ProbeResult
from collector.keys import KeyDir
from collector.plan import Plan
from collector.plan_lifecycle import PlanLifecycle, fold
from collector.stream import EventStream
from resihp.cli import main
from tests.fixtures.signing import signed
from trainer.integration import new_command
from trainer.telemetry import TelemetryPublisher
from ui.read_model import ReadModel

JOB = "keysjob"
PLAN = Plan.uniform(tp=1, pp=2, dp=2, num_layers=4, microbatches_per_replica=2)


def _session_keys() -> KeyDir:
    return KeyDir(Path(os.environ["RESIHP_KEYS"]))


def test_a_rank_host_signs_probe_results_and_no_reader_acts_on_a_command_signed_with_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = _session_keys()
    session.export(["rank"], tmp_path / "rank-host")
    assert sorted(p.name for p in (tmp_path / "rank-host").iterdir()) == ["public.json", "rank.key"]

    monkeypatch.setenv("RESIHP_KEYS", str(tmp_path / "rank-host"))
    rank_ring = load_keyring()
    assert rank_ring.can_sign("rank") and not any(rank_ring.can_sign(r) for r in ("engine", "executor", "analytics",
                                                                                 "console", "person.alice"))
    with pytest.raises(KeyFileError, match="cannot sign as engine"):
        Signer(EventFactory(JOB, "rank-3"), "engine")
    # what a rank publishes: its probe result, signed with the rank key by the telemetry thread
    with EmbeddedBus(tmp_path / "bus.sqlite") as bus:
        publisher = TelemetryPublisher(lambda: EmbeddedBus(tmp_path / "bus.sqlite"), JOB, 3, heartbeat_s=None)
        publisher.publish(ProbeResult(probe_id="q1", rank=3, duration_s=0.1, reference_s=0.1))
        publisher.close(timeout_s=30)
        stream = EventStream(bus, "keys-test", ["resihp.control"], on_assign=lambda ps: {tp: 0 for tp in ps})
        (result,) = [d.event for d in stream.poll(timeout_s=0.5) if d.event.kind == "probe.result"]
        stream.close()
    assert result.signature is not None and result.signature.startswith("rank:")
    forged_command = rank_ring.sign(EventFactory(JOB, "remediation").make(new_command(PLAN.model_copy(
        update={"epoch": 1}))), "rank")
    forged_policy = rank_ring.sign(EventFactory(JOB, "ui:alice").make(PolicyChanged(
        mode=PolicyMode.AUTO, actor="ui:alice")), "rank")

    monkeypatch.setenv("RESIHP_KEYS", str(session.path))  # the readers: the whole job's public keys
    readers = load_keyring()
    assert readers.verify(result) is None
    for forged in (forged_command, forged_policy):
        assert "signed as 'rank', but only" in (readers.verify(forged) or "")
        assert not Gate("engine").admit(forged)
    state = fold([forged_policy], PlanLifecycle(job=JOB))
    assert state.policy_mode == PolicyMode.PROPOSE and forged_policy.id in state.rejected
    model = ReadModel()
    model.apply(forged_policy)
    assert [r.event_id for r in model.security.rejected] == [forged_policy.id]


def test_a_host_with_public_keys_only_verifies_every_signer_but_signs_nothing(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    command = signed(EventFactory(JOB, "remediation").make(new_command(PLAN.model_copy(update={"epoch": 1}))))
    decision = signed(EventFactory(JOB, "cli:alice").make(PlanDecision(plan_id="p", approve=True, actor="cli:alice")))
    _session_keys().export([], tmp_path / "reader")
    assert [p.name for p in (tmp_path / "reader").iterdir()] == ["public.json"]
    monkeypatch.setenv("RESIHP_KEYS", str(tmp_path / "reader"))
    reader = load_keyring()
    assert reader.verify(command) is None and reader.verify(decision) is None
    for key_id in ("engine", "analytics", "console", "executor", "rank", "person.alice"):
        with pytest.raises(KeyFileError, match=f"cannot sign as {key_id}"):
            reader.sign_bytes(b"anything", key_id)
    assert not (tmp_path / "reader" / "engine.key").exists()  # first use made nothing here: the set exists
    # verifying stays total: any object, any key id, any bytes
    for signature in (None, "", "engine:" + "0" * 128, "person.zed:" + "ab" * 64, "engine:" + "0" * 64, 7, "é:00"):
        key_id, reason = reader.verify_bytes(b"data", signature, ("engine",), "record")
        assert reason
    assert reader.verify_bytes("not bytes", command.signature, ("engine",), "record")[1]  # type: ignore[arg-type]


def test_a_persons_key_signs_only_that_persons_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = load_keyring()
    mine = EventFactory(JOB, "cli:alice").make(PlanDecision(plan_id="p", approve=True, actor="cli:alice"))
    as_bob = EventFactory(JOB, "cli:bob").make(PlanDecision(plan_id="p", approve=True, actor="cli:bob"))
    as_web = EventFactory(JOB, "ui:alice").make(PlanDecision(plan_id="p", approve=True, actor="ui:alice"))
    assert keys.verify(keys.sign(mine, "person.alice")) is None
    assert "signs only as cli:alice" in (keys.verify(keys.sign(as_bob, "person.alice")) or "")
    assert "signs only as cli:alice" in (keys.verify(keys.sign(as_web, "person.alice")) or "")
    # the web console's key signs for its signed-in users only, not for a command-line person
    assert keys.verify(keys.sign(as_web, "console")) is None
    assert "signs with their own key" in (keys.verify(keys.sign(mine, "console")) or "")
    # a person's key writes only what the console writes
    command = EventFactory(JOB, "cli:alice").make(new_command(PLAN.model_copy(update={"epoch": 1})))
    assert "signed as 'person.alice', but only engine/executor" in (keys.verify(keys.sign(command, "person.alice")) or "")

    # alice's own key directory: her key and the public keys; she cannot approve as bob
    path = _session_keys().add_person("dana", tmp_path / "dana")
    assert sorted(p.name for p in path.parent.iterdir()) == ["person.dana.key", "public.json"]
    monkeypatch.setenv("RESIHP_KEYS", str(path.parent))
    bus = ["--bus", "embedded", "--bus-path", str(tmp_path / "bus.sqlite")]
    with pytest.raises(SystemExit, match="cannot sign as cli:bob"):
        main(["plans", "policy", "auto", "--job", JOB, *bus, "--as", "bob"])
    with pytest.raises(SystemExit, match="cannot sign as ui:dana"):
        main(["plans", "policy", "auto", "--job", JOB, *bus, "--as", "ui:dana"])
    assert main(["plans", "policy", "auto", "--job", JOB, *bus, "--as", "dana"]) == 0
    monkeypatch.setenv("RESIHP_KEYS", str(_session_keys().path))
    with EmbeddedBus(tmp_path / "bus.sqlite") as b:
        stream = EventStream(b, "keys-test", ["resihp.control"], on_assign=lambda ps: {tp: 0 for tp in ps})
        (policy,) = [d.event for d in stream.poll(timeout_s=0.5)]
        stream.close()
    assert policy.signature is not None and policy.signature.startswith("person.dana:") and load_keyring().verify(policy) is None


def test_a_person_added_while_a_reader_runs_is_known_to_it_without_a_restart() -> None:
    gate = Gate("engine")  # holds the keyring it was built with
    key_id = operator_key("cli:frank", create=True)
    decision = load_keyring().sign(EventFactory(JOB, "cli:frank").make(
        PlanDecision(plan_id="p", approve=True, actor="cli:frank")), key_id)
    assert gate.keyring is not load_keyring() and gate.admit(decision)


def _legacy_file(path: Path) -> dict[str, bytes]:
    secrets_ = {role: os.urandom(32) for role in ("engine", "analytics", "console", "executor")}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "keys": {r: k.hex() for r, k in secrets_.items()}}, f)
    return secrets_


def test_an_hmac_signed_log_verifies_only_against_the_old_key_file_which_signs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _legacy_file(tmp_path / "keys.json")

    def hmac_signed(event, role):  # as the platform signed before Ed25519
        mac = hmac.new(old[role], canonical_bytes(event), hashlib.sha256).hexdigest()
        return event.model_copy(update={"signature": f"{role}:{mac}"})

    command = hmac_signed(EventFactory(JOB, "remediation").make(new_command(PLAN.model_copy(update={"epoch": 1}))),
                          "engine")
    by_cli = hmac_signed(EventFactory(JOB, "cli:bob").make(PlanDecision(plan_id="p", approve=True, actor="cli:bob")),
                         "console")
    assert "set RESIHP_LEGACY_KEYS" in (load_keyring().verify(command) or "")

    monkeypatch.setenv("RESIHP_LEGACY_KEYS", str(tmp_path / "keys.json"))
    keys = load_keyring()
    assert keys.verify(command) is None
    assert keys.verify(by_cli) is None  # under the old scheme the console's key signed cli: decisions too
    tampered = command.model_copy(update={"seq": command.seq + 1})
    assert "does not verify with the legacy keys" in (keys.verify(tampered) or "")
    assert "signed as 'analytics'" in (keys.verify(hmac_signed(command, "analytics")) or "")
    assert len(keys.sign_bytes(b"x", "engine").partition(":")[2]) == 128  # new signatures are Ed25519 only

    os.chmod(tmp_path / "keys.json", 0o644)  # secrets: the old file stays private
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keyring()
    os.chmod(tmp_path / "keys.json", 0o600)
    monkeypatch.delenv("RESIHP_LEGACY_KEYS")
    monkeypatch.setenv("RESIHP_KEYS", str(tmp_path / "keys.json"))  # the old setting, unchanged
    with pytest.raises(KeyFileError, match="RESIHP_LEGACY_KEYS"):
        load_keyring()
