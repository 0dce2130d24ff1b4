"""A node command and its ack name the rendezvous round as ``round`` (schema 3): ``epoch`` is the
plan's word. Orders and acks signed before the rename, and operators who still type ``--epoch``,
keep working."""

from __future__ import annotations

import argparse
import time

import pytest

from collector import codec
from collector.auth import load_keyring
from collector.events import AckStatus, NodeCommand, NodeCommandAck
from resihp.commands.node import _round
from tests.fixtures.signing import signed


def _old_order() -> dict:
    return {"command_id": "n-old", "node": 1, "action": "stop", "epoch": 4, "run": "a1b2c3d4e5f6",
            "expires_at_s": time.time() + 600}


def test_a_schema_2_order_reads_its_epoch_as_the_round_and_its_signature_still_verifies():
    from tests.fixtures.signing import factory

    event = factory("job", "remediation").factory.make(NodeCommand.model_validate(_old_order()))
    old = signed(event.model_copy(update={"schema_version": 2}), "engine")
    back = codec.decode(codec.encode(old))
    assert isinstance(back.payload, NodeCommand) and back.payload.round == 4
    assert back.schema_version == 2 and b'"epoch":4' in codec.encode(back)
    assert load_keyring().verify(back) is None


def test_a_schema_2_ack_reads_its_epochs_as_rounds_and_its_signature_still_verifies():
    from tests.fixtures.signing import factory

    old_body = {"command_id": "n-old", "node": 1, "action": "stop", "epoch": 4, "status": "applied",
                "running_epoch": 4, "ranks": [2, 3], "run": "a1b2c3d4e5f6"}
    event = factory("job", "agent-host-1").factory.make(NodeCommandAck.model_validate(old_body))
    old = signed(event.model_copy(update={"schema_version": 2}), "executor")
    back = codec.decode(codec.encode(old))
    assert isinstance(back.payload, NodeCommandAck) and back.payload.round == back.payload.running_round == 4
    assert back.schema_version == 2 and b'"epoch":4' in codec.encode(back) and b'"running_epoch":4' in codec.encode(back)
    assert load_keyring().verify(back) is None


def test_a_new_ack_names_its_rounds():
    ack = NodeCommandAck(command_id="n-new", node=1, action="stop", round=2, status=AckStatus.APPLIED,
                         running_round=2, run="a1b2c3d4e5f6")
    body = ack.model_dump(mode="json")
    assert body["round"] == body["running_round"] == 2 and "epoch" not in body and "running_epoch" not in body
    assert max(NodeCommandAck.VERSIONS) == 3


def test_a_new_order_names_the_round():
    order = NodeCommand(command_id="n-new", node=1, action="join", round=2, run="a1b2c3d4e5f6",
                        expires_at_s=time.time() + 600)
    body = order.model_dump(mode="json")
    assert body["round"] == 2 and "epoch" not in body and "spare" not in body  # no spare named: the bytes of schema 3
    assert max(NodeCommand.VERSIONS) == 4
    named = NodeCommand(command_id="n-spare", node=1, action="join", round=2, spare="agent-host-42")
    assert NodeCommand.model_validate_json(named.model_dump_json()).spare == "agent-host-42"


def test_the_node_command_reads_round_and_the_deprecated_epoch_flag(capsys):
    assert _round(argparse.Namespace(round=3, legacy_epoch=None)) == 3
    assert _round(argparse.Namespace(round=None, legacy_epoch=5)) == 5
    assert "--epoch is deprecated" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--round"):
        _round(argparse.Namespace(round=None, legacy_epoch=None))
