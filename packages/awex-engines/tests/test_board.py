"""The host board: a manifest under a sequence lock and per-rank version signals in shared memory, read by other
processes on the host; waits end at their deadline; the creator removes it."""

import multiprocessing as mp
import os
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from awex.engines.sync import board as board_module
from awex.engines.sync.board import BoardTimeout, HostBoard

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or not sys.platform.startswith("linux"), reason="the host board lives in /dev/shm"
)


def _signaller(path: str, slot: int, seq: int, detail: int, doc: dict) -> None:
    board = HostBoard.attach(path)
    time.sleep(0.05)
    board.ring(slot, seq, detail)
    if doc:
        board.post(doc)
    board.close()


def test_another_process_signals_and_posts_and_the_waiter_sees_it():
    board = HostBoard.create()
    try:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_signaller, args=(board.path, 7, 3, 42, {"version": "v3", "seq": 3}))
        p.start()
        assert board.wait([7], 3, timeout=30) == [42]
        assert board.manifest("v3", timeout=30) == {"version": "v3", "seq": 3}
        p.join(30)
        assert p.exitcode == 0
        assert board.wait([7], 2, timeout=0.01) == [42]  # later versions satisfy earlier waits
    finally:
        board.close()
    assert not os.path.exists(board.path)  # the creator removed it


def test_waits_end_at_their_deadline_naming_what_is_missing():
    board = HostBoard.create()
    try:
        board.ring(1, 5)
        started = time.monotonic()
        with pytest.raises(BoardTimeout, match=r"sync ranks \[2\] did not signal version 5"):
            board.wait([1, 2], 5, timeout=0.2)
        with pytest.raises(BoardTimeout, match="'v9' did not appear"):
            board.manifest("v9", timeout=0.2)
        assert time.monotonic() - started < 1.5
    finally:
        board.close()


def test_only_awex_boards_are_opened(tmp_path):
    other = tmp_path / "awex-board-fake"
    other.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="not an awex board"):
        HostBoard.attach(str(other))
    with pytest.raises(ValueError, match="not an awex board"):
        HostBoard.attach("/etc/hostname")
    board = HostBoard.create()
    try:
        with pytest.raises(ValueError, match="out of range"):
            board.ring(1 << 20, 1)
    finally:
        board.close()


def test_an_expected_signal_is_caught_without_sleeping_past_it():
    board = HostBoard.create()
    try:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_signaller, args=(board.path, 3, 1, 0, {}))  # rings after about 0.05 s
        p.start()
        assert board.wait([3], 1, timeout=30, expect=0.05) == [0]
        p.join(30)
        with pytest.raises(BoardTimeout):  # an expectation never shortens the deadline's wait, nor extends it
            board.wait([3], 2, timeout=0.1, expect=0.05)
    finally:
        board.close()


def _futex_waits(board) -> bool:
    return board._bell.available


@contextmanager
def _reader_and_writer():
    """A new board (the reader's mapping) and a second mapping of it (the writer's, as another process's), closed
    after; the test is skipped where there is no futex (the board polls: the other waits test that)."""
    board = HostBoard.create()
    writer = HostBoard.attach(board.path)
    try:
        if not _futex_waits(board):
            pytest.skip("no futex on this machine: the board polls (tested by the other waits)")
        yield board, writer
    finally:
        writer.close()
        board.close()


def _recording_naps(monkeypatch, board) -> list[str]:
    """What the board's sleeps on its bell do, in order: "asleep" as one begins, "awake" as it ends."""
    naps: list[str] = []
    real_wait = type(board._bell).wait

    def nap(self, *a):
        naps.append("asleep")
        real_wait(self, *a)
        naps.append("awake")

    monkeypatch.setattr(type(board._bell), "wait", nap)
    return naps


def test_a_reader_asleep_on_the_manifest_is_woken_by_the_post(monkeypatch):
    """A reader waiting long sleeps on the manifest's sequence word; the post wakes it. Each sleep may last 30 s here:
    without the post's wake the manifest would be seen only then."""
    monkeypatch.setattr(board_module, "NAP_SECONDS", 30.0)
    monkeypatch.setattr(board_module, "DOZE_AFTER_SECONDS", 0.01)
    with _reader_and_writer() as (board, writer):
        posted: list[float] = []

        def post_later():
            time.sleep(0.2)  # the reader is asleep by then (it polls for 0.01 s here)
            posted.append(time.monotonic())
            writer.post({"version": "v1", "seq": 1})

        thread = threading.Thread(target=post_later)
        thread.start()
        assert board.manifest("v1", timeout=60) == {"version": "v1", "seq": 1}
        woken = time.monotonic()
        thread.join(30)
        assert woken - posted[0] < 10.0  # a wake, not the end of a 30-s sleep


