"""A torchtitan rank's step clock: host time on CPU; on a GPU, events read once a step and placed on
the host's scale. The events here are a stand-in with a device timeline of its own (this machine
has no GPU); the arithmetic and the one wait a step are what is checked."""

from __future__ import annotations

import time

import pytest

from trainer.torchtitan.clock import StepClock


class _Device:
    """A device timeline: ``now`` is where queued work has got to, in seconds."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[_Event] = []


class _Event:
    device: _Device

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "events that are read need timing enabled"
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.device.now

    def synchronize(self) -> None:
        self.device.waits.append(self)

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event says


def test_on_cpu_a_mark_is_the_host_clock_and_settling_waits_for_nothing() -> None:
    clock = StepClock()
    clock.begin()
    before = time.perf_counter()
    mark = clock.mark()
    clock.settle()
    assert not clock.device_events and isinstance(mark, float)
    assert before <= clock.seconds(mark) <= time.perf_counter()


def test_device_marks_are_read_once_a_step_on_the_hosts_scale() -> None:
    device = _Device()
    _Event.device = device
    clock = StepClock(_Event)
    clock.begin()
    base_host = clock._base_host
    device.now += 0.25  # a forward of 250 ms queued after the step began
    forward_end = clock.mark()
    device.now += 0.5
    backward_end = clock.mark()
    assert device.waits == []  # marking never waits for the device
    clock.settle()
    assert device.waits == [backward_end]  # one wait, for the step's last mark
    assert clock.seconds(forward_end) == pytest.approx(base_host + 0.25)
    assert clock.seconds(backward_end) - clock.seconds(forward_end) == pytest.approx(0.5)


def test_a_device_mark_read_outside_a_step_is_refused() -> None:
    _Event.device = _Device()
    clock = StepClock(_Event)
    mark = clock.mark()
    with pytest.raises(RuntimeError, match="outside a step"):
        clock.seconds(mark)


def test_the_clock_uses_events_only_on_a_cuda_device() -> None:
    assert not StepClock.for_device("cpu").device_events
    import torch

    assert StepClock.for_device(torch.device("cuda")).device_events == torch.cuda.is_available()


class _Stage:
    """What a schedule calls on a ``PipelineStage`` once per micro-batch; each chunk queues work."""

    def __init__(self, device: _Device) -> None:
        self.device = device

    def forward_one_chunk(self, chunk_id: int) -> None:
        self.device.now += 0.1 * (chunk_id + 1)

    def backward_one_chunk(self, chunk_id: int) -> None:
        self.device.now += 0.3


def test_a_pipeline_stages_chunks_are_marked_on_the_step_clock_and_read_when_the_iteration_ends() -> None:
    import torch

    from collector.events import ChunkKind
    from trainer.data import MicroBatch
    from trainer.native.telemetry import ScheduleWatcher

    device = _Device()
    _Event.device = device
    clock = StepClock(_Event)
    stage = _Stage(device)
    watcher = ScheduleWatcher(stage, clock)  # type: ignore[arg-type]  # the schedule's side of a stage
    tokens = torch.arange(8)
    mbs = [MicroBatch(iteration=1, index=i, tokens=tokens, targets=tokens, positions=tokens, seq_lens=[8])
           for i in range(2)]
    rec = watcher.begin(mbs)
    clock.begin()
    for i in range(2):
        stage.forward_one_chunk(i)
    for i in range(2):
        stage.backward_one_chunk(i)
    assert rec.chunks == [] and device.waits == []  # marked, not read: no wait at any boundary
    watcher.end()
    assert len(device.waits) == 1  # one wait an iteration
    got = [(c.kind, c.microbatch, round(c.duration_s, 6)) for c in rec.chunks]
    assert got == [(ChunkKind.FORWARD, 0, 0.1), (ChunkKind.FORWARD, 1, 0.2), (ChunkKind.BACKWARD, 0, 0.3),
                   (ChunkKind.BACKWARD, 1, 0.3)]
    starts = [c.start_s for c in rec.chunks]
    assert starts == sorted(starts) and starts[1] - starts[0] == pytest.approx(0.1)  # the device's timeline
