"""Files in ``/dev/shm``: the shared-memory transport's segments (and the host board's file), named so that a
sweep can tell whose creator is gone, and a segment's header: its progress word, a magic, its seal (whose segment it
is: job, plan and sender, :func:`seal`) and the version it holds (count and name). A receiver refuses a segment
sealed for another job, plan or sender before any byte moves, and one that holds another version than it asked for.

Names are ``<prefix>-<creator pid>-<creator start time>-<random>`` (mode 0600): :func:`sweep_stale` removes those
whose creator no longer runs (killed before it could remove them).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

import torch

from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.transport")

SEGMENT_DIR = Path("/dev/shm")
PREFIX = "awex-shm"
OWNED = ("awex-shm", "awex-board")  # files in /dev/shm named by owned_name (the host board too)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_NAME = re.compile(r"^(awex-shm|awex-board)-(\d+)-(\d+)-[0-9a-f]+$")


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), which tells it from a later process with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` that started at ``started`` (:func:`start_time`) still runs (on this host)."""
    return start_time(pid) == started


def owned_name(prefix: str) -> str:
    """A name for a file in /dev/shm that :func:`sweep_stale` removes once its creator (this process) is gone:
    ``<prefix>-<pid>-<start time>-<random>``."""
    pid = os.getpid()
    return f"{prefix}-{pid}-{start_time(pid) or 0}-{secrets.token_hex(8)}"


def sweep_stale(directory: Path = SEGMENT_DIR) -> list[str]:
    """Remove segments (and host boards) whose creator no longer runs (killed before it could remove them); the
    names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        pid, started = int(m.group(2)), int(m.group(3))
        if start_time(pid) == started:
            continue
        try:
            os.unlink(directory / name)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left by killed processes", len(removed))
    return removed


HEADER = 128  # bytes before the data (a multiple of 64: the data stays aligned)
# the header: the progress word (8 bytes), MAGIC, the seal (32), the version's count (8) and name's SHA-256 (32)
_MAGIC_AT, _SEAL_AT, _COUNT_AT, _NAME_AT = 8, 16, 48, 56
MAGIC = b"AWEXSEG2"
COUNT_SHIFT = 40  # progress word: (version count mod 2**23) << 40 | bytes filled (< 1 TiB per segment)
UNSEALED = bytes(32)


def seal(job: str, plan_digest: str, rank: int) -> bytes:
    """What a segment is for: the job (on its MetaServer), the plan and the sender's sync rank, hashed (32 bytes)."""
    return hashlib.sha256(f"awex-shm\0{job}\0{plan_digest}\0{rank}".encode()).digest()


def _name_hash(version: str) -> bytes:
    return hashlib.sha256(version.encode()).digest()


def progress_word(count: int, filled: int) -> int:
    return ((count % (1 << 23)) << COUNT_SHIFT) | filled


class Segment:
    """One process's mapping of a segment (:meth:`create` makes one, :meth:`attach` opens one): a header whose
    progress word says how much of which version the data holds, then the data."""

    def __init__(self, path: Path, nbytes: int, fd: int, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._map = mmap.mmap(fd, HEADER + nbytes)
        os.close(fd)
        self._word = memoryview(self._map)[:8].cast("q")  # one aligned 8-byte load or store: never torn
        self._all = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor = self._all[HEADER:]
        self._finalizer = weakref.finalize(self, _remove, path) if owner else None  # at exit too
        self._pinned = False

    def set_progress(self, count: int, filled: int) -> None:
        """The data holds the first ``filled`` bytes of version ``count`` (the writer's count)."""
        self._word[0] = progress_word(count, filled)

    def set_version(self, count: int, version: str) -> None:
        """The data is (being) filled with version ``version``, the writer's count ``count`` (before the progress
        word says any byte of it is there)."""
        self._map[_COUNT_AT:_NAME_AT] = count.to_bytes(8, "little")
        self._map[_NAME_AT : _NAME_AT + 32] = _name_hash(version)

    def holds_version(self, count: int, version: str) -> bool:
        """Whether the header says the data is version ``version`` with the writer's count ``count``."""
        header = self._map[_COUNT_AT : _NAME_AT + 32]
        return header[:8] == count.to_bytes(8, "little") and header[8:] == _name_hash(version)

    def progress(self, count: int) -> int:
        """How many bytes of version ``count`` the data holds (from its start); -1 while it holds another."""
        word = self._word[0]
        return word & ((1 << COUNT_SHIFT) - 1) if word >> COUNT_SHIFT == count % (1 << 23) else -1

    @classmethod
    def create(cls, nbytes: int, sealed: bytes = UNSEALED, directory: Path = SEGMENT_DIR) -> Segment:
        """A new segment of ``nbytes`` of data, its header sealed with ``sealed`` (:func:`seal`)."""
        path = directory / owned_name(PREFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        segment = cls(path, nbytes, fd, owner=True)
        segment._map[_MAGIC_AT : _SEAL_AT + 32] = MAGIC + sealed
        return segment

    @classmethod
    def attach(cls, path: str, nbytes: int, sealed: bytes = UNSEALED, directory: Path = SEGMENT_DIR) -> Segment:
        """Open the segment at ``path``, which must be an Awex segment in ``directory`` of exactly ``nbytes``
        (what this rank's plan puts there), sealed with ``sealed`` (the same job, plan and sender); ``ValueError``
        otherwise."""
        p = Path(path)
        if p.parent != directory or _NAME.match(p.name) is None or not p.name.startswith(PREFIX + "-"):
            raise AwexValueError(f"{path!r} is not an Awex shared-memory segment in {directory}")
        fd = os.open(p, os.O_RDWR)
        size = os.fstat(fd).st_size
        if size != HEADER + nbytes:
            os.close(fd)
            raise AwexValueError(f"segment {p.name} holds {size - HEADER} bytes; this rank's plan puts {nbytes} there")
        segment = cls(p, nbytes, fd, owner=False)
        if segment._map[_MAGIC_AT : _SEAL_AT + 32] != MAGIC + sealed:
            segment.close()
            raise AwexValueError(
                f"segment {p.name} is not this sender's of this job and plan (its header is sealed for another job, "
                "plan or sender, or it is no Awex segment of this release)"
            )
        return segment

    @property
    def named(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def unlink(self) -> None:
        """Remove the name (the creator, once every receiver mapped it); mappings stay valid."""
        if self._finalizer is not None:
            self._finalizer()

    def pin(self) -> None:
        """Page-lock this mapping for the CUDA driver (``cudaHostRegister``), so copies between it and GPU memory
        run on the copy engines, asynchronously, at the link's rate."""
        if self._pinned:
            return
        error = torch.cuda.cudart().cudaHostRegister(self._all.data_ptr(), self._all.numel(), _HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of segment {self.path.name} ({self.nbytes} bytes) failed: {error}")
        self._pinned = True

    def close(self) -> None:
        self.unlink()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._all.data_ptr())
            self._pinned = False
        self.tensor = self._all = None
        self._word.release()
        try:
            self._map.close()
        except BufferError:  # views of it are still alive somewhere: the mapping goes with them
            pass


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
