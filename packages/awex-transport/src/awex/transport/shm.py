"""Host shared memory: each sender writes a version's bytes once into a segment laid out by the plan, and every
receiver on the host copies what it needs out of it, in place.

For engines on one host that cannot use CUDA IPC or a process group between them: CPU engines, separate containers
sharing ``/dev/shm``, GPUs without peer access. A sender's segment holds each distinct region it sends once, however
many receivers read it (:func:`segment_layout`, a pure function of the plan: every rank computes where each region
lies). Per version the sender fills its segment and signals "ready"; receivers copy out and report their outcome;
the sender changes nothing until every receiver did (the writer waits for the outcomes before it returns).

Segments are files in ``/dev/shm`` named ``awex-shm-<creator pid>-<creator start time>-<random>`` (mode 0600). The
creator removes the name once every receiver has mapped it (after the first applied version: the mappings stay
valid), when it closes, and at exit; a segment whose creator was killed before that is removed by the next sweep
(:func:`sweep_stale`, run by every new sender and by a receiver whose sync failed). A receiver checks a segment's
name, size and plan digest against its own plan before any byte moves.

CPU views only for now: GPU views (pinned segments filled by copy-engine transfers) are not built yet.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from awex.meta import Plan
from awex.transport.base import PeerLink, RefreshByWave, Setup, TransferStats, Transport, timed
from awex.transport.shards import LocalShards
from awex.transport.staged import empty_copies, fill_copies, segment_layout

log = logging.getLogger("awex.transport")

SEGMENT_DIR = Path("/dev/shm")
PREFIX = "awex-shm"
OWNED = ("awex-shm", "awex-board")  # files in /dev/shm named by owned_name (the host board too)
_NAME = re.compile(r"^(awex-shm|awex-board)-(\d+)-(\d+)-[0-9a-f]+$")


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), which tells it from a later process with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owned_name(prefix: str) -> str:
    """A name for a file in /dev/shm that :func:`sweep_stale` removes once its creator (this process) is gone:
    ``<prefix>-<pid>-<start time>-<random>``."""
    pid = os.getpid()
    return f"{prefix}-{pid}-{_start_time(pid) or 0}-{secrets.token_hex(8)}"


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
        if _start_time(pid) == started:
            continue
        try:
            os.unlink(directory / name)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left by killed processes", len(removed))
    return removed


class Segment:
    """One process's mapping of a segment (:meth:`create` makes one, :meth:`attach` opens one)."""

    def __init__(self, path: Path, nbytes: int, fd: int, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._map = mmap.mmap(fd, max(nbytes, 1))
        os.close(fd)
        self.tensor = (
            torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
        )
        self._finalizer = weakref.finalize(self, _remove, path) if owner else None  # at exit too

    @classmethod
    def create(cls, nbytes: int, directory: Path = SEGMENT_DIR) -> Segment:
        path = directory / owned_name(PREFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, nbytes, fd, owner=True)

    @classmethod
    def attach(cls, path: str, nbytes: int, directory: Path = SEGMENT_DIR) -> Segment:
        """Open the segment at ``path``, which must be an Awex segment in ``directory`` of exactly ``nbytes``
        (what this rank's plan puts there); ``ValueError`` otherwise."""
        p = Path(path)
        if p.parent != directory or _NAME.match(p.name) is None or not p.name.startswith(PREFIX + "-"):
            raise ValueError(f"{path!r} is not an Awex shared-memory segment in {directory}")
        fd = os.open(p, os.O_RDWR)
        size = os.fstat(fd).st_size
        if size != max(nbytes, 1):
            os.close(fd)
            raise ValueError(f"segment {p.name} holds {size} bytes; this rank's plan puts {nbytes} there")
        return cls(p, nbytes, fd, owner=False)

    @property
    def named(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def unlink(self) -> None:
        """Remove the name (the creator, once every receiver mapped it); mappings stay valid."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self) -> None:
        self.unlink()
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # views of it are still alive somewhere: the mapping goes with them
            pass


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_cpu(shards: LocalShards) -> None:
    if shards.device.type != "cpu":
        raise ValueError(f"transport 'shm' moves CPU views only for now; these views are on {shards.device}")


class ShmSender:
    """A sender's segment and the copies that fill it, built once per plan."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards):
        _check_cpu(shards)
        self.plan, self.rank = plan, rank
        sweep_stale()
        self.segment = Segment.create(segment_layout(plan, rank)[1])
        self.copies = fill_copies(plan, rank, shards, self.segment.tensor)
        self.bytes_sent = sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "send")

    def wire(self) -> dict[str, Any]:
        """What receivers need to open the segment (published through the MetaServer)."""
        return {
            "path": str(self.segment.path),
            "nbytes": self.segment.nbytes,
            "digest": self.plan.digest,
            "rank": self.rank,
        }

    def fill(self) -> TransferStats:
        """Write this version's bytes into the segment."""
        started = time.monotonic()
        for copy in self.copies:
            copy()
        return TransferStats(bytes_sent=self.bytes_sent, buckets=len(self.copies), seconds=time.monotonic() - started)

    def close(self) -> None:
        self.copies = []
        self.segment.close()


@dataclass(frozen=True)
class SegmentInfo:
    """A sender's segment as published: checked against the receiver's own plan before use."""

    path: str
    nbytes: int
    digest: str
    rank: int

    @classmethod
    def from_wire(cls, doc: Any, plan: Plan, peer: int) -> SegmentInfo:
        if not isinstance(doc, Mapping) or set(doc) != {"path", "nbytes", "digest", "rank"}:
            raise ValueError(f"malformed shared-memory segment record: {str(doc)[:200]}")
        path, nbytes, digest, rank = doc["path"], doc["nbytes"], doc["digest"], doc["rank"]
        if not isinstance(path, str) or not isinstance(digest, str):
            raise ValueError("malformed shared-memory segment record: path and digest must be strings")
        if (
            not isinstance(nbytes, int)
            or isinstance(nbytes, bool)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
        ):
            raise ValueError("malformed shared-memory segment record: nbytes and rank must be integers")
        if digest != plan.digest or rank != peer:
            raise ValueError(
                f"the segment of sync rank {rank} was laid out for plan {digest[:12]}, not for this "
                f"rank's plan {plan.digest[:12]} and sync rank {peer}"
            )
        expected = segment_layout(plan, peer)[1]
        if nbytes != expected:
            raise ValueError(f"the segment of sync rank {peer} holds {nbytes} bytes; the plan puts {expected} there")
        return cls(path, nbytes, digest, rank)


class ShmReceiver:
    """A receiver's mappings of its senders' segments and the copies out of them, built once per plan."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, segments: Mapping[int, SegmentInfo]):
        _check_cpu(shards)
        self.plan, self.rank = plan, rank
        steps = [s for s in plan.schedule(rank) if s.op == "recv"]
        missing = sorted({s.peer for s in steps} - set(segments))
        if missing:
            raise ValueError(f"sync rank {rank}: no segment of sync rank(s) {missing}")
        self.segments = {peer: Segment.attach(info.path, info.nbytes) for peer, info in segments.items()}
        where = {peer: (seg.tensor, segment_layout(plan, peer)[0]) for peer, seg in self.segments.items()}
        self.copies = empty_copies(plan, rank, shards, where)
        self.bytes_received = sum(s.bucket.nbytes for s in steps)

    def run(self) -> TransferStats:
        started = time.monotonic()
        for copy in self.copies:
            copy()
        return TransferStats(
            bytes_received=self.bytes_received, buckets=len(self.copies), seconds=time.monotonic() - started
        )

    def close(self) -> None:
        self.copies = []
        for segment in self.segments.values():
            segment.close()
        self.segments = {}


class ShmTransport(Transport):
    """Host shared memory: a sender fills its segment (a new one per plan, its name published as a descriptor)
    and says ready; receivers map the segments once per plan and copy out."""

    name = "shm"

    def __init__(self) -> None:
        self.sender: ShmSender | None = None
        self.receiver: ShmReceiver | None = None
        self.generation = 0  # of this rank's segment: a new segment per plan
        self.plan: Plan | None = None  # what the segment or the mappings were built for
        self.opened: dict[int, int] = {}  # a receiver's peers -> generation mapped
        self._next: tuple[Plan, int] | None = None
        self._peers: list[int] = []

    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        self._next = (plan, rank)
        self._peers = sorted({s.peer for s in plan.schedule(rank) if s.op == "recv"})

    def run(
        self,
        shards: LocalShards | Callable[[Plan], LocalShards],
        link: PeerLink,
        deadline: float,
        phases: MutableMapping[str, float],
        refresh_by_wave: RefreshByWave | None = None,
    ) -> TransferStats:
        if self._next is None:
            raise RuntimeError("ShmTransport.run before prepare")
        if callable(shards):
            raise ValueError("transport 'shm' copies into the engine's own views (in place), not receive buffers")
        plan, rank = self._next
        if plan.ranks[rank].role.value == "trainer":
            if self.sender is None or self.plan is not plan:
                with timed(phases, "executor"):
                    self._release()
                    self.sender, self.plan = ShmSender(plan, rank, shards), plan
                    self.generation += 1
                    link.publish(self.generation, self.sender.wire())
            with timed(phases, "transfer"):
                stats = self.sender.fill()
            with timed(phases, "ready"):
                link.ready(self.generation)
            return stats
        with timed(phases, "open"):
            peers = self._peers
            generations = link.await_ready(peers, deadline)
            if (
                self.receiver is None
                or self.plan is not plan
                or any(self.opened.get(p) != g for p, g in zip(peers, generations))
            ):
                infos = {
                    peer: SegmentInfo.from_wire(link.descriptor(peer, generation, deadline), plan, peer)
                    for peer, generation in zip(peers, generations)
                }
                self._release()
                self.receiver, self.plan = ShmReceiver(plan, rank, shards, infos), plan
                self.opened = dict(zip(peers, generations))
        link.moving()
        with timed(phases, "transfer"):
            return self.receiver.run()

    def applied(self) -> None:
        """Every receiver mapped this plan's segment: its name can go (the mappings stay)."""
        if self.sender is not None:
            self.sender.segment.unlink()

    def abort(self) -> None:
        if self.sender is not None or self.receiver is not None:
            self._release()
            sweep_stale()  # a sender killed before it removed its segment's name
        self._next = None

    def close(self) -> None:
        self._release()
        self._next = None

    def _release(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.sender = self.receiver = self.plan = None
        self.opened = {}
