"""The host board: a manifest under a sequence lock and per-rank version signals in shared memory, read by other
processes on the host; waits end at their deadline; the creator removes it."""

import multiprocessing as mp
import os
import sys
import time

import pytest

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
