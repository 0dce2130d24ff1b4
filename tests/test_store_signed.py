"""The rendezvous store is a trust boundary (trainer/agent/signed_store.py): a second client of a
real TCPStore — a stranger who reached its port — writes a plan, a lost-rank mark, an agent's
registration, a vacancy and a rank's request to rejoin. Each is refused and reported
(``control.rejected``), and the launcher's ranks, the shrinking world and the agents act as if it
were not there; garbage bytes under every key give a refusal, never an exception."""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from collector.events import ControlRejected, ProbeRequest
from collector.plan import Plan
from tests.test_agent_run import free_port
from trainer.agent.presence import REGISTRATION_KEY, AgentPresence
from trainer.agent.shrink import ShrinkingWorld, admitted_key, is_lost, lost_key, mark_lost
from trainer.agent.signed_store import RANK_WRITERS, RecordRefused, SignedStore, decode_record, encode_record
from trainer.agent.vacancy import VACANCIES_KEY, VACANCY_KEY, Vacancy, VacancyRendezvous, publish_vacancy
from trainer.reference.rendezvous import (CONTROL_POST, CONTROL_PROBE, PostAborted, PostRefused, abort_key, arrive_key,
                                await_arrivals, newest_post, newest_post_and_probe, post_key, read_post, read_probe,
                                write_post)

GARBAGE = [b"", b"\xff\xfe", b"1", b"null", b"[" * 100_000, b'{"body": 1}', b'{"body": 1, "signature": 7}',
           b'{"body": 1, "signature": "executor:\xc3\xa9"}', b'{"body": 1, "signature": "executor:00"}',
           b'{"body": {"post": 1}, "signature": "console:' + b"ab" * 32 + b'"}', b"9" * 5000,
           json.dumps({"body": float("nan"), "signature": "rank:zz"}).encode()]


def stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    """The job's store (its server) and a stranger's client of it."""
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    stranger = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    return host, stranger


def records(store: dist.Store, scope: str, reports: list[ControlRejected], reader: str = "test") -> SignedStore:
    return SignedStore(store, scope, reader=reader, report=reports.append)


def test_a_record_verifies_only_under_its_own_key_and_scope() -> None:
    ring = SignedStore(dist.HashStore(), "run-a", reader="t").keyring
    raw = encode_record(ring, "resihp/lost/3", "run-a", {"exitcode": 1})
    assert decode_record(ring, "resihp/lost/3", "run-a", raw) == {"exitcode": 1}
    with pytest.raises(RecordRefused, match="does not verify"):
        decode_record(ring, "resihp/lost/4", "run-a", raw)  # moved to another rank's key
    with pytest.raises(RecordRefused, match="does not verify"):
        decode_record(ring, "resihp/lost/3", "run-b", raw)  # replayed into another run
    for junk in GARBAGE:
        with pytest.raises(RecordRefused):
            decode_record(ring, "resihp/lost/3", "run-a", junk)


def test_a_strangers_plan_post_is_refused_reported_and_the_ranks_keep_the_launchers() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    launcher = records(host, "run-1", reports, "trainer")
    rank = records(host, "run-1", reports, "rank-0")
    p0 = Plan.uniform(tp=1, pp=1, dp=2, num_layers=4, microbatches_per_replica=2)
    write_post(launcher, 0, p0, (0, 1))
    one_replica = Plan.uniform(tp=1, pp=1, dp=1, num_layers=4, microbatches_per_replica=4, epoch=1)
    stranger.set(post_key(1), json.dumps({"epoch": 1, "plan": one_replica.model_dump(mode="json"), "world": [0]}))
    stranger.set(CONTROL_POST, json.dumps({"newest": 1}))
    assert newest_post(rank, known=0) == 0  # the forged pointer announces nothing
    assert newest_post_and_probe(rank, 0, 0) == (0, 0)
    with pytest.raises(PostRefused, match="post 1"):
        read_post(rank, 1)
    assert read_post(rank, 0).plan == p0
    # A post signed for another run (or copied to another number) is refused just the same.
    other_run = records(host, "run-0", [], "trainer")
    other_run.set(post_key(1), {"epoch": 1, "plan": one_replica.model_dump(mode="json"), "world": [0]})
    with pytest.raises(PostRefused):
        read_post(rank, 1)
    assert {r.source for r in reports} == {f"store:{post_key(1)}", f"store:{CONTROL_POST}"}
    assert all(r.kind == "store.record" and r.reader == "rank-0" for r in reports)


def test_a_strangers_abort_arrival_and_probe_are_refused() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    rank = records(host, "run-1", reports, "rank-0")
    stranger.set(abort_key(1), "stop")
    stranger.set(arrive_key(1, 1), "1")
    stranger.set("probe/1", ProbeRequest(probe_id="x", ranks=[0], repeats=16).model_dump_json())
    stranger.set(CONTROL_PROBE, "1")
    with pytest.raises(TimeoutError, match=r"devices \[1\]"):  # neither the abort nor 1's arrival counts
        await_arrivals(rank, 1, (0, 1), device=0, timeout_s=0.2)
    assert read_probe(rank, 1) is None and newest_post_and_probe(rank, 0, 0)[1] == 0
    records(host, "run-1", [], "trainer").set(abort_key(1), "device 1 died")
    with pytest.raises(PostAborted, match="device 1 died"):
        await_arrivals(rank, 1, (0, 1), device=0, timeout_s=5)
    assert len(reports) >= 3


