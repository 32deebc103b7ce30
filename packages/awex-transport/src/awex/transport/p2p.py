"""Point-to-point execution of one rank's share of a plan, wave by wave.

For every wave of the plan (:mod:`awex.meta.schedule`) a rank packs what it sends into a staging buffer (one
contiguous message per peer), posts all its sends and receives of the wave at once (on NCCL one grouped call,
so every link is busy), and copies what it received into its views (in place). On CUDA the waves are
double-buffered on three streams: packing wave ``w + 1`` and unpacking wave ``w - 1`` overlap wave ``w`` on
the wire, and the host never runs more than two waves ahead. Staging is two slots of the largest wave
(bounded by the plan's ``wave_bytes``), allocated once.

Everything that does not change between syncs is built once in :class:`WaveExecutor` (the schedule, the
staging buffer, every copy's source and destination view), so a steady-state sync is a loop of copies and
grouped sends. Every wait has a deadline: a peer that dies or never arrives makes this rank raise
:class:`TransferError` / :class:`TransferTimeout`, never hang (on NCCL the group is aborted first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from awex.meta import Bucket, Plan
from awex.meta.plan import RELAY_LAG
from awex.transport.copies import copier, merge_copies
from awex.transport.deadline import wait_event
from awex.transport.group import SyncGroup
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")

ALIGN = 16


class TransferError(RuntimeError):
    """A send or receive failed (peer gone, connection closed, backend error)."""


class TransferTimeout(TransferError, TimeoutError):
    """The sync did not finish before its deadline."""


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    waves: int = 0
    staging_bytes: int = 0
    seconds: float = 0.0


def bucket_offsets(bucket: Bucket) -> tuple[list[int], int]:
    """Byte offset of each transfer inside the bucket's message, and the message size (aligned to ``ALIGN``)."""
    offsets = []
    pos = 0
    for t in bucket.transfers:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += t.nbytes
    return offsets, pos


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class _Wave:
    index: int
    sends: list[tuple[int, torch.Tensor, Bucket]]  # (peer, message, bucket)
    recvs: list[tuple[int, torch.Tensor, Bucket]]
    pack: list[Callable[[], None]]  # copies of native views into the staging buffer
    unpack: list[Callable[[], None]]  # copies out of the staging buffer into native views


