"""Fail-stop in a torchtitan job, the agent's judgement: which device is lost, which rank ended a
round, and the layout the job restarts at without it (trainer/torchtitan/recovery.py, layout.py's
``fallback_layout``, trainer/agent/pcontext.py's ``RankWatch.culprits``). Pure logic; the run
itself is tests/test_torchtitan_failstop.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.agent.pcontext import RankWatch
from trainer.torchtitan.layout import TitanLayout, fallback_layout
from trainer.torchtitan.recovery import LostDevices


def test_a_device_is_lost_when_its_rank_ends_two_rounds_in_a_row() -> None:
    devices = LostDevices()
    assert devices.failed([3]) == set()  # one crash: restart at the same layout
    assert devices.failed([3]) == {3}
    assert devices.healthy([0, 1, 2, 3]) == [0, 1, 2]
    assert devices.failed([3]) == set()  # judged once


def test_a_failure_elsewhere_between_two_crashes_clears_the_count() -> None:
    devices = LostDevices()
    assert devices.failed([3]) == set()
    assert devices.failed([1]) == set()
    assert devices.failed([3]) == set()
    assert devices.failed([3, 1]) == {3}
    assert devices.lost == {3}


def test_lost_devices_needs_one_strike_at_least() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        LostDevices(strikes=0)


def test_a_data_parallel_job_keeps_its_batch_kind_and_global_batch() -> None:
    # 4 replicas, 4 micro-batches: three devices left cannot split 4 evenly, two can
    assert fallback_layout(TitanLayout(dp_replicate=4), 3, 4, 6) == TitanLayout(dp_replicate=2)
    assert fallback_layout(TitanLayout(dp_shard=4), 3, 4, 6) == TitanLayout(dp_shard=2)


def test_enough_micro_batches_make_a_pipeline_over_the_devices_left_worth_it() -> None:
    # 8 micro-batches on 3 devices: PP 3 runs a step in (8 + 2) / 3 slots, 2 replicas in 4
    assert fallback_layout(TitanLayout(dp_replicate=4), 3, 8, 6) == TitanLayout(pp=3)


def test_ties_keep_the_running_tp_degree() -> None:
    assert fallback_layout(TitanLayout(tp=2, dp_shard=2), 3, 4, 6) == TitanLayout(tp=2)


def test_no_layout_when_no_device_is_left() -> None:
    assert fallback_layout(TitanLayout(dp_shard=2), 0, 4, 6) is None


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 4), dp=st.integers(1, 4), tp=st.sampled_from([1, 2, 4]), per_replica=st.integers(1, 8),
       healthy=st.integers(1, 16), layers=st.integers(1, 8))
def test_a_fallback_layout_always_fits_and_keeps_the_global_batch(pp: int, dp: int, tp: int, per_replica: int,
                                                                    healthy: int, layers: int) -> None:
    running = TitanLayout(pp=min(pp, layers), dp_shard=dp, tp=tp)
    m = per_replica * dp
    layout = fallback_layout(running, healthy, m, layers)
    assert layout is not None  # one device and no pipeline always fits
    assert layout.world <= healthy and running.tp % layout.tp == 0 and layout.pp <= layers
    assert m % layout.batch == 0 and m // layout.batch >= layout.pp


class _Ranks(RankWatch):
    """A watch over ranks that exit with the codes given (no processes)."""

    def __init__(self, codes: dict[int, int | None]) -> None:
        self.nprocs, self.codes = len(codes), codes
        self.error_files = {lr: "" for lr in codes}
        self.stdouts = self.stderrs = {}
        self._init_watch(release_failed=False)

    def exit_code(self, local_rank: int) -> int | None:
        return self.codes[local_rank]

    def rank_pid(self, local_rank: int) -> int:
        return 1000 + local_rank

    def close(self, death_sig: object = None, timeout: int = 30) -> None:
        for lr, code in self.codes.items():
            if code is None:
                self.codes[lr] = -15  # what the close's SIGTERM leaves


def test_the_culprit_is_the_rank_that_died_not_the_peers_the_close_stopped() -> None:
    ranks = _Ranks({0: None, 1: None, 2: None, 3: -9})
    result = ranks._poll()
    assert result is not None and sorted(result.failures) == [0, 1, 2, 3]
    assert ranks.culprits() == [3]


def test_a_signalled_rank_is_the_culprit_over_peers_that_raised_in_the_same_pass() -> None:
    ranks = _Ranks({0: 1, 1: None, 2: -9, 3: 1})
    ranks._poll()
    assert ranks.culprits() == [2]


def test_ranks_that_raised_are_the_culprits_when_none_was_signalled() -> None:
    ranks = _Ranks({0: None, 1: 1, 2: None, 3: None})
    ranks._poll()
    assert ranks.culprits() == [1]
