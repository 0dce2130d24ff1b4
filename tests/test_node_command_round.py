"""A node command names the rendezvous round as ``round`` (schema 3): ``epoch`` is the plan's word.
Orders signed before the rename, and operators who still type ``--epoch``, keep working."""

from __future__ import annotations

import argparse
import time

import pytest

from collector import codec
from collector.auth import load_keyring
from collector.events import NodeCommand
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


def test_a_new_order_names_the_round():
    order = NodeCommand(command_id="n-new", node=1, action="join", round=2, run="a1b2c3d4e5f6",
                        expires_at_s=time.time() + 600)
    body = order.model_dump(mode="json")
    assert body["round"] == 2 and "epoch" not in body
    assert max(NodeCommand.VERSIONS) == 3


def test_the_node_command_reads_round_and_the_deprecated_epoch_flag(capsys):
    assert _round(argparse.Namespace(round=3, legacy_epoch=None)) == 3
    assert _round(argparse.Namespace(round=None, legacy_epoch=5)) == 5
    assert "--epoch is deprecated" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--round"):
        _round(argparse.Namespace(round=None, legacy_epoch=None))
