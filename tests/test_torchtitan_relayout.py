"""The torchtitan executor in each node agent, on a real (in-process) store: what every node starts
after a leader's order, how a round of another size is laid out, and which plans the leader
refuses across nodes (trainer/torchtitan/controller.py). The processes are
tests/test_torchtitan_nodes.py's; this is the agent's logic alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from trainer.agent.relayout import (GROW_COMMAND, JOINED_KEY, NODE_KEY, ORDER_KEY, SHAPE_KEY, STOP_KEY, STOPPED_KEY,
                                    NodeRecord, RelayoutOrder, StopOrder)
from trainer.agent.signed_store import SignedStore
from trainer.torchtitan.controller import JobRecord, TitanRelayout
from trainer.torchtitan.layout import JOB_KEY, JobShape, TitanLayout, plan_of

FLAGS = ["--module", "trainer.torchtitan", "--parallelism.data_parallel_replicate_degree", "3",
         "--training.local_batch_size", "1", "--training.global_batch_size", "6"]


def _store() -> SignedStore:
    return SignedStore(dist.HashStore(), "round-1", reader="test")


def _shape(layout: TitanLayout, devices: Sequence[int], epoch: int = 0) -> JobShape:
    return JobShape(layout=layout, devices=tuple(devices), epoch=epoch, num_layers=6, microbatches=2,
                    samples_per_microbatch=1, tokens_per_microbatch=256, layer_state_bytes=1000, model="llama3 debug")


class _Relaunches:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[str]]] = []

    def __call__(self, world: int, edit: Callable[[Sequence[str]], list[str]]) -> None:
        self.calls.append((world, edit(FLAGS)))


def _follower(records: SignedStore, node_ranks: Sequence[int], world: int) -> TitanRelayout:
    """Node 1's executor after its first round, having read the world's shape."""
    relayout = TitanRelayout("job", lambda: None, None)
    assert relayout.start_round(1, 2, node_ranks, world, records) is None  # the first round runs as started
    records.set(JOB_KEY, _shape(TitanLayout(dp_replicate=world), range(world)).to_json())
    relayout.watch(records, False, None, _Relaunches())
    assert relayout.shape is not None and not relayout.leader
    return relayout


def _value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_every_node_starts_its_own_devices_of_the_order_once_the_world_stopped() -> None:
    records = _store()
    relayout = _follower(records, [1, 2], 3)
    order = RelayoutOrder(1, "c1", (0, 1), ("--parallelism.data_parallel_replicate_degree", "2"))
    records.set(ORDER_KEY, order.to_json())
    relaunch = _Relaunches()
    assert relayout.watch(records, False, None, relaunch) is False and not relaunch.calls  # ranks still running
    # this node's ranks exited before rank 0 wrote the stop mark: held, not finished
    assert relayout.watch(records, True, None, relaunch) is True and not relaunch.calls
    records.set(STOPPED_KEY, {"epoch": 1, "step": 4})
    assert relayout.watch(records, True, None, relaunch) is True
    (world, flags), = relaunch.calls
    assert world == 1 and _value(flags, "--parallelism.data_parallel_replicate_degree") == "2"
    env = relayout.worker_env()
    # device 1 is this node's first device: the rank sees it as its GPU 0
    assert env["RESIHP_DEVICES"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0" and env["RESIHP_PLAN_EPOCH"] == "1"
    # the new round is the order's world: nothing to lay out again
    assert relayout.start_round(1, 2, [1], 2, _store()) is None
    assert relayout.identity(1) == (1, 1)


def test_a_membership_restart_after_the_stop_starts_the_orders_share_and_before_it_does_not() -> None:
    records = _store()
    relayout = _follower(records, [1, 2], 3)
    records.set(ORDER_KEY, RelayoutOrder(1, "c1", (0, 2), ()).to_json())
    relaunch = _Relaunches()
    assert relayout.restart_for_order(records, relaunch) is False and not relaunch.calls  # no stop mark: torch's
    records.set(STOPPED_KEY, {"epoch": 1, "step": 4})
    assert relayout.restart_for_order(records, relaunch) is True and relaunch.calls[0][0] == 1
    assert relayout.worker_env()["RESIHP_DEVICES"] == "2"


def test_a_stale_order_is_not_obeyed() -> None:
    records = _store()
    relayout = _follower(records, [1, 2], 3)
    records.set(ORDER_KEY, RelayoutOrder(1, "c1", (0, 1), ()).to_json())
    records.set(STOPPED_KEY, {"epoch": 1, "step": 4})
    relayout.epoch = 1  # the world already runs epoch 1
    relaunch = _Relaunches()
    assert relayout.watch(records, True, None, relaunch) is False and not relaunch.calls


def test_an_order_whose_flags_change_more_than_the_layout_is_refused_not_obeyed() -> None:
    records = _store()
    relayout = _follower(records, [1, 2], 3)
    records.set(ORDER_KEY, RelayoutOrder(1, "c1", (0, 1), ("--dump_folder", "/elsewhere")).to_json())
    records.set(STOPPED_KEY, {"epoch": 1, "step": 4})
    relaunch = _Relaunches()
    # the ranks stopped all the same: this node restarts its share at the running layout, not the order's
    assert relayout.watch(records, True, None, relaunch) is True and relaunch.calls == [(2, FLAGS)]
    assert any("not a layout flag" in reason for reason in records.refused.values()), records.refused


def test_a_round_of_another_size_is_laid_out_alike_on_every_node() -> None:
    """Node 1 is gone: the round has node 0's one rank, and its agent restarts it at one replica,
    the global batch of six micro-batches kept by accumulation; had node 0 gone, node 1's agent
    would lay its two ranks out by the same rule from the same shape."""
    edits = []
    for node, ranks in ((0, [0]), (1, [1, 2])):
        records = _store()
        relayout = TitanRelayout("job", lambda: None, None)
        relayout.start_round(node, 2, ranks, 3, records)
        relayout.shape = _shape(TitanLayout(dp_replicate=3), [0, 1, 2])
        edit = relayout.start_round(0, 1, range(len(ranks)), len(ranks), records)  # this node alone
        assert edit is not None and relayout.epoch == 1 and relayout.recovery is not None
        edits.append(edit(FLAGS))
    one, two = edits
    assert _value(one, "--parallelism.data_parallel_replicate_degree") == "1"
    assert _value(one, "--training.global_batch_size") == "6" and _value(one, "--training.local_batch_size") == "1"
    assert _value(two, "--parallelism.data_parallel_replicate_degree") == "2"  # a two-rank round: two replicas
    assert _value(two, "--training.global_batch_size") == "6"


def test_a_round_no_uniform_layout_fits_starts_at_the_old_flags() -> None:
    records = _store()
    relayout = TitanRelayout("job", lambda: None, None)
    relayout.start_round(0, 2, [0, 1], 4, records)
    relayout.shape = JobShape(layout=TitanLayout(dp_replicate=4), devices=(0, 1, 2, 3), epoch=0, num_layers=1,
                              microbatches=1, samples_per_microbatch=1, tokens_per_microbatch=256,
                              layer_state_bytes=1, model="")
    # three ranks, four micro-batches, one layer: no replica count divides them and no pipeline fits
    assert relayout.start_round(0, 2, [0, 1], 3, records) is None and relayout.epoch == 0


def _leader(min_nodes: int, node_1_hosts: bool = False) -> TitanRelayout:
    """Node 0's executor in a round of two nodes: node 0 has device 0, node 1 devices 1 and 2."""
    records = _store()
    relayout = TitanRelayout("job", lambda: None, None, min_nodes=min_nodes)
    relayout.start_round(0, 2, [0], 3, records)
    records.set(NODE_KEY.format(group_rank=1), NodeRecord((1, 2), node_1_hosts).to_json())
    relayout.shape, relayout._records = _shape(TitanLayout(dp_replicate=3), [0, 1, 2]), records
    return relayout


