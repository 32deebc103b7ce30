"""The host board: a sync's per-version signals through shared memory, for the ranks on the writer's host.

The version channel (``awex.engines.channel``) reaches every rank over TCP; on one host a TCP wake-up still
costs tenths of a millisecond (0.4-0.5 ms measured on an H200 host's loopback), several times per version. The
board carries the same signals through a file in ``/dev/shm`` that every process on the host maps:

- the manifest of the current version, under a sequence lock (odd while it is being written);
- one 64-bit word per sync rank: the last version (by the writer's sequence number) that rank signalled
  (a trainer rank: its weights are ready; a receiver: it finished reading), with 20 bits of detail (a trainer's
  IPC export generation).

Waiting is polling with 20 us sleeps (as for CUDA events), bounded by the caller's deadline. The trainer's
first rank creates the board (mode 0600, a name with a random part) and removes it when it closes or exits.
A rank that cannot open it (another host, another ``/dev/shm``) uses the channel; signals always go to both.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import socket
import time
import weakref
from typing import Any

import torch

MAGIC = 0x41574558424F4152  # "AWEXBOAR"
SLOTS = 4096  # sync ranks on one host
MANIFEST_BYTES = 64 << 10
POLL_SECONDS = 20e-6
DETAIL = 1 << 20
_HEADER = 4  # int64 words: magic, slots, manifest seq, manifest length
_SIZE = (_HEADER + SLOTS) * 8 + MANIFEST_BYTES


def host_identity() -> str:
    """Which host (and boot) this process runs on: ranks on the same one can share the board."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class BoardTimeout(TimeoutError):
    """What was awaited on the board did not happen within the deadline."""


class HostBoard:
    """One process's mapping of a sync's board (``create()`` makes one, ``attach()`` opens one)."""

    def __init__(self, path: str, fd: int, owner: bool):
        self.path = path
        self._map = mmap.mmap(fd, _SIZE)
        os.close(fd)
        words = torch.frombuffer(self._map, dtype=torch.int64, count=_HEADER + SLOTS)
        self._header, self._slots = words[:_HEADER], words[_HEADER:]
        self._bytes = memoryview(self._map)[(_HEADER + SLOTS) * 8:]
        self.owner = owner
        self._finalizer = weakref.finalize(self, _remove, path) if owner else None

    @classmethod
    def create(cls, directory: str = "/dev/shm") -> HostBoard:
        path = os.path.join(directory, f"awex-board-{secrets.token_hex(12)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _SIZE)
        board = cls(path, fd, owner=True)
        board._header[1] = SLOTS
        board._header[0] = MAGIC
        return board

    @classmethod
    def attach(cls, path: str) -> HostBoard:
        """Open the board at ``path``; ``OSError`` or ``ValueError`` when this process cannot use it."""
        if not os.path.basename(path).startswith("awex-board-") or os.path.getsize(path) != _SIZE:
            raise ValueError(f"{path} is not an awex board")
        board = cls(path, os.open(path, os.O_RDWR), owner=False)
        if int(board._header[0]) != MAGIC or int(board._header[1]) != SLOTS:
            raise ValueError(f"{path} is not an awex board")
        return board

    # -- the manifest ------------------------------------------------------------------------------------
    def post(self, doc: dict[str, Any]) -> None:
        """Publish the current version's manifest (the writer's first rank)."""
        raw = json.dumps(doc).encode()
        if len(raw) > MANIFEST_BYTES:
            raise ValueError(f"manifest of {len(raw)} bytes exceeds the board's {MANIFEST_BYTES}")
        seq = int(self._header[2])
        self._header[2] = seq + 1  # odd: being written
        self._bytes[:len(raw)] = raw
        self._header[3] = len(raw)
        self._header[2] = seq + 2

    def manifest(self, version: str, timeout: float) -> dict[str, Any]:
        """The manifest of ``version``, waiting for it up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            seq = int(self._header[2])
            if seq and not seq % 2:
                length = int(self._header[3])
                raw = bytes(self._bytes[:max(0, min(length, MANIFEST_BYTES))])
                if int(self._header[2]) == seq:  # not rewritten while we read it
                    try:
                        doc = json.loads(raw)
                    except ValueError:
                        doc = None
                    if isinstance(doc, dict) and doc.get("version") == version:
                        return doc
            if time.monotonic() >= deadline:
                raise BoardTimeout(f"the manifest of {version!r} did not appear on the host board within "
                                   f"{timeout:g} s")
            time.sleep(POLL_SECONDS)

    # -- per-rank signals --------------------------------------------------------------------------------
    def ring(self, slot: int, seq: int, detail: int = 0) -> None:
        """Sync rank ``slot`` signals version ``seq`` (``detail``: 0 to 2**20 - 1)."""
        if not 0 <= slot < SLOTS or not 0 <= detail < DETAIL:
            raise ValueError(f"board slot {slot} / detail {detail} out of range")
        self._slots[slot] = seq * DETAIL + detail

    def wait(self, slots: list[int], seq: int, timeout: float) -> list[int]:
        """Until every one of ``slots`` signalled version ``seq`` (or later); their details."""
        deadline = time.monotonic() + timeout
        index = torch.tensor(slots, dtype=torch.long)
        floor = seq * DETAIL
        while True:
            words = self._slots[index]
            if not bool((words < floor).any()):
                return [int(w) % DETAIL for w in words]
            if time.monotonic() >= deadline:
                late = [s for s, w in zip(slots, words.tolist()) if w < floor]
                raise BoardTimeout(f"sync ranks {late[:8]} did not signal version {seq} within {timeout:g} s")
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        """Unmap (and, for the creator, remove) the board."""
        if self._finalizer is not None:
            self._finalizer()
        self._header = self._slots = None
        self._bytes.release()
        self._map.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
