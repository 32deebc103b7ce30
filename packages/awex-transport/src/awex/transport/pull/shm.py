"""Host shared memory: each sender writes a version's bytes once into a segment laid out by the plan, and every
receiver on the host copies what it needs out of it, in place.

For engines on one host that cannot use CUDA IPC or a process group between them: CPU engines, separate containers
sharing ``/dev/shm``, GPUs without peer access. A sender's segment holds each distinct region it sends once, however
many receivers read it (:func:`~awex.transport.pull.staging.segment_layout`, a pure function of the plan: every rank
computes where each region lies). Per version the sender says "ready", then fills its segment chunk by chunk; a
progress word in the segment's header says how many bytes of which version (the writer's count) the data holds, and
receivers copy each region out as soon as it is there, overlapping the filling. Receivers report their outcome;
the sender changes nothing until every receiver did (the writer waits for the outcomes before it returns).

GPU views: both sides page-lock their mapping of a segment (``cudaHostRegister``), so the sender fills it with
device-to-host copies and receivers empty it with host-to-device copies on the copy engines; each side waits for
its copies under the deadline.

Segments are files in ``/dev/shm`` named ``awex-shm-<creator pid>-<creator start time>-<random>`` (mode 0600). The
creator removes the name once every receiver has mapped it (after the first applied version: the mappings stay
valid), when it closes, and at exit; a segment whose creator was killed before that is removed by the next sweep
(:func:`sweep_stale`, run by every new sender and by a receiver whose sync failed). A receiver checks a segment's
name, size and plan digest against its own plan, and its header's seal (the job, plan and sender it was made for,
:func:`~awex.transport.pull.segments.seal`), before any byte moves; and that it holds the version asked for (the
writer's count and the version's name) before and after it copies. That the bytes themselves are the sender's is
what verify mode checks (``awex.engines.sync.verify``: digests that never travel through the segment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from awex.meta import Plan
from awex.meta.errors import AwexValueError
from awex.transport.base import PeerLink, TransferError, TransferStats, TransferTimeout, timed
from awex.transport.copies import copier
from awex.transport.deadline import wait_event
from awex.transport.pull.base import PullTransport
from awex.transport.pull.segments import Segment, seal, sweep_stale
from awex.transport.pull.staging import empty_pairs, extent, fill_pairs, segment_layout
from awex.transport.shards import LocalShards

log = logging.getLogger("awex.transport")

CHUNK_BYTES = 16 << 20  # a sender advances its progress word about this often
POLL_SECONDS = 100e-6  # a receiver waiting for its senders' progress sleeps this long between looks


def _finish(device: torch.device, deadline: float, what: str) -> None:
    """Wait (until ``deadline``) for the copies queued on ``device``'s current stream (CUDA views); nothing on CPU."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_event(done, deadline, lambda: TransferTimeout(f"{what}: the copies did not finish before the deadline"))