def test_the_leader_leaves_a_node_out_only_where_the_rendezvous_lets_the_job_go_on_without_it() -> None:
    keeps_both = plan_of(TitanLayout(dp_replicate=2), [0, 1], 6, 3, 1)
    leaves_node_1 = plan_of(TitanLayout(dp_replicate=1), [0], 6, 6, 1)
    elsewhere = plan_of(TitanLayout(dp_replicate=2), [0, 7], 6, 3, 1)
    assert _leader(min_nodes=2)._refusal(keeps_both) is None
    assert "leaves node(s) [1] with no rank, and the job runs on at least 2 node(s)" in (
        _leader(min_nodes=2)._refusal(leaves_node_1) or "")
    assert _leader(min_nodes=1)._refusal(leaves_node_1) is None  # --nnodes 1:2
    assert "node 1 serves the job's rendezvous" in (_leader(1, node_1_hosts=True)._refusal(leaves_node_1) or "")
    assert "devices [7] are on no node" in (_leader(min_nodes=1)._refusal(elsewhere) or "")


def test_a_node_an_order_runs_no_rank_on_leaves_the_job_once_the_world_stopped() -> None:
    records = _store()
    relayout = _follower(records, [1, 2], 3)
    records.set(ORDER_KEY, RelayoutOrder(1, "c1", (0,), ()).to_json())
    records.set(STOPPED_KEY, {"epoch": 1, "step": 4})
    relaunch = _Relaunches()
    assert relayout.watch(records, False, None, relaunch) is False and not relayout.left_out  # ranks still saving
    assert relayout.watch(records, True, None, relaunch) is True
    assert relayout.left_out and not relaunch.calls and relayout.epoch == 1


