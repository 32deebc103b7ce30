"""A wait for the GPU has a deadline, and may ask its peers as it waits (``wait_event``'s ``watch``): point-to-point
receivers push nothing back to a sender that failed before sending, so the wait for a wave asks about once a second
whether it withheld the version; what the question raises aborts the group and fails the transfer now, not at the
deadline."""

from __future__ import annotations

import time

import pytest
import torch

from awex.transport import deadline
from awex.transport.base import TransferError
from awex.transport.deadline import wait_event
from awex.transport.p2p import delta
from awex.transport.p2p.waves import WaveExecutor, _Wave


class Event:
    """A CUDA event's ``query`` that completes after ``done_after`` polls."""

    def __init__(self, done_after: int):
        self.polls, self.done_after = 0, done_after

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.done_after


def test_waiting_on_the_gpu_has_a_deadline():
    done = Event(3)
    wait_event(done, time.monotonic() + 5, lambda: AssertionError("must not time out"))
    assert done.polls == 4
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="late"):
        wait_event(Event(10**9), started + 0.05, lambda: TimeoutError("late"))
    assert 0.05 <= time.monotonic() - started < 2


def test_a_watch_runs_every_so_often_while_the_event_is_pending_and_what_it_raises_ends_the_wait():
    looks: list[float] = []

    def watch():
        looks.append(time.monotonic())
        if len(looks) == 3:
            raise RuntimeError("the sender withheld it")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="withheld"):
        wait_event(Event(10**9), started + 30, lambda: AssertionError("not the deadline"), watch=watch, every=0.02)
    assert len(looks) == 3 and looks[0] - started >= 0.02  # not at once: the first look after one slice
    assert time.monotonic() - started < 5  # not the 30-s deadline
    quick = Event(3)  # done before a slice passed: never asked
    wait_event(quick, time.monotonic() + 5, lambda: AssertionError("not the deadline"), watch=watch, every=10)
    assert quick.polls == 4 and len(looks) == 3


class _Group:
    backend = "nccl"

    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def test_a_wave_whose_watch_raises_aborts_the_group_and_fails_naming_the_wave():
    executor = object.__new__(WaveExecutor)  # only what waiting for a wave reads
    executor.rank, executor.group = 5, _Group()
    wave = _Wave(7, [], [(2, None, 1024)], [], [])

    def withheld():
        raise TransferError("sender trainer:2 withheld it")

    with pytest.raises(TransferError, match=r"rank 5: wave 7 \(1024 bytes with rank\(s\) \[2\]\): .*withheld it; the"):
        executor._wait(Event(10**9), wave, time.monotonic() + 30, 30.0, withheld, every=0.01)
    assert executor.group.aborted == 1  # its kernels end with the group
    calm = object.__new__(WaveExecutor)
    calm.rank, calm.group = 5, _Group()
    calm._wait(Event(5), wave, time.monotonic() + 30, 30.0, lambda: None, every=0.0)
    assert calm.group.aborted == 0


class _Work:
    def wait(self, *args):
        pass


class _DeltaGroup(_Group):
    def exchange(self, sends, recvs):
        return [_Work() for _ in (*sends, *recvs)]

    def error(self):
        return None


class _Api:
    """``torch.cuda``'s part a delta operation's wait uses: its events complete after ``done_after`` polls."""

    def __init__(self, done_after: int):
        self.done_after = done_after

    def Event(self):  # noqa: N802 - torch.cuda.Event
        event = Event(self.done_after)
        event.record = lambda stream: None
        return event

    def current_stream(self, device):
        return None


def _delta(monkeypatch, done_after: int, watch):
    monkeypatch.setattr(delta, "is_accelerator", lambda device: True)
    monkeypatch.setattr(delta, "device_api", lambda device: _Api(done_after))
    executor = object.__new__(delta.DeltaExecutor)  # only what one operation reads
    executor.rank, executor.group, executor.device = 3, _DeltaGroup(), torch.device("cpu")
    executor._timeout, executor._watch = 30.0, watch
    return executor


def test_a_delta_operation_on_a_gpu_is_waited_for_and_a_peer_that_failed_ends_it(monkeypatch):
    """Delta syncs over NCCL read each header, answer and checksum on the host: a receive that never completes would
    hold that read without a deadline. Each operation is waited for as a wave is, watched: a peer that withheld the
    version aborts the group and fails the bucket now, not at the deadline."""

    def withheld():
        raise TransferError("sender trainer:0 withheld it")

    stuck = _delta(monkeypatch, 10**9, withheld)
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"rank 3: delta bucket 4: recv from rank 0: .*withheld it; the sync group"):
        stuck._landed("rank 3: delta bucket 4: recv from rank 0", started + 30, every=0.01)
    assert stuck.group.aborted == 1 and time.monotonic() - started < 5
    slept: list[float] = []
    calm = _delta(monkeypatch, 5, lambda: None)  # done in a few polls: the operation goes on, the group stays
    now = time.monotonic()
    with pytest.MonkeyPatch.context() as m:  # a clock that stands still: no preemption of a loaded machine counts
        m.setattr(deadline.time, "sleep", slept.append)
        m.setattr(deadline.time, "monotonic", lambda: now)
        calm._one("recv", torch.zeros(2), 0, 4, now + 30)
    assert calm.group.aborted == 0
    assert slept == []  # polled without sleeping at first: a sleep overshoots by tens of us, once per operation
    late = _delta(monkeypatch, 10**9, None)  # no watch: the deadline, and the group aborted too
    with pytest.raises(TimeoutError, match="delta bucket 4: send to rank 1: not done within the sync's 30 s"):
        late._one("send", torch.zeros(2), 1, 4, time.monotonic() + 0.05)
    assert late.group.aborted == 1
