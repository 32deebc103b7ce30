"""Sleeping until another process changes a word of shared memory: Linux's futex, through the C library's ``syscall``.

The host board's readers may wait for the next version's manifest through a whole training step (a staged receive
waits on a thread of its own while the engine generates). Polling the board with short sleeps costs a tenth to a
fifth of a core the whole time, and takes the interpreter's lock every few tens of microseconds from the engine's
own threads. A futex wait costs nothing while it sleeps; its wake-up is about as fast as a polling reader's on a
machine of its own and slower in a virtual machine (docs/performance.md), so the board polls first and the writer
rings its bell as a version begins, before it posts the manifest:

- the waiter reads the word, finds nothing new, and sleeps *only while the word still holds what it read* (the kernel
  compares; a change in between returns at once, so no wake-up is lost);
- the writer changes the word, then wakes every sleeper on it.

A 32-bit word of a ``MAP_SHARED`` mapping (the low half of the board's bell, which changes as each version begins
and with every post). Where the call is not available (another OS, an architecture not listed here, a sandbox
refusing it) :meth:`Futex.wait` sleeps ``fallback`` seconds instead and says so in the log once: the caller polls as
before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
import time

from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.engines")

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "riscv64": 98}  # little-endian
_WAIT, _WAKE = 0, 1  # shared between processes: not the PRIVATE variants
_EVERYONE = 2**31 - 1
_QUIET = {errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR}  # the word changed, the time ran out, a signal came


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    """The C library's ``syscall`` and the futex number on this machine, or ``None`` where there is none."""
    number = _SYS_FUTEX.get(platform.machine().lower())
    if platform.system() != "Linux" or sys.byteorder != "little" or number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call, ctypes.c_long(number)


_CALL = _syscall()


class Futex:
    """The 32-bit word at ``offset`` (a multiple of 4) of ``buffer`` (a writable shared mapping, e.g. an ``mmap``).
    Holds an export of the buffer until :meth:`release` (an ``mmap`` cannot close before)."""

    def __init__(self, buffer, offset: int, fallback: float = 20e-6):
        if offset % 4:
            raise AwexValueError(f"a futex word must be 4-byte aligned, not at offset {offset}")
        self.fallback = fallback
        self._anchor: ctypes.c_int32 | None = ctypes.c_int32.from_buffer(buffer, offset)
        self._address = ctypes.c_void_p(ctypes.addressof(self._anchor))
        self.available = _CALL is not None

    @staticmethod
    def low_half(value: int) -> int:
        """What the word holds when a little-endian 64-bit ``value`` starts at it (as a C ``int``)."""
        return ctypes.c_int32(value & 0xFFFFFFFF).value

    def wait(self, expected: int, timeout: float) -> None:
        """Sleep until the word no longer holds ``expected`` (a C ``int``: :meth:`low_half`) and a writer woke this
        process, or ``timeout`` seconds passed; at once where it holds something else already. The caller reads the
        word again (a return says nothing about why)."""
        if not self.available or self._anchor is None:
            time.sleep(self.fallback)
            return
        timeout = max(0.0, timeout)
        spec = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        call, number = _CALL
        if call(number, self._address, ctypes.c_int(_WAIT), ctypes.c_int(expected), ctypes.byref(spec), None, 0) == 0:
            return
        err = ctypes.get_errno()
        if err not in _QUIET:
            self._unavailable(err)
            time.sleep(self.fallback)

    def wake(self) -> None:
        """Wake every process sleeping on the word (after changing it)."""
        if not self.available or self._anchor is None:
            return
        call, number = _CALL
        if call(number, self._address, ctypes.c_int(_WAKE), ctypes.c_int(_EVERYONE), None, None, 0) < 0:
            self._unavailable(ctypes.get_errno())

    def release(self) -> None:
        """Let go of the buffer (before it closes): waits poll from now on."""
        self._anchor = None
        self.available = False

    def _unavailable(self, err: int) -> None:
        self.available = False
        log.info("futex waits unavailable here (%s): the host board is polled instead", os.strerror(err))