def test_orders_and_node_records_refuse_malformed_bodies() -> None:
    import pytest

    for body in ({}, {"epoch": 0, "command": "c", "devices": [0], "flags": []},
                 {"epoch": 1, "command": "c", "devices": [0, 0], "flags": []},
                 {"epoch": 1, "command": "c", "devices": [0], "flags": [1]},
                 {"epoch": 1, "command": "c", "devices": [], "flags": []}):
        with pytest.raises(ValueError):
            RelayoutOrder.parse(body)
    bad_records: list[object] = [None, {"devices": [-1]}, {"devices": "0"}, {"devices": [0], "hosts": "yes"}]
    for bad in bad_records:
        with pytest.raises(ValueError):
            NodeRecord.parse(bad)
    assert NodeRecord.parse({"devices": [3, 4]}) == NodeRecord((3, 4), False)


def _job_store() -> SignedStore:
    """The job's own store (it outlives rounds), signed for the job."""
    return SignedStore(dist.HashStore(), "job", reader="test")


def test_a_node_waiting_to_join_has_the_ranks_stop_at_a_step_boundary_before_the_restart() -> None:
    """torch would restart the healthy group at once (losing the steps since the last checkpoint):
    the leader writes a stop order with no new world, the ranks stop and save, and every node then
    restarts its share into the joiner's round, laid out for its size."""
    records = _store()
    leader = _leader(min_nodes=1)
    relaunch = _Relaunches()
    assert leader.make_room(records) is True and not relaunch.calls
    stop = records.get(STOP_KEY, StopOrder.parse)
    assert stop == StopOrder(1, GROW_COMMAND)
    assert leader.make_room(records) is True  # torch asks again on each pass: one stop order
    assert leader.watch(records, False, None, relaunch) is False and not relaunch.calls  # still stepping
    assert leader.watch(records, True, None, relaunch) is True and not relaunch.calls  # exited: held for the mark
    records.set(STOPPED_KEY, {"epoch": 1, "step": 5})
    assert leader.watch(records, True, None, relaunch) is True
    assert relaunch.calls == [(1, FLAGS)] and leader.epoch == 0  # this node's share, its flags as they are
    edit = leader.start_round(0, 3, [0], 4, _store())  # the joiner's round: four ranks
    assert edit is not None and leader.epoch == 1 and leader.recovery is not None
    assert "a node joined" in leader.recovery.what
    assert _value(edit(FLAGS), "--parallelism.data_parallel_replicate_degree") == "2"  # 4 ranks: 2 replicas × PP 2