class ShmSender:
    """A sender's segment and the copies that fill it, built once per plan, in chunks of about
    :data:`CHUNK_BYTES` in the segment's order: after each chunk the progress word says how far the data is
    filled, and receivers copy out what is there while the rest is filled."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, job: str = ""):
        self.plan, self.rank, self.device = plan, rank, shards.device
        sweep_stale()
        self.segment = Segment.create(segment_layout(plan, rank)[1], seal(job, plan.digest, rank))
        if self.device.type == "cuda":
            self.segment.pin()
        pairs = fill_pairs(plan, rank, shards, self.segment.tensor)
        base = self.segment.tensor.data_ptr()
        spans = [extent(d, base) for d, _ in pairs]
        # the data below the earliest byte still to be written is final: progress after each chunk
        first_left = [self.segment.nbytes] * (len(pairs) + 1)
        for k in range(len(pairs) - 1, -1, -1):
            first_left[k] = min(first_left[k + 1], spans[k][0])
        self.chunks: list[tuple[list[Callable[[], None]], int]] = []
        group, size = [], 0
        for k, (d, src) in enumerate(pairs):
            group.append(copier(d, src))
            size += spans[k][1] - spans[k][0]
            if size >= CHUNK_BYTES or k == len(pairs) - 1:
                self.chunks.append((group, first_left[k + 1]))
                group, size = [], 0
        self.bytes_sent = sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "send")

    def wire(self) -> dict[str, Any]:
        """What receivers need to open the segment (published through the MetaServer)."""
        return {
            "path": str(self.segment.path),
            "nbytes": self.segment.nbytes,
            "digest": self.plan.digest,
            "rank": self.rank,
        }

    def fill(self, count: int = 1, deadline: float | None = None, version: str = "") -> TransferStats:
        """Write version ``count``'s bytes (named ``version``) into the segment, chunk by chunk, advancing the
        progress word (from GPU views: device-to-host copies on the copy engines, each chunk waited for until
        ``deadline``)."""
        started = time.monotonic()
        deadline = deadline or started + 300.0
        segment = self.segment
        segment.set_progress(count, 0)
        segment.set_version(count, version)
        if self.device.type != "cuda":
            for group, done in self.chunks:
                for copy in group:
                    copy()
                segment.set_progress(count, done)
        else:
            with torch.cuda.device(self.device):
                stream = torch.cuda.current_stream(self.device)
                events = []
                for group, done in self.chunks:
                    for copy in group:
                        copy()
                    events.append((stream.record_event(), done))
                for event, done in events:
                    wait_event(
                        event,
                        deadline,
                        lambda: TransferTimeout(
                            f"sync rank {self.rank}: filling its segment did not finish before the deadline"
                        ),
                    )
                    segment.set_progress(count, done)
        segment.set_progress(count, segment.nbytes)
        copies = sum(len(g) for g, _ in self.chunks)
        return TransferStats(bytes_sent=self.bytes_sent, buckets=copies, seconds=time.monotonic() - started)

    def close(self) -> None:
        self.chunks = []
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
            raise AwexValueError(f"malformed shared-memory segment record: {str(doc)[:200]}")
        path, nbytes, digest, rank = doc["path"], doc["nbytes"], doc["digest"], doc["rank"]
        if not isinstance(path, str) or not isinstance(digest, str):
            raise AwexValueError("malformed shared-memory segment record: path and digest must be strings")
        if (
            not isinstance(nbytes, int)
            or isinstance(nbytes, bool)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
        ):
            raise AwexValueError("malformed shared-memory segment record: nbytes and rank must be integers")
        if digest != plan.digest or rank != peer:
            raise AwexValueError(
                f"the segment of sync rank {rank} was laid out for plan {digest[:12]}, not for this "
                f"rank's plan {plan.digest[:12]} and sync rank {peer}"
            )
        expected = segment_layout(plan, peer)[1]
        if nbytes != expected:
            raise AwexValueError(
                f"the segment of sync rank {peer} holds {nbytes} bytes; the plan puts {expected} there"
            )
        return cls(path, nbytes, digest, rank)


class ShmReceiver:
    """A receiver's mappings of its senders' segments and the copies out of them, built once per plan; each copy
    runs as soon as its sender's progress word says its bytes are there."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, segments: Mapping[int, SegmentInfo], job: str = ""):
        self.plan, self.rank, self.device = plan, rank, shards.device
        steps = [s for s in plan.schedule(rank) if s.op == "recv"]
        missing = sorted({s.peer for s in steps} - set(segments))
        if missing:
            raise AwexValueError(f"sync rank {rank}: no segment of sync rank(s) {missing}")
        self.segments = {}
        try:
            for peer, info in segments.items():
                self.segments[peer] = Segment.attach(info.path, info.nbytes, seal(job, plan.digest, peer))
        except BaseException:
            self.close()
            raise
        if self.device.type == "cuda":
            for segment in self.segments.values():
                segment.pin()
        self.rebind(shards)
        self.bytes_received = sum(s.bucket.nbytes for s in steps)

    def rebind(self, shards: LocalShards) -> None:
        """The copies out of the mapped segments into ``shards`` (again when the engine re-allocated its weights:
        the segments stay mapped; their names may be gone)."""
        where = {peer: (seg.tensor, segment_layout(self.plan, peer)[0]) for peer, seg in self.segments.items()}
        per_peer: dict[int, list[tuple[int, Callable[[], None]]]] = {peer: [] for peer in self.segments}
        for peer, (d, src) in empty_pairs(self.plan, self.rank, shards, where):
            per_peer[peer].append((extent(src, self.segments[peer].tensor.data_ptr())[1], copier(d, src)))
        self.copies = {peer: sorted(c, key=lambda x: x[0]) for peer, c in per_peer.items()}  # by the bytes they need

    def run(
        self,
        count: int = 1,
        deadline: float | None = None,
        check: Callable[[list[int]], None] | None = None,
        version: str = "",
    ) -> TransferStats:
        """Copy this rank's regions of version ``count`` (named ``version``) out of the segments, each as soon as
        its bytes are there (into GPU views: host-to-device copies on the copy engines, waited for until
        ``deadline``: the sender may overwrite the segment once this rank reported). ``check(peers)`` runs every
        second while waiting (raises if a sender is gone). A segment whose header names another version fails the
        run (before its first copy, and again after the last)."""
        started = time.monotonic()
        deadline = deadline or started + 300.0
        next_of = dict.fromkeys(self.copies, 0)
        named: set[int] = set()  # peers whose segment was seen to hold this version
        checked = started
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            while True:
                moved = False
                for peer, copies in self.copies.items():
                    k = next_of[peer]
                    if k == len(copies):
                        continue
                    filled = self.segments[peer].progress(count)
                    if peer not in named and k < len(copies) and copies[k][0] <= filled:
                        self._check_version(peer, count, version)
                        named.add(peer)
                    while k < len(copies) and copies[k][0] <= filled:
                        copies[k][1]()
                        k += 1
                        moved = True
                    next_of[peer] = k
                waiting = [p for p, c in self.copies.items() if next_of[p] < len(c)]
                if not waiting:
                    break
                if not moved:
                    now = time.monotonic()
                    if now >= deadline:
                        raise TransferTimeout(
                            f"sync rank {self.rank}: the segments of sync rank(s) {waiting} were not filled with "
                            f"version {count} before the deadline"
                        )
                    if check is not None and now - checked >= 1.0:
                        checked = now
                        check(waiting)
                    time.sleep(POLL_SECONDS)
            _finish(self.device, deadline, f"sync rank {self.rank} copying out of the segments")
        for peer in self.copies:  # nothing overwrote it meanwhile (the sender waits for this rank's outcome)
            self._check_version(peer, count, version)
        return TransferStats(
            bytes_received=self.bytes_received,
            buckets=sum(len(c) for c in self.copies.values()),
            seconds=time.monotonic() - started,
        )

    def _check_version(self, peer: int, count: int, version: str) -> None:
        if not self.segments[peer].holds_version(count, version):
            raise TransferError(
                f"sync rank {self.rank}: the segment of sync rank {peer} does not hold version {version!r} (count "
                f"{count}): another writer's, or overwritten"
            )

    def close(self) -> None:
        self.copies = {}
        for segment in self.segments.values():
            segment.close()
        self.segments = {}


