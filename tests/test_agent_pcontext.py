"""The agent's process contexts (trainer/agent/pcontext.py) on real processes forked from the fork
server: each rank is watched on its own, a released failure leaves its peers running, and
without release the first failure stops the rest, as torch's contexts do."""

from __future__ import annotations

import pytest
import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

from tests.test_agent_run import alive, wait_until
from trainer.agent.pcontext import PreloadedContext

pytestmark = pytest.mark.processes  # tests/fixtures/tiers.py


def _rank(out_dir: str, seconds: str) -> None:
    """A rank: note its RANK and its process group, then sleep."""
    Path(out_dir, os.environ["RANK"]).write_text(f"{os.getpgid(0)}")
    time.sleep(float(seconds))


# A process has one fork server, and the first context to start it decides what it imports: this
# one starts it in the test run, so it preloads what the trainer's and the native executor's
# launches in the same run fork their ranks from (else each of their ranks imports them again).
SERVER_PRELOAD = ["trainer.reference.worker", "trainer.native.worker", "tests.test_agent_pcontext"]


def _context(tmp_path: Path, seconds: float, release_failed: bool) -> PreloadedContext:
    envs = {lr: {"RANK": str(lr), "TORCHELASTIC_RUN_ID": "pcontext-test"} for lr in range(3)}
    args = {lr: (str(tmp_path), str(seconds)) for lr in range(3)}
    context = PreloadedContext("test", _rank, args, envs, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
                               preload=SERVER_PRELOAD, release_failed=release_failed)
    context.start()
    wait_until(lambda: all((tmp_path / str(lr)).exists() for lr in range(3)))
    return context


def test_a_released_failure_leaves_its_peers_running_until_the_close(tmp_path: Path) -> None:
    context = _context(tmp_path, 600, release_failed=True)
    pids = context.pids()
    try:
        assert {int((tmp_path / str(lr)).read_text()) for lr in range(3)} == set(pids.values())  # own groups
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: context.exit_code(1) is not None)
        assert context._poll() is None  # the others still run: nothing to report
        released = context.take_released()
        assert list(released) == [1] and released[1].exitcode == -signal.SIGKILL and released[1].pid == pids[1]
        assert context.take_released() == {}
        assert alive([pids[0], pids[2]]) == [pids[0], pids[2]] and context.pids() == pids
    finally:
        context.close(signal.SIGTERM, timeout=5)
    assert context.exit_codes() == {0: -signal.SIGTERM, 1: -signal.SIGKILL, 2: -signal.SIGTERM}
    assert alive(list(pids.values())) == []


def test_without_release_the_first_failure_stops_the_rest(tmp_path: Path) -> None:
    context = _context(tmp_path, 600, release_failed=False)
    pids = context.pids()
    try:
        os.kill(pids[2], signal.SIGKILL)
        wait_until(lambda: context.exit_code(2) is not None)
        result = context._poll()
    finally:
        context.close(signal.SIGKILL, timeout=5)
    assert result is not None and result.failures[2].exitcode == -signal.SIGKILL
    assert {lr: f.exitcode for lr, f in result.failures.items()} == {0: -signal.SIGTERM, 1: -signal.SIGTERM,
                                                                     2: -signal.SIGKILL}
    assert alive(list(pids.values())) == []


def test_ranks_that_all_succeed_end_the_context_with_no_failure(tmp_path: Path) -> None:
    context = _context(tmp_path, 0, release_failed=True)
    results = []
    try:
        def finished() -> bool:
            results.append(context._poll())
            return bool(results[-1])

        wait_until(finished)
        result = results[-1]
    finally:
        context.close()
    assert result is not None and not result.is_failed() and result.return_values == {0: None, 1: None, 2: None}
    assert context.exit_codes() == {0: 0, 1: 0, 2: 0}