def test_a_follower_restarts_after_a_grow_stop_even_if_torch_did_not_ask_it_first() -> None:
    records = _store()
    follower = _follower(records, [1, 2], 3)
    records.set(STOP_KEY, {"epoch": 1, "command": GROW_COMMAND})
    records.set(STOPPED_KEY, {"epoch": 1, "step": 5})
    relaunch = _Relaunches()
    assert follower.watch(records, True, None, relaunch) is True and relaunch.calls == [(2, FLAGS)]
    assert follower.make_room(_store()) is True  # a follower never writes the stop
    assert follower.watch(_store(), True, None, _Relaunches()) is False  # a job that simply finished


def test_a_joining_node_takes_new_devices_and_lays_the_round_out_as_the_others_do() -> None:
    job = _job_store()
    leader = _leader(min_nodes=1)
    leader.start_round(0, 2, [0], 3, _store(), job_records=job)
    assert leader.shape is not None
    leader._keep_record(leader.shape)  # what the leader does on reading each world's shape
    assert job.get(SHAPE_KEY, JobRecord.parse).high == 3
    leader.expected_world = -1  # restarted after a grow stop

    joiners = [TitanRelayout("job", lambda: None, None) for _ in range(2)]
    edits = [j.start_round(g, 4, [r], 5, _store(), job_records=job, round_number=3)
             for g, (j, r) in enumerate(zip(joiners, (3, 4)), start=2)]
    assert [j.node_devices for j in joiners] == [(3,), (4,)]  # above every device the job had, never shared
    mine = leader.start_round(0, 4, [0], 5, _store(), job_records=job, round_number=3)
    assert mine is not None and leader.node_devices == (0,)  # an old node keeps its devices
    assert {leader.epoch, *(j.epoch for j in joiners)} == {1}
    assert all(e is not None and e(FLAGS) == mine(FLAGS) for e in edits)  # the same layout on every node
    assert joiners[0].worker_env()["RESIHP_DEVICES"] == "3" and joiners[0].worker_env()["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_joiner_refuses_devices_a_changed_counter_would_give_it() -> None:
    import pytest

    job = _job_store()
    job.set(SHAPE_KEY, JobRecord(_shape(TitanLayout(dp_replicate=3), [0, 1, 2]), 3).to_json())
    job.store.add(JOINED_KEY.format(high=3), -5)  # a stranger who reached the store
    with pytest.raises(RuntimeError, match="changed by someone else"):
        TitanRelayout("job", lambda: None, None).start_round(1, 2, [1], 2, _store(), job_records=job, round_number=1)


def test_a_joiner_of_a_job_with_no_record_and_a_first_round_keep_their_ranks_as_devices() -> None:
    first = TitanRelayout("job", lambda: None, None)
    first.start_round(1, 2, [1, 2], 3, _store(), job_records=_job_store(), round_number=0)
    late = TitanRelayout("job", lambda: None, None)
    late.start_round(1, 2, [1, 2], 3, _store(), job_records=_job_store(), round_number=2)
    assert first.node_devices == late.node_devices == (1, 2)


def test_job_records_refuse_malformed_bodies() -> None:
    import pytest

    shape = _shape(TitanLayout(dp_replicate=3), [0, 1, 2]).to_json()
    for body in (None, {"shape": shape}, {"shape": shape, "high": -1}, {"shape": shape, "high": 2},
                 {"shape": {}, "high": 9}, {"shape": shape, "high": "9"}):
        with pytest.raises(ValueError):
            JobRecord.parse(body)
    assert JobRecord.parse({"shape": shape, "high": 7}).high == 7


def test_a_device_is_not_judged_lost_for_failures_another_nodes_loss_caused() -> None:
    """Each time a node dies its peers' ranks fail with it: two node losses in a row must not judge
    a survivor's device lost, while two failures in rounds of the same size still do."""
    for rounds_shrink, lost in ((True, set()), (False, {1})):
        records = _store()
        relayout = TitanRelayout("job", lambda: None, None)
        relayout.start_round(1, 3, [1], 3, records)
        relayout.shape = _shape(TitanLayout(dp_replicate=3), [0, 1, 2])
        relayout.watch(records, False, [1], _Relaunches())  # a node died; this node's rank failed with it
        relayout.start_round(1, 2 if rounds_shrink else 3, [1], 2 if rounds_shrink else 3, _store())
        relayout.watch(records, False, [1], _Relaunches())  # and again
        assert relayout.devices.lost == lost, rounds_shrink