class ShmTransport(PullTransport):
    """Host shared memory: a sender fills its segment (a new one per plan, its name published as a descriptor)
    and says ready; receivers map the segments once per plan and copy out."""

    name = "shm"

    def _new_sender(self, plan: Plan, rank: int, shards: LocalShards) -> ShmSender:
        return ShmSender(plan, rank, shards, self.job)

    def _send(self, link: PeerLink, deadline: float, phases: MutableMapping[str, float]) -> TransferStats:
        with timed(phases, "ready"):  # receivers follow the progress word while the segment fills
            link.ready(self.generation)
        with timed(phases, "transfer"):
            return self.sender.fill(link.count, deadline, link.version)

    def _descriptor(self, wire: Any, plan: Plan, sender: int) -> SegmentInfo:
        return SegmentInfo.from_wire(wire, plan, sender)

    def _new_receiver(
        self, plan: Plan, rank: int, shards: LocalShards, descriptors: Mapping[int, SegmentInfo]
    ) -> ShmReceiver:
        return ShmReceiver(plan, rank, shards, descriptors, self.job)

    def _receive(self, link: PeerLink, deadline: float) -> TransferStats:
        return self.receiver.run(link.count, deadline, link.check_senders, link.version)

    def applied(self) -> None:
        """Every receiver mapped this plan's segment: its name can go (the mappings stay)."""
        if self.sender is not None:
            self.sender.segment.unlink()

    def abort(self) -> None:
        """A failed version: both sides start over with a new segment (a receiver may hold a half-filled one)."""
        held = self.sender is not None or self.receiver is not None
        self._release()
        self._next = None
        if held:
            sweep_stale()  # a sender killed before it removed its segment's name