class WaveExecutor:
    """One rank's share of one plan over one group, with everything built once (steady state)."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, group: SyncGroup, slots: int = 2):
        self.plan = plan
        self.rank = rank
        self.group = group
        self.device = shards.device
        dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
        names = [t.name for t in plan.tensors]
        by_wave: dict[int, list] = {}
        for step in plan.schedule(rank):
            by_wave.setdefault(step.bucket.wave, []).append(step)
        sizes = {w: sum(_align(bucket_offsets(s.bucket)[1]) for s in steps) for w, steps in by_wave.items()}
        slot = max(sizes.values(), default=0)
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = min(slots, len(by_wave)) if self.device.type == "cuda" and len(by_wave) > 1 else 1
        self.staging = torch.empty(slot * self.slots, dtype=torch.uint8, device=self.device)
        self.waves: list[_Wave] = []
        self.sent_regions: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = []
        for i, w in enumerate(sorted(by_wave)):
            base = (i % self.slots) * slot
            wave = _Wave(w, [], [], [], [])
            pack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging view, native view)
            unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (native view, staging view)
            pos = base
            for step in by_wave[w]:
                b = step.bucket
                offsets, nbytes = bucket_offsets(b)
                message = self.staging[pos:pos + nbytes]
                for t, off in zip(b.transfers, offsets):
                    region = message[off:off + t.nbytes].view(dtypes[t.tensor]).view(t.sizes)
                    for here, piece in shards.pieces(names[t.tensor], t.offsets, t.sizes):
                        part = region[here] if here else region
                        if step.op == "send":
                            pack.append((part, piece))
                        else:
                            unpack.append((piece, part))
                (wave.sends if step.op == "send" else wave.recvs).append((step.peer, message, b))
                pos += _align(nbytes)
            wave.pack = [copier(d, s) for d, s in merge_copies(pack)]
            wave.unpack = [copier(d, s) for d, s in merge_copies(unpack)]
            self.waves.append(wave)
            self.sent_regions.append([(names[t.tensor], t.offsets, t.sizes)
                                      for step in by_wave[w] if step.op == "send" for t in step.bucket.transfers])
        self.bytes_sent = sum(b.nbytes for w in self.waves for _, _, b in w.sends)
        self.bytes_received = sum(b.nbytes for w in self.waves for _, _, b in w.recvs)
        self.buckets = sum(len(w.sends) + len(w.recvs) for w in self.waves)

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    def run(self, timeout: float = 300.0, before_pack: Callable[[int], None] | None = None) -> TransferStats:
        """Send and receive this rank's share within ``timeout`` seconds.

        ``before_pack(i)`` runs just before wave ``i`` (of :attr:`waves`) is packed, on the packing stream: a
        sender that derives what it sends (FP8 quantisation) prepares what wave ``i`` sends there
        (:attr:`sent_regions`), overlapping the previous waves on the wire.
        """
        started = time.monotonic()
        deadline = started + timeout
        if self.device.type == "cuda":
            self._run_cuda(deadline, timeout, before_pack)
        else:
            self._run_blocking(deadline, timeout, before_pack)
        stats = TransferStats(self.bytes_sent, self.bytes_received, self.buckets, len(self.waves),
                              self.staging_bytes, time.monotonic() - started)
        log.debug("rank %d: %d waves, %d buckets, sent %d B, received %d B in %.3f s", self.rank, stats.waves,
                  stats.buckets, stats.bytes_sent, stats.bytes_received, stats.seconds)
        return stats

    def _what(self, wave: _Wave) -> str:
        peers = sorted({p for p, _, _ in wave.sends} | {p for p, _, _ in wave.recvs})
        size = sum(b.nbytes for _, _, b in wave.sends) + sum(b.nbytes for _, _, b in wave.recvs)
        return f"rank {self.rank}: wave {wave.index} ({size} bytes with rank(s) {peers})"

    def _post(self, wave: _Wave, deadline: float, timeout: float):
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{self._what(wave)}: the sync's {timeout:g} s deadline passed")
        try:
            return self.group.exchange([(m, p) for p, m, _ in wave.sends], [(m, p) for p, m, _ in wave.recvs])
        except RuntimeError as e:
            raise TransferError(f"{self._what(wave)} failed: {e}") from e

    def _run_blocking(self, deadline: float, timeout: float, before_pack: Callable[[int], None] | None) -> None:
        """CPU tensors (gloo): pack, post the wave, wait for every operation, unpack."""
        for i, wave in enumerate(self.waves):
            if before_pack is not None:
                before_pack(i)
            for copy in wave.pack:
                copy()
            works = self._post(wave, deadline, timeout)
            ops = [f"send to rank {p}" for p, _, _ in wave.sends] + [f"recv from rank {p}" for p, _, _ in wave.recvs]
            for work, op in zip(works, ops):
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise RuntimeError("timed out")
                    work.wait(timedelta(seconds=left))
                except RuntimeError as e:
                    text = str(e).lower()
                    late = time.monotonic() >= deadline or "timed out" in text or "timeout" in text
                    if late:
                        raise TransferTimeout(f"{self._what(wave)}: {op} not done within the sync's {timeout:g} s "
                                              f"deadline: {e}") from e
                    raise TransferError(f"{self._what(wave)}: {op} failed: {e}") from e
            for copy in wave.unpack:
                copy()

    def _run_cuda(self, deadline: float, timeout: float, before_pack: Callable[[int], None] | None) -> None:
        """CUDA tensors (NCCL): double-buffered waves on a pack and an unpack stream, host at most two waves ahead."""
        compute = torch.cuda.current_stream(self.device)
        pack_stream = torch.cuda.Stream(self.device)
        unpack_stream = torch.cuda.Stream(self.device)
        pack_stream.wait_stream(compute)  # the trainer's last writes land before we read
        unpack_stream.wait_stream(compute)
        done: list[torch.cuda.Event] = []
        relay_ready = 0  # number of this rank's waves at least RELAY_LAG global waves before the current one
        for i, wave in enumerate(self.waves):
            if i >= self.slots:
                self._wait(done[i - self.slots], wave, deadline, timeout)  # its slot is free again
            while relay_ready < i and self.waves[relay_ready].index <= wave.index - RELAY_LAG:
                relay_ready += 1
            if relay_ready:  # what this wave relays was received in those waves: unpacked before we pack
                pack_stream.wait_event(done[relay_ready - 1])
            with torch.cuda.stream(pack_stream):
                if before_pack is not None:
                    before_pack(i)
                for copy in wave.pack:
                    copy()
                works = self._post(wave, deadline, timeout)
            with torch.cuda.stream(unpack_stream):
                for work in works:
                    work.wait()  # the unpack stream waits for the wave on the device, the host goes on
                for copy in wave.unpack:
                    copy()
                event = torch.cuda.Event()
                event.record(unpack_stream)
                done.append(event)
        if done:
            self._wait(done[-1], self.waves[-1], deadline, timeout)
        compute.wait_stream(unpack_stream)

    def _wait(self, event: torch.cuda.Event, wave: _Wave, deadline: float, timeout: float) -> None:
        def timed_out() -> TransferTimeout:
            self.group.abort()
            return TransferTimeout(f"{self._what(wave)}: not done within the sync's {timeout:g} s deadline; "
                                   "the sync group was aborted")

        wait_event(event, deadline, timed_out)


def run_p2p(plan: Plan, rank: int, shards: LocalShards, group: SyncGroup, timeout: float = 300.0) -> TransferStats:
    """Execute ``rank``'s sends and receives of ``plan`` over ``group`` within ``timeout`` seconds (one-off)."""
    return WaveExecutor(plan, rank, shards, group).run(timeout)
