"""Sleeping on a word of shared memory (``awex.engines.sync.futex``): a wait returns at once where the word changed
already, at its timeout otherwise, woken by a writer between; where the call is refused it falls back to short
sleeps, said once in the log."""

import ctypes
import errno
import logging
import mmap
import struct
import threading
import time

import pytest

from awex.engines.sync import futex as futex_module
from awex.engines.sync.futex import Futex


@pytest.fixture
def word():
    shared = mmap.mmap(-1, 4096, mmap.MAP_SHARED)
    bell = Futex(shared, 8)
    yield shared, bell
    bell.release()
    shared.close()  # possible only once released


def test_a_word_must_be_aligned():
    with pytest.raises(ValueError, match="4-byte aligned"):
        Futex(mmap.mmap(-1, 4096, mmap.MAP_SHARED), 6)


def test_low_half_is_what_the_word_holds():
    assert Futex.low_half(5) == 5
    assert Futex.low_half((7 << 32) + 3) == 3
    assert Futex.low_half(0xFFFFFFFF) == -1  # a C int


def test_a_wait_returns_at_once_on_a_changed_word_else_when_woken(word):
    shared, bell = word
    if not bell.available:
        pytest.skip("no futex on this machine")
    struct.pack_into("<i", shared, 8, 4)
    started = time.monotonic()
    bell.wait(3, timeout=30.0)  # the word holds 4, not 3: no sleep
    assert time.monotonic() - started < 10.0

    def change_and_wake():
        time.sleep(0.1)
        struct.pack_into("<i", shared, 8, 5)
        bell.wake()

    thread = threading.Thread(target=change_and_wake)
    thread.start()
    bell.wait(4, timeout=30.0)  # asleep until the wake, not for 30 s
    assert time.monotonic() - started < 10.0
    assert struct.unpack_from("<i", shared, 8)[0] == 5
    thread.join(30)
    started = time.monotonic()
    bell.wait(5, timeout=0.05)  # nobody writes: the timeout
    assert time.monotonic() - started >= 0.04


def test_a_refused_call_falls_back_to_short_sleeps_said_once(word, monkeypatch, caplog):
    _, bell = word

    def refused(*args):
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(futex_module, "_CALL", (refused, ctypes.c_long(0)))
    bell.available = True
    sleeps = []
    monkeypatch.setattr(futex_module.time, "sleep", sleeps.append)
    with caplog.at_level(logging.INFO, logger="awex.engines"):
        bell.wait(0, timeout=30.0)
        bell.wait(0, timeout=30.0)
        bell.wake()
    assert sleeps == [bell.fallback, bell.fallback]  # polled as before, never for the timeout
    assert not bell.available
    assert len([r for r in caplog.records if "futex waits unavailable" in r.getMessage()]) == 1
