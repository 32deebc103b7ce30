"""Point-to-point execution of one rank's share of a plan, wave by wave.

For every wave of the plan (:mod:`awex.meta.schedule`) a rank packs what it sends into a staging buffer (one
contiguous message per peer for the small transfers; large ones go straight from and into the engines' memory
where it is contiguous, :func:`bucket_messages`), posts all its sends and receives of the wave at once (on
NCCL one grouped call, so every link is busy), and copies what it received into its views (in place). On CUDA
the waves are
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
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from awex.meta import Bucket, Plan
from awex.meta.errors import AwexValueError
from awex.meta.plan import RELAY_LAG, Step, Transfer
from awex.transport.accelerator import GROUPED, device_api, is_accelerator
from awex.transport.base import TransferError, TransferStats, TransferTimeout
from awex.transport.copies import copier, merge_copies
from awex.transport.deadline import WATCH_SECONDS, timed_out, wait_group_event
from awex.transport.group import SyncGroup
from awex.transport.messages import align, message_offsets
from awex.transport.p2p.digesting import WaveDigests
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")


def bucket_messages(bucket: Bucket, direct_bytes: int | None) -> list[tuple[Transfer, ...]]:
    """The messages a bucket travels as, the same on both ends: its transfers under ``direct_bytes`` (the
    plan's :attr:`~awex.meta.PlanOptions.direct_bytes`) packed together (first), then each larger transfer
    alone, in plan order.

    A message that is one transfer can be sent straight out of the sender's memory and received straight
    into the receiver's where that side's view of it is contiguous (each side decides for itself), skipping
    the staging copies, which cost a large sync several percent (measured: docs/performance.md).
    """
    if direct_bytes is None:
        return [bucket.transfers]
    small = tuple(t for t in bucket.transfers if t.nbytes < direct_bytes)
    large = [(t,) for t in bucket.transfers if t.nbytes >= direct_bytes]
    return ([small] if small else []) + large


@dataclass
class _Wave:
    index: int
    sends: list[tuple[int, torch.Tensor, int]]  # (peer, message, payload bytes)
    recvs: list[tuple[int, torch.Tensor, int]]
    pack: list[Callable[[], None]]  # copies of native views into the staging buffer
    unpack: list[Callable[[], None]]  # copies out of the staging buffer into native views
    broadcasts: list[tuple[tuple[int, ...], int, torch.Tensor, int]] = field(default_factory=list)
    # (members, root, message, payload bytes), in the plan's global order


def broadcast_groups(plan: Plan) -> dict[tuple[int, int, tuple[Transfer, ...]], tuple[int, ...]]:
    """``(wave, source, transfers) -> members`` (the source and its destinations, sorted) for the buckets of a
    :attr:`~awex.meta.PlanOptions.broadcast` plan that one source sends alike to several destinations in one
    wave: each goes as one broadcast. Empty for other plans. The same on every rank."""
    if not plan.options.broadcast:
        return {}
    dsts: dict[tuple[int, int, tuple[Transfer, ...]], list[int]] = {}
    for b in plan.buckets:
        dsts.setdefault((b.wave, b.src, b.transfers), []).append(b.dst)
    return {key: tuple(sorted({key[1], *ds})) for key, ds in dsts.items() if len(ds) > 1}


class WaveExecutor:
    """One rank's share of one plan over one group, with everything built once (steady state).

    Each bucket travels as one or more messages (:func:`bucket_messages`); a message that is one transfer
    whose view on this rank is contiguous goes straight from or into that view, every other one through a
    region of the staging buffer.
    """

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, group: SyncGroup):
        if plan.quantized:
            raise AwexValueError(
                f"this plan has receivers quantise {len(plan.quantized)} weight(s) on the copy: CUDA IPC only "
                "(quantise on the sender for point to point)"
            )
        self.plan = plan
        self.rank = rank
        self.group = group
        self.device = shards.device
        dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
        names = [t.name for t in plan.tensors]
        Entry = tuple[Step, list[tuple[tuple[Transfer, ...], torch.Tensor | None]], tuple[int, ...] | None]
        by_wave: dict[int, list[Entry]] = {}
        direct_bytes = plan.options.direct_bytes
        groups = broadcast_groups(plan)
        for members in sorted(set(groups.values())):  # same order on every rank: NCCL initialises collectively
            if rank in members:
                group.subgroup(members)
        rooted: set[tuple] = set()
        for step in plan.schedule(rank):
            b = step.bucket
            members = groups.get((b.wave, b.src, b.transfers))
            if members is not None and step.op == "send":
                if (b.wave, b.transfers) in rooted:
                    continue  # one broadcast serves every destination
                rooted.add((b.wave, b.transfers))
            messages = [
                (
                    m,
                    self._direct(shards, names[m[0].tensor], m[0], dtypes[m[0].tensor])
                    if len(m) == 1 and direct_bytes is not None
                    else None,
                )
                for m in bucket_messages(b, direct_bytes)
            ]
            by_wave.setdefault(b.wave, []).append((step, messages, members))
        sizes = {
            w: sum(align(message_offsets(m)[1]) for _, ms, _ in steps for m, direct in ms if direct is None)
            for w, steps in by_wave.items()
        }
        slot = max(sizes.values(), default=0)
        self.slots = 2 if is_accelerator(self.device) and len(by_wave) > 1 else 1
        self.staging = torch.empty(slot * self.slots, dtype=torch.uint8, device=self.device)
        self.waves: list[_Wave] = []
        self.sent_regions: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = []
        self.direct_bytes = 0
        for i, w in enumerate(sorted(by_wave)):
            base = (i % self.slots) * slot
            wave = _Wave(w, [], [], [], [])
            pack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging view, native view)
            unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (native view, staging view)
            pos = base
            for step, messages, members in by_wave[w]:
                for transfers, direct in messages:
                    size = sum(t.nbytes for t in transfers)
                    if direct is not None:
                        message = direct
                        self.direct_bytes += size
                    else:
                        offsets, nbytes = message_offsets(transfers)
                        message = self.staging[pos : pos + nbytes]
                        pos += align(nbytes)
                        for t, off in zip(transfers, offsets):
                            region = message[off : off + t.nbytes].view(dtypes[t.tensor]).view(t.sizes)
                            for here, piece in shards.pieces(names[t.tensor], t.offsets, t.sizes):
                                part = region[here] if here else region
                                if step.op == "send":
                                    pack.append((part, piece))
                                else:
                                    unpack.append((piece, part))
                    if members is not None:
                        wave.broadcasts.append((members, step.bucket.src, message, size))
                    else:
                        (wave.sends if step.op == "send" else wave.recvs).append((step.peer, message, size))
            wave.broadcasts.sort(key=lambda x: (x[0], x[1]))  # the global order (stable: plan order within)
            wave.pack = [copier(d, s) for d, s in merge_copies(pack)]
            wave.unpack = [copier(d, s) for d, s in merge_copies(unpack)]
            self.waves.append(wave)
            self.sent_regions.append(
                [
                    (names[t.tensor], t.offsets, t.sizes)
                    for step, _, _ in by_wave[w]
                    if step.op == "send"
                    for t in step.bucket.transfers
                ]
            )
        self.bytes_sent = sum(n for w in self.waves for _, _, n in w.sends) + sum(
            n for w in self.waves for _, root, _, n in w.broadcasts if root == rank
        )
        self.bytes_received = sum(n for w in self.waves for _, _, n in w.recvs) + sum(
            n for w in self.waves for _, root, _, n in w.broadcasts if root != rank
        )
        self.buckets = sum(len(steps) for steps in by_wave.values())

    @staticmethod
    def _direct(shards: LocalShards, name: str, t: Transfer, wire: torch.dtype) -> torch.Tensor | None:
        """This rank's view of transfer ``t`` as flat bytes, where it is one contiguous piece of the wire dtype."""
        pieces = shards.pieces(name, t.offsets, t.sizes)
        if len(pieces) != 1:
            return None
        here, view = pieces[0]
        if here and any(s != slice(0, n) for s, n in zip(here, t.sizes)):
            return None
        if view.dtype != wire or not view.is_contiguous() or view.dim() == 0 or view.device != shards.device:
            return None  # (views in pinned host memory: through the staging on the rank's GPU)
        return view.view(torch.uint8).view(-1)

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    def run(
        self,
        timeout: float = 300.0,
        before_pack: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
        digests: WaveDigests | None = None,
        watch: Callable[[], None] | None = None,
    ) -> TransferStats:
        """Send and receive this rank's share within ``timeout`` seconds.

        ``before_pack(i)`` runs just before wave ``i`` (of :attr:`waves`) is packed, on the packing stream: a
        sender that derives what it sends (FP8 quantisation) prepares what wave ``i`` sends there
        (:attr:`sent_regions`), overlapping the previous waves on the wire. ``meanwhile`` runs once, when the host
        would first wait for the wire (the first waves posted), so that it overlaps the transfer. ``digests``
        (verify mode, built for this plan and views): each wave's regions are digested as it is posted or unpacked.
        ``watch`` (on a device, while the host waits for a wave): what it raises aborts the group and fails the
        transfer (:meth:`PeerLink.watch`: a sender that withheld the version never sends).
        """
        started = time.monotonic()
        deadline = started + timeout
        pending = [meanwhile] if meanwhile is not None else []
        if is_accelerator(self.device):
            self.group.follow_deadline(timeout)
            self._run_device(deadline, timeout, before_pack, pending, digests, watch)
        else:
            self._run_blocking(deadline, timeout, before_pack, pending, digests)
        _run_pending(pending)  # no wave to wait for
        stats = TransferStats(
            self.bytes_sent,
            self.bytes_received,
            self.buckets,
            len(self.waves),
            self.staging_bytes,
            time.monotonic() - started,
        )
        log.debug(
            "rank %d: %d waves, %d buckets, sent %d B, received %d B in %.3f s",
            self.rank,
            stats.waves,
            stats.buckets,
            stats.bytes_sent,
            stats.bytes_received,
            stats.seconds,
        )
        return stats

    def _what(self, wave: _Wave) -> str:
        peers = sorted(
            {p for p, _, _ in wave.sends}
            | {p for p, _, _ in wave.recvs}
            | {m for ms, _, _, _ in wave.broadcasts for m in ms if m != self.rank}
        )
        size = (
            sum(n for _, _, n in wave.sends)
            + sum(n for _, _, n in wave.recvs)
            + sum(n for _, _, _, n in wave.broadcasts)
        )
        return f"rank {self.rank}: wave {wave.index} ({size} bytes with rank(s) {peers})"

    def _post(self, wave: _Wave, deadline: float, timeout: float) -> list[tuple[object, str]]:
        """Post the wave: its point-to-point messages as one group, then its broadcasts (in the plan's global
        order on every rank, so ranks meet on each communicator in the same order). ``(work, what)`` pairs."""
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{self._what(wave)}: the sync's {timeout:g} s deadline passed")
        try:
            works = self.group.exchange([(m, p) for p, m, _ in wave.sends], [(m, p) for p, m, _ in wave.recvs])
            labels = (
                ["the grouped sends and receives"]
                if self.group.backend in GROUPED
                else [f"send to rank {p}" for p, _, _ in wave.sends] + [f"recv from rank {p}" for p, _, _ in wave.recvs]
            )
            out = list(zip(works, labels))
            for members, root, message, _ in wave.broadcasts:
                work = self.group.broadcast(members, message, root)
                out.append((work, f"broadcast from rank {root} to ranks {[m for m in members if m != root]}"))
            return out
        except RuntimeError as e:
            raise TransferError(f"{self._what(wave)} failed: {e}") from e

    def _run_blocking(
        self,
        deadline: float,
        timeout: float,
        before_pack: Callable[[int], None] | None,
        pending: list,
        digests: WaveDigests | None,
    ) -> None:
        """CPU tensors (gloo): pack, post the wave, wait for every operation, unpack."""
        if digests is not None:
            digests.zero()
        for i, wave in enumerate(self.waves):
            if before_pack is not None:
                before_pack(i)
            for copy in wave.pack:
                copy()
            posted = self._post(wave, deadline, timeout)
            _run_pending(pending)
            if digests is not None:
                digests.sent(wave.index)
            for work, op in posted:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise RuntimeError("timed out")
                    work.wait(timedelta(seconds=left))
                except RuntimeError as e:
                    if timed_out(e, deadline):
                        raise TransferTimeout(
                            f"{self._what(wave)}: {op} not done within the sync's {timeout:g} s deadline: {e}"
                        ) from e
                    raise TransferError(f"{self._what(wave)}: {op} failed: {e}") from e
            for copy in wave.unpack:
                copy()
            if digests is not None:
                digests.received(wave.index)
        if digests is not None:
            digests.wait()

    def _run_device(
        self,
        deadline: float,
        timeout: float,
        before_pack: Callable[[int], None] | None,
        pending: list,
        digests: WaveDigests | None,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """CUDA (NCCL) or NPU (HCCL) tensors: double-buffered waves on a pack and an unpack stream, host at most two
        waves ahead."""
        api = device_api(self.device)
        compute = api.current_stream(self.device)
        pack_stream = api.Stream(self.device)
        unpack_stream = api.Stream(self.device)
        pack_stream.wait_stream(compute)  # the trainer's last writes land before we read
        unpack_stream.wait_stream(compute)
        if digests is not None:
            digests.zero(compute)
        done: list = []  # events of the device API
        relay_ready = 0  # number of this rank's waves at least RELAY_LAG global waves before the current one
        for i, wave in enumerate(self.waves):
            if i >= self.slots:
                _run_pending(pending)  # the first waves are on the wire
                self._wait(done[i - self.slots], wave, deadline, timeout, watch)  # its slot is free again
            while relay_ready < i and self.waves[relay_ready].index <= wave.index - RELAY_LAG:
                relay_ready += 1
            if relay_ready:  # what this wave relays was received in those waves: unpacked before we pack
                pack_stream.wait_event(done[relay_ready - 1])
            with api.stream(pack_stream):
                if before_pack is not None:
                    before_pack(i)
                for copy in wave.pack:
                    copy()
                works = self._post(wave, deadline, timeout)
            if digests is not None:
                digests.sent(wave.index, pack_stream)
            with api.stream(unpack_stream):
                for work, _ in works:
                    work.wait()  # the unpack stream waits for the wave on the device, the host goes on
                for copy in wave.unpack:
                    copy()
                event = api.Event()
                event.record(unpack_stream)
                done.append(event)
            if digests is not None:
                digests.received(wave.index, unpack_stream)
        if done:
            _run_pending(pending)
            self._wait(done[-1], self.waves[-1], deadline, timeout, watch)
        error = self.group.error()  # a communicator aborted by PyTorch's watchdog ends its kernels early
        if error is not None:
            raise TransferError(f"rank {self.rank}: the sync group reported {error} during the sync")
        compute.wait_stream(unpack_stream)
        if digests is not None:
            digests.wait(compute)

    def _wait(self, event, wave: _Wave, deadline: float, timeout: float, watch=None, every=WATCH_SECONDS) -> None:
        wait_group_event(event, self.group, self._what(wave), deadline, timeout, watch, every)


def _run_pending(pending: list) -> None:
    """Run the work waiting in ``pending`` (at most one callable), once."""
    while pending:
        pending.pop()()


def run_p2p(plan: Plan, rank: int, shards: LocalShards, group: SyncGroup, timeout: float = 300.0) -> TransferStats:
    """Execute ``rank``'s sends and receives of ``plan`` over ``group`` within ``timeout`` seconds (one-off)."""
    return WaveExecutor(plan, rank, shards, group).run(timeout)
