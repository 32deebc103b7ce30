"""The host board: a sync's per-version signals through shared memory, for the ranks on the writer's host.

The version channel (``awex.engines.sync.channel``) reaches every rank over TCP; on one host a TCP wake-up still
costs tenths of a millisecond, several times per version (measured: docs/performance.md). The
board carries the same signals through a file in ``/dev/shm`` that every process on the host maps:

- the manifest of the current version, under a sequence lock (odd while it is being written);
- one 64-bit word per sync rank: the last version (by the writer's sequence number) that rank signalled
  (a trainer rank: its weights are ready; a receiver: it finished reading), with 20 bits of detail (a trainer's
  IPC export generation).

- a bell: a word the writer's first rank changes as a version begins (:meth:`HostBoard.heads_up`) and with every
  post.

Waiting polls, without sleeping for the first 0.3 ms, then with 20 us sleeps. A wait for the manifest polls without
sleeping for 1 ms after the bell rings (the manifest follows the heads-up within about that: the reader is not in a
sleep when it comes), and one that lasted 50 ms (a reader waiting through a training step) sleeps on the bell from
then on until the writer rings it (a futex: ``awex.engines.sync.futex``; at most 10 ms at a time, so the deadline is
kept): no CPU where polling took a tenth to a fifth of a core, and the futex's wake-up (slower than a polling
reader's in a virtual machine) passes while the writer still prepares the version. The writer makes that wake-up
call only where a reader can be asleep: not within 25 ms (half the 50) of its last ring. A reader whose short
sleeps take over a millisecond (a thread beside a busy one in its process: a staged receive while the engine
generates) keeps polling: woken from the futex it would wait a whole switch interval of the interpreter's lock (5
ms) before it could look, where polling looks at the next turn it gets. Every wait is bounded by the caller's
deadline. The trainer's first rank creates the board (mode 0600, a name with its pid and a random part) and removes
it when it closes or exits; a board whose writer was killed is removed by the next sweep
(``awex.transport.pull.shm.sweep_stale``). A rank that cannot open it (another host, another ``/dev/shm``) uses the
channel; signals always go to both.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import socket
import struct
import time
import weakref
from pathlib import Path
from typing import Any

from awex.engines.sync.futex import Futex
from awex.meta.errors import AwexError, AwexValueError
from awex.transport.pull.segments import owned_name, sweep_stale

MAGIC = 0x41574558424F4132  # "AWEXBOA2" (the layout with a bell; "AWEXBOAR" had none)
SLOTS = 4096  # sync ranks on one host
MANIFEST_BYTES = 64 << 10
POLL_SECONDS = 20e-6
SPIN_SECONDS = 300e-6  # poll without sleeping this long first (a sleep can take 50-100 us longer than asked)
HEADS_UP_SPIN_SECONDS = 1e-3  # after the bell rings, a manifest wait polls without sleeping this long
DOZE_AFTER_SECONDS = 0.05  # a wait for the manifest this long (or this long since the bell) sleeps on the bell ...
NAP_SECONDS = 0.01  # ... at most this long at a time (the deadline is checked between)
BUSY_SECONDS = 1e-3  # ... unless its last short sleep took longer than this (its process's other threads busy)
DETAIL = 1 << 20
_HEADER = 5  # int64 words: magic, slots, manifest seq, manifest length, bell
_BELL = 4
_MANIFEST = (_HEADER + SLOTS) * 8  # where the manifest's bytes start
_SIZE = _MANIFEST + MANIFEST_BYTES
_WORD = struct.Struct("<q")


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "?"


def host_identity() -> str:
    """Which host (and boot) this process runs on, as far as ranks can share the board and shared memory: the
    hostname, the boot and the network namespace. Processes in separate network namespaces (containers with
    their own network, usually their own ``/dev/shm`` too) count as separate hosts: they sync as hosts do."""
    try:
        net = os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{socket.gethostname()}/{_boot_id()}/{net}"


class BoardTimeout(AwexError, TimeoutError):
    """What was awaited on the board did not happen within the deadline."""


class HostBoard:
    """One process's mapping of a sync's board (``create()`` makes one, ``attach()`` opens one)."""

    def __init__(self, path: str, fd: int, owner: bool):
        self.path = path
        self._map = mmap.mmap(fd, _SIZE)
        os.close(fd)
        self._bell = Futex(self._map, _BELL * 8, fallback=POLL_SECONDS)  # the bell word's low half
        self.owner = owner
        self._rang: float | None = None  # when this process last rang the bell (only the writer's first rank does)
        self._finalizer = weakref.finalize(self, _remove, path) if owner else None

    # aligned 8-byte words, read and written whole (x86-64 and aarch64 do not tear them)
    def _get(self, word: int) -> int:
        return _WORD.unpack_from(self._map, word * 8)[0]

    def _set(self, word: int, value: int) -> None:
        _WORD.pack_into(self._map, word * 8, value)

    @classmethod
    def create(cls, directory: str = "/dev/shm") -> HostBoard:
        sweep_stale(Path(directory))  # boards and segments of killed writers
        path = os.path.join(directory, owned_name("awex-board"))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _SIZE)
        board = cls(path, fd, owner=True)
        board._set(1, SLOTS)
        board._set(0, MAGIC)
        return board

    @classmethod
    def attach(cls, path: str) -> HostBoard:
        """Open the board at ``path``; ``OSError`` or ``ValueError`` when this process cannot use it."""
        if not os.path.basename(path).startswith("awex-board-") or os.path.getsize(path) != _SIZE:
            raise AwexValueError(f"{path} is not an awex board")
        board = cls(path, os.open(path, os.O_RDWR), owner=False)
        if board._get(0) != MAGIC or board._get(1) != SLOTS:
            raise AwexValueError(f"{path} is not an awex board")
        return board

    # -- the manifest ------------------------------------------------------------------------------------
    def post(self, doc: dict[str, Any]) -> None:
        """Publish the current version's manifest (the writer's first rank)."""
        raw = json.dumps(doc).encode()
        if len(raw) > MANIFEST_BYTES:
            raise AwexValueError(f"manifest of {len(raw)} bytes exceeds the board's {MANIFEST_BYTES}")
        seq = self._get(2)
        self._set(2, seq + 1)  # odd: being written
        self._map[_MANIFEST : _MANIFEST + len(raw)] = raw
        self._set(3, len(raw))
        self._set(2, seq + 2)
        self._ring_bell()  # after the manifest: a reader that sees the bell's new value sees the manifest too

    def heads_up(self) -> None:
        """The writer's first rank, as a version begins: readers asleep on the board wake, and every reader polls
        without sleeping for the next millisecond (each post rings the bell as well)."""
        self._ring_bell()

    def _ring_bell(self) -> None:
        """Change the bell, and wake its sleepers unless this board rang it under half of ``DOZE_AFTER_SECONDS``
        ago: a reader sleeps on the bell only once that long passed since it last saw the bell change (or began to
        wait), so none can be asleep then (the call is a system call on the writer's critical path: a steady post
        follows its heads-up by a millisecond or so, back-to-back versions by as little)."""
        self._set(_BELL, self._get(_BELL) + 1)
        now = time.monotonic()
        if self._rang is None or now - self._rang >= DOZE_AFTER_SECONDS / 2:
            self._bell.wake()
        self._rang = now

    def manifest(self, version: str, timeout: float) -> dict[str, Any]:
        """The manifest of ``version``, waiting for it up to ``timeout`` seconds."""
        rung = self._get(_BELL)  # before the clock: no doze within DOZE_AFTER_SECONDS of a ring this value shows
        now = time.monotonic()
        deadline, spin_until, doze_from = now + timeout, now + SPIN_SECONDS, now + DOZE_AFTER_SECONDS
        seen = -1  # the last manifest read (and found to be another version's): not parsed again
        polled = None  # when the last short sleep began
        while True:
            bell = self._get(_BELL)  # before the manifest: a post after this read changes it
            if bell != rung:  # a version begins: its manifest comes within about a millisecond
                rung, now = bell, time.monotonic()
                spin_until, doze_from = now + HEADS_UP_SPIN_SECONDS, now + DOZE_AFTER_SECONDS
            seq = self._get(2)
            if seq != seen and seq and not seq % 2:
                length = max(0, min(self._get(3), MANIFEST_BYTES))
                raw = self._map[_MANIFEST : _MANIFEST + length]
                if self._get(2) == seq:  # not rewritten while we read it
                    try:
                        doc = json.loads(raw)
                    except ValueError:
                        doc = None
                    if isinstance(doc, dict) and version in (doc.get("version"), doc.get("refused")):
                        return doc
                    seen = seq
            now = time.monotonic()
            if now >= deadline:
                raise BoardTimeout(f"the manifest of {version!r} did not appear on the host board within {timeout:g} s")
            if now <= spin_until:
                continue
            # a short sleep that took over a millisecond: this thread waits for the interpreter's lock (another
            # thread of its process is busy), which it would wait for after a futex's wake-up too: it keeps polling
            busy = polled is not None and now - polled > BUSY_SECONDS
            if now > doze_from and not busy:  # asleep until the bell rings
                polled = None
                self._bell.wait(Futex.low_half(bell), min(NAP_SECONDS, deadline - now))
            else:
                polled = now
                time.sleep(POLL_SECONDS)

    # -- per-rank signals --------------------------------------------------------------------------------
    def ring(self, slot: int, seq: int, detail: int = 0) -> None:
        """Sync rank ``slot`` signals version ``seq`` (``detail``: 0 to 2**20 - 1)."""
        if not 0 <= slot < SLOTS or not 0 <= detail < DETAIL:
            raise AwexValueError(f"board slot {slot} / detail {detail} out of range")
        self._set(_HEADER + slot, seq * DETAIL + detail)

    def wait(self, slots: list[int], seq: int, timeout: float, expect: float = 0.0) -> list[int]:
        """Until every one of ``slots`` signalled version ``seq`` (or later); their details. ``expect``: about
        when (seconds from now) the signals should come: polling does not sleep from shortly before then (a
        sleep overshoots by tens of microseconds) until shortly after."""
        now = time.monotonic()
        deadline = now + timeout
        spin_from = now + max(0.0, expect - SPIN_SECONDS) if expect > 2 * SPIN_SECONDS else now
        spin_until = spin_from + (2 * SPIN_SECONDS if expect > 2 * SPIN_SECONDS else SPIN_SECONDS)
        if any(not 0 <= s < SLOTS for s in slots):
            raise AwexValueError(f"board slots {slots[:8]} out of range")
        floor = seq * DETAIL
        while True:
            words = [self._get(_HEADER + s) for s in slots]
            if min(words, default=floor) >= floor:
                return [w % DETAIL for w in words]
            now = time.monotonic()
            if now >= deadline:
                late = [s for s, w in zip(slots, words) if w < floor]
                raise BoardTimeout(f"sync ranks {late[:8]} did not signal version {seq} within {timeout:g} s")
            if not spin_from <= now <= spin_until:
                time.sleep(POLL_SECONDS)

    def signalled(self, slots: list[int], seq: int) -> list[int | None]:
        """Without waiting: for each of ``slots``, its detail if it signalled version ``seq`` (or later), else
        ``None``."""
        floor = seq * DETAIL
        words = [self._get(_HEADER + s) if 0 <= s < SLOTS else -1 for s in slots]
        return [w % DETAIL if w >= floor else None for w in words]

    def close(self) -> None:
        """Unmap (and, for the creator, remove) the board."""
        if self._finalizer is not None:
            self._finalizer()
        self._bell.release()
        self._map.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