@pytest.mark.parametrize("doze_after", [0.0, 30.0])
def test_a_long_wait_for_the_manifest_sleeps_instead_of_polling(monkeypatch, doze_after):
    """Counted, not timed: past the polling window (0 s here) a 0.25-s wait for a manifest that does not come sleeps
    in about 25 naps of 10 ms (the deadline checked between) and never in a short sleep (polling with 20-us sleeps
    took thousands); within it (30 s here) it polls and never naps."""
    monkeypatch.setattr(board_module, "DOZE_AFTER_SECONDS", doze_after)
    board = HostBoard.create()
    try:
        if not _futex_waits(board):
            pytest.skip("no futex on this machine: the board polls (tested by the other waits)")
        naps, sleeps = [], []
        real_wait = type(board._bell).wait
        monkeypatch.setattr(type(board._bell), "wait", lambda self, *a: naps.append(a) or real_wait(self, *a))
        real_sleep = time.sleep
        monkeypatch.setattr(board_module.time, "sleep", lambda s: sleeps.append(s) or real_sleep(s))
        board.post({"version": "v0", "seq": 0})  # another version's manifest: read once, then slept on
        with pytest.raises(BoardTimeout):
            board.manifest("v1", timeout=0.25)
        if doze_after:
            assert sleeps and not naps
        else:
            assert not sleeps
            assert 1 <= len(naps) <= 0.25 / board_module.NAP_SECONDS + 5, len(naps)
            assert all(timeout <= board_module.NAP_SECONDS for _, timeout in naps)
    finally:
        board.close()


def test_a_heads_up_wakes_a_sleeping_reader_which_then_polls_without_sleeping(monkeypatch):
    """The writer's first rank rings the bell as a version begins: a reader asleep on it (each sleep 30 s here) wakes
    and polls without sleeping until the manifest comes; counted, not timed: after the heads-up it neither sleeps
    again on the bell nor in a short sleep."""
    monkeypatch.setattr(board_module, "DOZE_AFTER_SECONDS", 0.0)  # asleep at once
    monkeypatch.setattr(board_module, "NAP_SECONDS", 30.0)
    monkeypatch.setattr(board_module, "HEADS_UP_SPIN_SECONDS", 30.0)  # spins until the post
    with _reader_and_writer() as (board, writer):
        naps, sleeps, got = _recording_naps(monkeypatch, board), [], []
        real_sleep = time.sleep
        monkeypatch.setattr(board_module.time, "sleep", lambda s: sleeps.append(s) or real_sleep(s))
        reader = threading.Thread(target=lambda: got.append(board.manifest("v1", timeout=60)))
        reader.start()
        deadline = time.monotonic() + 10
        while naps != ["asleep"] and time.monotonic() < deadline:
            real_sleep(0.01)
        assert naps == ["asleep"]
        writer.heads_up()
        while naps != ["asleep", "awake"] and time.monotonic() < deadline:
            real_sleep(0.01)
        assert naps == ["asleep", "awake"]  # woken by the bell, not at the end of its 30-s sleep
        real_sleep(0.05)
        writer.post({"version": "v1", "seq": 1})
        reader.join(30)
        assert got == [{"version": "v1", "seq": 1}]
        assert naps == ["asleep", "awake"] and not sleeps  # it polled without sleeping from the bell to the post


class _Clock:
    """A monotonic clock that moves only when the board sleeps: each short sleep takes ``poll`` seconds (80 us on an
    idle host; milliseconds where the thread waits for the interpreter's lock), each futex nap its whole timeout."""

    def __init__(self, poll: float):
        self.now, self.poll, self.sleeps, self.naps = 1000.0, poll, 0, 0

    def monotonic(self) -> float:
        self.now += 1e-6  # each look at the clock costs a little
        return self.now

    def sleep(self, _seconds: float) -> None:
        self.sleeps += 1
        self.now += self.poll

    def nap(self, _expected: int, timeout: float) -> None:
        self.naps += 1
        self.now += timeout


