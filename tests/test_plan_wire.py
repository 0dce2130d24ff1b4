"""Ids on the wire as range lists, so a 100k-rank job's records fit: a plan's devices per stage (old
plans written as lists still decode, and their signatures still verify), and the detector's view
of every rank."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from collector.auth import Keyring, canonical_bytes
from collector.codec import MAX_EVENT_BYTES, InvalidEvent, decode, encode
from collector.events import EventFactory, PlanCurrent, RankHealth, RankHealthEntry, RankState, ReconfigureCommand
from collector.plan import Plan, StagePlan, id_ranges, parse_id_ranges
from tests.fixtures.payloads import payload_as


@pytest.mark.parametrize("devices, text", [
    ((8, 9, 10, 11), "8-11"), ((0, 1, 5, 7, 8), "0-1,5,7-8"), ((3,), "3"), ((7, 6, 5), "7,6,5"), ((2, 3, 1, 0), "2-3,1,0"),
])
def test_device_ids_round_trip_through_their_ranges_in_tp_rank_order(devices, text) -> None:
    assert id_ranges(devices) == text
    assert tuple(parse_id_ranges(text)) == devices


@pytest.mark.parametrize("text, why", [
    ("", "at least 1 item"), ("1,", "not N or N-M"), ("1-", "not N or N-M"), ("a-3", "not N or N-M"), ("-3", "not N or N-M"),
    ("9-2", "runs backwards"), ("0-99999999", "spans more than"),
    (",".join(["0-1047999"] * 200), "names more than"),  # 7 kB that would expand to 200M ids
])
def test_a_bad_range_list_is_refused_with_what_is_wrong(text, why) -> None:
    with pytest.raises(ValidationError, match=why):
        StagePlan.model_validate_json(json.dumps({"devices": text, "first_layer": 0, "end_layer": 1}))


def test_a_100k_device_plan_fits_one_record_and_comes_back_equal() -> None:
    plan = Plan.uniform(tp=8, pp=16, dp=781, num_layers=80, microbatches_per_replica=16)
    as_lists = len(plan.model_dump_json(context={"resihp.device_lists": True}))
    raw = encode(EventFactory("j", "trainer").make(PlanCurrent(plan=plan)))
    assert as_lists > MAX_EVENT_BYTES > len(raw)  # 1.2 MB as lists: the bus refused it
    assert payload_as(decode(raw), PlanCurrent).plan == plan


def test_a_plan_written_as_lists_decodes_and_its_signature_verifies_in_either_form() -> None:
    keys = Keyring.generate()
    moved = Plan.uniform(tp=2, pp=2, dp=2, num_layers=4, microbatches_per_replica=4, epoch=1, first_device=8)
    event = keys.sign(EventFactory("j", "remediation").make(ReconfigureCommand(command_id="c", plan_id="p", plan=moved)),
                      "engine")
    ranges = encode(event)
    assert b'"devices":"8-9"' in ranges
    record = json.loads(ranges)
    for pipe in record["payload"]["plan"]["pipelines"]:
        for stage in pipe["stages"]:
            stage["devices"] = parse_id_ranges(stage["devices"])  # the form of logs before ranges
    lists = json.dumps(record).encode()
    assert b'"devices": [8, 9]' in lists
    # what a signer before ranges covered: the header and the payload as its JSON, devices as lists
    before = json.dumps({"id": record["id"], "kind": record["kind"], "schema": record["schema_version"],
                         "job": record["job"], "source": record["source"], "seq": record["seq"],
                         "time_s": record["time_s"], "payload": record["payload"]},
                        sort_keys=True, separators=(",", ":")).encode()
    for raw in (ranges, lists):
        back = decode(raw)
        assert payload_as(back, ReconfigureCommand).plan == moved
        assert canonical_bytes(back) == canonical_bytes(event) == before
        assert keys.verify(back) is None
    record["payload"]["plan"]["pipelines"][0]["stages"][0]["devices"] = [9, 8]  # altered: no longer verifies
    assert "does not verify" in (keys.verify(decode(json.dumps(record).encode())) or "")
    record["payload"]["plan"]["pipelines"][0]["stages"][0]["devices"] = "8-x"
    with pytest.raises(InvalidEvent, match="devices"):
        decode(json.dumps(record).encode())


def test_the_view_of_100k_ranks_fits_one_record_and_reads_back_rank_by_rank() -> None:
    """analytics.rank_health with one entry per rank was 4.6 MB at 100k ranks. From schema 2 the
    healthy and untraced ranks are range lists, and the view reads back whole (``entries``)."""
    n = 99_968
    untraced = [r for r in range(n) if r % 8]  # one traced rank per TP group
    slow, dead = {8: 1.4, 4096: 2.0}, {16, 24}
    healthy = [r for r in range(0, n, 8) if r not in slow and r not in dead]
    p = RankHealth(epoch=0, iteration=5, healthy=id_ranges(healthy), not_traced=id_ranges(untraced), ranks=[
        RankHealthEntry(rank=r, state=RankState.SLOW, factor=f) for r, f in slow.items()] + [
        RankHealthEntry(rank=r, state=RankState.DEAD, factor=1e6) for r in sorted(dead)])
    raw = encode(EventFactory("j", "analytics").make(p))
    assert len(raw) < MAX_EVENT_BYTES
    view = {e.rank: (e.state, e.factor) for e in payload_as(decode(raw), RankHealth).entries()}
    assert len(view) == n
    assert view[8] == (RankState.SLOW, 1.4) and view[16] == (RankState.DEAD, 1e6) and view[1] == (RankState.NOT_TRACED, 1.0)
    assert sum(s is RankState.HEALTHY for s, _ in view.values()) == len(healthy)
    old = RankHealth(epoch=0, iteration=5, ranks=[RankHealthEntry(rank=r, state=RankState.HEALTHY) for r in range(3)])
    back = payload_as(decode(encode(EventFactory("j", "analytics").make(old))), RankHealth)
    assert [e.rank for e in back.entries()] == [0, 1, 2]
    record = json.loads(raw)
    record["payload"]["healthy"] = "0-7,x"
    with pytest.raises(InvalidEvent, match="healthy"):
        decode(json.dumps(record).encode())