def test_a_strangers_lost_mark_does_not_shrink_the_world() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    agent = records(host, "round-1", reports, "agent")
    world = ShrinkingWorld(host, (0, 1), 0, timeout_s=0.3, joining=True,
                           records=records(host, "round-1", reports, "rank-0"))
    stranger.set(lost_key(1), json.dumps({"exitcode": 1}))
    stranger.add("resihp/lost-count", 1)
    assert not is_lost(world.records, 1)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] neither joined"):
        world.close(world.detect("all_reduce", 0.0), step=3)
    assert [r.source for r in reports] == [f"store:{lost_key(1)}"]
    mark_lost(agent, 1, 1)  # the agent's own mark: the world goes on without rank 1
    rec = world.detect("all_reduce", 0.0)
    world.close(rec, step=3)
    assert (rec.world, rec.lost) == ((0,), (1,))


def test_a_strangers_request_to_rejoin_is_not_admitted() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    world = ShrinkingWorld(host, (0,), 0, timeout_s=5, records=records(host, "round-1", reports, "rank-0"))
    world.everyone = (0, 1)  # rank 1 was lost; a stranger asks in its name, to be handed the state
    stranger.set("resihp/rejoin/1", json.dumps({"step": 0}))
    stranger.add("resihp/rejoin-count", 1)
    weights = torch.ones(2)
    step = world.admit(4, state=lambda: {"w": weights}, load=lambda s: None)
    assert step == 4 and world.world == (0,) and not host.check([admitted_key(1)])
    assert [r.source for r in reports] == ["store:resihp/rejoin/1"]
    world.finish()
    assert world.records.valid("resihp/done", RANK_WRITERS)


def test_a_strangers_registration_names_no_ranks_to_mark_lost() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    presence = AgentPresence(records(host, "round-1", reports, "agent-0"), 0, 2, (0, 1), "127.0.0.1")
    trap = socket.create_server(("127.0.0.1", 0))
    stranger.set(REGISTRATION_KEY.format(group_rank=1), json.dumps(
        {"address": "127.0.0.1", "port": trap.getsockname()[1], "ranks": [0, 1], "token": "stranger"}))
    assert presence.poll() == []
    trap.close()  # the stranger hangs up: an agent that had connected would report its ranks lost
    assert presence.poll() == [] and presence.watched == {}
    assert [r.source for r in reports] == [f"store:{REGISTRATION_KEY.format(group_rank=1)}"]
    presence.close(finished=True)


def test_a_strangers_vacancy_is_not_a_place_and_the_signed_one_is() -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    stranger.add(VACANCIES_KEY, 1)
    stranger.set(VACANCY_KEY.format(n=1), json.dumps({
        "group_rank": 1, "group_world_size": 2, "ranks": [2, 3], "round_prefix": "torch.rendezvous.job.0",
        "master_addr": "10.6.6.6", "master_port": 6666}))
    stranger.add(VACANCIES_KEY, 1)  # counted, never written
    real = Vacancy(1, 2, (2, 3), "torch.rendezvous.job.0", "127.0.0.1", 29500)
    publish_vacancy(records(host, "job", [], "agent-0"), real)
    handler = VacancyRendezvous(host, "job", 2, timeout_s=5, records=records(host, "job", reports, "replacement"))
    info = handler.next_rendezvous()
    assert handler.taken == real and info.bootstrap_store_info is not None
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert [r.source for r in reports] == [f"store:{VACANCY_KEY.format(n=1)}"]


@pytest.mark.parametrize("junk", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_in_every_key_gives_a_refusal_never_an_exception(junk: bytes) -> None:
    host, stranger = stores()
    reports: list[ControlRejected] = []
    rank = records(host, "run-1", reports, "rank-0")
    keys = [post_key(0), CONTROL_POST, CONTROL_PROBE, "probe/1", abort_key(1), arrive_key(1, 1), lost_key(0),
            lost_key(1), admitted_key(1), "resihp/rejoin/1", "resihp/done", "resihp/world/1/members",
            REGISTRATION_KEY.format(group_rank=1), VACANCY_KEY.format(n=1)]
    for key in keys:
        stranger.set(key, junk)  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
    stranger.add(VACANCIES_KEY, 1)
    assert newest_post_and_probe(rank, 2, 3) == (2, 3) and newest_post(rank, 2) == 2
    assert read_probe(rank, 1) is None
    with pytest.raises(PostRefused):
        read_post(rank, 0)
    with pytest.raises(TimeoutError):
        await_arrivals(rank, 1, (0, 1), device=0, timeout_s=0.05)
    assert not is_lost(rank, 0) and not is_lost(rank, 1)
    presence = AgentPresence(records(host, "run-1", reports, "agent-0"), 0, 2, (0,), "127.0.0.1")
    assert presence.poll() == []
    presence.close(finished=True)
    handler = VacancyRendezvous(host, "run-1", 2, timeout_s=0.1, records=rank)
    with pytest.raises(RendezvousTimeoutError, match="left a place"):
        handler.next_rendezvous()
    assert len(reports) >= 6 and all(r.reason for r in reports)