@pytest.mark.parametrize("poll, dozes", [(80e-6, True), (5e-3, False)], ids=["idle-process", "busy-process"])
def test_a_reader_whose_process_is_busy_keeps_polling(monkeypatch, poll, dozes):
    """Counted on a clock that moves only when the reader sleeps: where its short sleeps take 80 us it naps on the
    bell after 50 ms; where each takes 5 ms (its thread waits for the interpreter's lock between polls) it never
    naps, since after a futex's wake-up it would wait a whole switch interval before it could look."""
    clock = _Clock(poll)
    board = HostBoard.create()
    try:
        if not _futex_waits(board):
            pytest.skip("no futex on this machine: the board polls (tested by the other waits)")
        monkeypatch.setattr(board_module, "time", clock)
        monkeypatch.setattr(board._bell, "wait", clock.nap)
        with pytest.raises(BoardTimeout):
            board.manifest("v1", timeout=0.5)
        assert clock.sleeps > 0
        if dozes:
            assert clock.naps >= (0.5 - board_module.DOZE_AFTER_SECONDS) / board_module.NAP_SECONDS - 2
        else:
            assert clock.naps == 0
    finally:
        monkeypatch.undo()
        board.close()


def test_the_bell_wakes_its_sleepers_only_where_one_can_be_asleep(monkeypatch):
    """Counted on a clock the test moves: the writer's first ring makes the wake-up call; a ring under half of
    ``DOZE_AFTER_SECONDS`` after its last (the post after its heads-up, the next version's heads-up when versions
    come back to back) makes none, since no reader sleeps on the bell that soon after it last changed; a ring after
    that long (the heads-up after a training step) makes it again."""
    clock = _Clock(0.0)
    board = HostBoard.create()
    try:
        monkeypatch.setattr(board_module, "time", clock)
        wakes: list[float] = []
        monkeypatch.setattr(board._bell, "wake", lambda: wakes.append(clock.now))
        quiet = board_module.DOZE_AFTER_SECONDS / 2
        board.heads_up()  # the first ring: a reader may have slept since it began to wait
        first = clock.now
        clock.now += 0.001
        board.post({"version": "v1", "seq": 1})  # a steady version's post, a millisecond after its heads-up
        clock.now += 0.009
        board.heads_up()  # the next version, back to back
        clock.now += quiet - 0.001
        board.post({"version": "v2", "seq": 2})  # just under the quiet time since the last ring
        assert wakes == [first]
        clock.now += quiet
        board.heads_up()  # a training step later: a reader may be asleep
        assert wakes == [first, clock.now]
    finally:
        monkeypatch.undo()
        board.close()


def test_a_post_soon_after_the_heads_up_is_seen_without_a_wake_up_call(monkeypatch):
    """A reader asleep on the bell (each sleep 30 s here) is woken by the heads-up; the post that follows within the
    quiet time makes no wake-up call, and the reader, polling since the bell, sees it at once (asleep, it would see
    it only at the end of a 30-s sleep). Should the test's own thread stall past the quiet time between the two, the
    post makes the call: the count is asserted only where it did not."""
    monkeypatch.setattr(board_module, "DOZE_AFTER_SECONDS", 0.5)
    monkeypatch.setattr(board_module, "NAP_SECONDS", 30.0)
    with _reader_and_writer() as (board, writer):
        naps, got, wakes = _recording_naps(monkeypatch, board), [], []
        real_wake = writer._bell.wake
        monkeypatch.setattr(writer._bell, "wake", lambda: wakes.append(1) or real_wake())
        reader = threading.Thread(target=lambda: got.append(board.manifest("v1", timeout=60)))
        reader.start()
        deadline = time.monotonic() + 20
        while naps != ["asleep"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert naps == ["asleep"]
        rang = time.monotonic()
        writer.heads_up()
        while naps != ["asleep", "awake"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert naps == ["asleep", "awake"]  # woken by the heads-up's call
        posted = time.monotonic()
        writer.post({"version": "v1", "seq": 1})
        reader.join(20)
        assert got == [{"version": "v1", "seq": 1}] and time.monotonic() - posted < 10.0  # not after a 30-s sleep
        assert naps == ["asleep", "awake"]  # it did not sleep on the bell again before the post
        if posted - rang < board_module.DOZE_AFTER_SECONDS / 2:
            assert wakes == [1]  # the heads-up's call only
