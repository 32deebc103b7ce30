"""A receiver's copies for one plan, straight from its sources' memory: peer DMAs into a bounce ring and
placements out of it, captured as one CUDA graph."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from awex.meta import Plan
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferStats, TransferTimeout
from awex.transport.batched_copy import (
    ROW_BLOCK_MIN,
    BatchedCopy,
    batchable,
    row_copy,
    row_reads,
    split_batchable,
    triton_available,
)
from awex.transport.copies import copier, merge_copies
from awex.transport.deadline import wait_event
from awex.transport.digest import Digest
from awex.transport.ipc.digesting import DIGEST_GROUPS, ReceivedDigests, byte_groups
from awex.transport.ipc.fp8_on_copy import Quantize, quantizers
from awex.transport.ipc.mapping import MappedShards
from awex.transport.ipc.options import IpcOptions
from awex.transport.ipc.pairing import Pair, pair_pieces
from awex.transport.ipc.remote import Copy, plan_remote
from awex.transport.ipc.scheduling import interleave_by_source, paces_local
from awex.transport.ipc.spans import balance, captured, in_chunks, nbytes_of
from awex.transport.peer_dma import (
    enable_peer_access,
    pull,
    pull_bytes,
)
from awex.transport.shards import LocalShards

READ_CHUNK = 2 << 20  # kernels reading several GPUs take them in turn by pieces of this many bytes (in_chunks)

log = logging.getLogger("awex.transport")


class IpcExecutor:
    """A receiver's copies for one plan, straight from its sources' memory (built once, run every sync).

    The whole sync (every DMA and copy, on all its streams) is captured into one CUDA graph at the first run and
    replayed after (``cuda_graph``), so a sync of thousands of pieces costs one launch on the host. Copies from
    another GPU's memory are DMAs issued on this GPU
    (copy engines pulling over NVLink, :mod:`awex.transport.peer_dma`). Many small DMAs cost more than a few
    large ones, and only contiguous memory can be DMA'd, so the pieces read from one mapped allocation are
    fetched as contiguous spans of up to ``bounce_bytes`` (gaps of unneeded bytes up to ``max_gap_bytes``
    included) into a bounce ring and placed from there by local copies. Spans go end to end around the ring
    (:func:`ring_slots`; ``bounce_buffers`` times the largest span) and alternate between ``dma_streams``
    streams, so the next DMAs overlap the last placements, many at once where spans are small; a
    piece alone in its span goes as its own DMA straight into place (sending every large contiguous piece straight
    into place was slower: more, smaller DMAs). Staging is at most ``bounce_buffers * bounce_bytes``, sized to the
    largest span actually needed. The knobs are :class:`~awex.transport.ipc.options.IpcOptions`.
    With ``pace_local`` the same-GPU copies run in slices between placements rather than all at once; by default
    (``None``) they are paced where the peer DMAs are the longer part of the sync (:func:`paces_local`). Same-GPU
    copies that are contiguous and 16-byte aligned go, each slice, as one kernel launch
    (:class:`~awex.transport.batched_copy.BatchedCopy`; ``batched_copy=None``: where Triton is installed), the
    others over ``local_branches`` streams. Where the same-GPU copies are the longer part (not paced), the
    contiguous pieces from other GPUs join that launch instead of going as DMAs: the kernel reads them over
    NVLink, their blocks spread among the local ones (the copy engines' writes into a GPU whose memory a kernel
    saturates stall it more than the same bytes read by the kernel). With ``kernel_reads`` (by default where this
    receiver reads from more than one other GPU) this GPU's kernels read every piece from other GPUs instead of its
    copy engines: the pieces that can go straight into place as one launch, those whose rows are contiguous but not
    the whole (row-parallel halves) row by row straight into place as another, each span into the ring as one (copy
    engines pulling from two GPUs while another GPU pulls from the same two moved half the link rate; kernels
    reading the same pattern 0.95x of it: docs/performance.md). Pieces
    that go as their own DMA are dealt to ``direct_streams`` streams (balanced by bytes). The defaults were
    measured: docs/performance.md. With ``digest`` (verify mode) the run also digests what it copied, per origin
    (:meth:`received_digests`): the batched copies as they write (:mod:`awex.transport.ipc.digesting`).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        shards: LocalShards,
        sources: dict[int, LocalShards],
        options: IpcOptions | None = None,
        quantize: Quantize | None = None,
        digest: bool = False,
        pairs: list[Pair] | None = None,
    ):
        o = options or IpcOptions()
        cuda_graph = o.cuda_graph
        dma_streams, local_branches, pace_local = o.dma_streams, o.local_branches, o.pace_local
        direct_streams, batched_copy = o.direct_streams, o.batched_copy
        self.plan = plan
        self.cuda_graph = cuda_graph
        self.capture_seconds = 0.0  # how long the first run spent capturing the sync as a CUDA graph
        self._last_seconds = 0.0  # the last run's duration
        self.rank = rank
        self.device = shards.device
        origins = sorted({s.peer for s in plan.schedule(rank)})
        self.digest = ReceivedDigests(self.device, origins) if digest else None
        if plan.quantized and shards.on_host:
            raise AwexValueError(
                f"rank {rank}: the plan quantises {len(plan.quantized)} weight(s) on receive, into views in host "
                "memory: quantising on receive writes on the GPU (stage on the GPU, or quantise on the sender)"
            )
        if plan.quantized and quantize is None:
            raise AwexValueError(
                f"rank {rank}: the plan quantises {len(plan.quantized)} weight(s) on receive: give quantize="
            )
        paired = pair_pieces(plan, rank, shards, sources, self.digest, pairs)
        self.copies, to_quantize, self.bytes_received = paired.copies, paired.to_quantize, paired.nbytes
        # what a later build over these views may re-point at its sources' new memory (plain copies only)
        self.pairs = list(self.copies) if not plan.quantized and self.digest is None else None
        self.sources = dict(sources)  # what the pairs were made over
        # read the source, write tiles and scales: one launch per tile block
        self._quantize: list[Callable[[], None]] = quantizers(to_quantize, quantize) if to_quantize else []
        self.copies = merge_copies(self.copies) if self.digest is None else self.copies
        # from another GPU: peer DMAs; views in pinned host memory (shards.on_host) take this GPU's copies
        self._remote = [(d, s) for d, s in self.copies if s.device != self.device]
        self._local = [(d, s) for d, s in self.copies if s.device == self.device]
        if self._remote and self.device.type != "cuda":
            raise AwexValueError(f"rank {rank}: copies between devices need CUDA, this rank is on {self.device}")
        for peer in {s.device for _, s in self._remote}:
            enable_peer_access(self.device, peer)
        if batched_copy is None:
            batched_copy = triton_available()
        if pace_local is None:
            pace_local = paces_local(nbytes_of(self._remote), nbytes_of(self._local))
        # Where the same-GPU copies are the longer part, the pieces from other GPUs that can ride along are read
        # by the same kernel launch over NVLink (see BatchedCopy's `spread`), the rest go as DMAs.
        self._mapped = [x for x in sources.values() if isinstance(x, MappedShards)]  # kept: their mappings
        kernel_reads = o.kernel_reads
        if kernel_reads is None:  # see IpcOptions.kernel_reads
            kernel_reads = bool(batched_copy) and len({s.device for _, s in self._remote}) > 1
        self._read_in_kernel, self._kernel_sources = [], []
        if batched_copy and not pace_local and self._local:
            self._read_in_kernel, self._kernel_sources, self._remote = self._kernel_readable(self._remote)
        far, far_at, rows, rows_at = [], [], [], []
        if kernel_reads and batched_copy:
            far, far_at, self._remote = self._kernel_readable(self._remote)
            far, far_at = self._by_source(far, far_at)  # every source read evenly through the launch
            if self.digest is None:  # strided pieces whose rows are contiguous: row by row, not through the ring
                rows, rows_at, self._remote = self._kernel_readable(self._remote, by_row=True)
                rows, rows_at = self._by_source(rows, rows_at)
        remote = plan_remote(self._remote, sources, self.device, o, batched_copy, rank, self.digest)
        self._direct, self._spans, self._ring = remote.direct, remote.spans, remote.ring
        # kernel reads: the pieces that can go straight into place as one launch, the spans into the ring each as one
        self._far_reads = self._batched([], far, far_at) if far else None
        self._row_reads = row_reads(rows, rows_at) if rows else None
        self._span_reads = [self._span_read(span) for span in self._spans] if kernel_reads and batched_copy else []
        self.staging_bytes = self._ring.numel()
        self.buckets = len(plan.schedule(rank))
        self._direct_lanes = balance(self._direct, min(direct_streams, len(self._direct)))
        if self.device.type == "cuda":
            self._streams = {k: torch.cuda.Stream(self.device) for k in ("place", "local", "quantize", "far", "rows")}
            self._direct_streams = [torch.cuda.Stream(self.device) for _ in self._direct_lanes]
            self._dma_streams = [torch.cuda.Stream(self.device) for _ in range(dma_streams)]
            self._branches = [torch.cuda.Stream(self.device) for _ in range(min(local_branches, len(self._local)))]
            # With peer DMAs running, the same-GPU copies go in slices between span placements: run all at once
            # they saturate this GPU's memory for a few ms and the DMAs into it stall meanwhile.
            self.pace_local = pace_local and bool(self._spans) and bool(self._local)
            chunks = min(8, len(self._spans)) if self.pace_local else 1
            self._local_chunks, self._local_batched = [], []
            for chunk in balance(self._local, chunks):
                together, apart = split_batchable(chunk) if batched_copy else ([], chunk)
                far, at = (
                    (self._read_in_kernel, self._kernel_sources)
                    if not self._local_batched  # not paced:
                    else ([], [])
                )  # one chunk
                self._local_batched.append(self._batched(together, far, at))
                self._local_chunks.append(balance(apart, len(self._branches)))
            self._graphs: list[torch.cuda.CUDAGraph | None] = [None] * len(self._local_chunks)
        # verify mode: what lands from other GPUs is digested a group at a time while the rest still moves
        groups = DIGEST_GROUPS if self.digest is not None and self.device.type == "cuda" else 1
        self._lane_groups = [[(g, self._group(g)) for g in byte_groups(lane, groups)] for lane in self._direct_lanes]
        ends = byte_groups([(s.nbytes, i) for i, s in enumerate(self._spans)], groups, size=lambda x: x[0])
        self._span_groups = {g[-1][1]: self._group([(d, 0) for _, i in g for d in self._spans[i].dsts]) for g in ends}
        if self.digest is not None:
            self.digest.seal()
        self._whole: torch.cuda.CUDAGraph | None = None
        self._whole_failed = False
        self._capturing = False

    def run(self, timeout: float = 300.0, meanwhile: Callable[[], None] | None = None) -> TransferStats:
        """Copy everything; returns when it is done (or raises after ``timeout``). ``meanwhile`` runs once the
        copies are enqueued, before waiting for them.

        Streams overlap: single-piece peer DMAs, span DMAs into the bounce buffers, placements out of them, and
        the same-GPU copies; after the first sync all of it is one CUDA graph replay (``cuda_graph``).
        """
        started = time.monotonic()
        compute = torch.cuda.current_stream(self.device)
        if self.cuda_graph and self._whole is None and not self._whole_failed:
            self._whole = self._capture(compute)
            self.capture_seconds = time.monotonic() - started
        if self._whole is not None:
            self._whole.replay()
            used = [compute]
        else:
            used = self._issue(compute)
        if meanwhile is not None:
            meanwhile()
        deadline = started + timeout
        expect_at = started + self._last_seconds  # a steady sync takes about as long as the last one
        for stream in used:
            done = torch.cuda.Event()
            done.record(stream)
            wait_event(
                done,
                deadline,
                lambda: TransferTimeout(f"rank {self.rank}: CUDA IPC copies not done within {timeout:g} s"),
                expect_at=expect_at,
            )
        for stream in used:
            compute.wait_stream(stream)
        if self.digest is not None:
            self.digest.fresh = True
        seconds = time.monotonic() - started
        self._last_seconds = seconds
        return TransferStats(bytes_received=self.bytes_received, buckets=self.buckets, waves=1, seconds=seconds)

    def received_digests(self) -> dict[int, Digest] | None:
        """With ``digest``: per origin sync rank, the digest of what the last run copied into this rank's views
        (once per run); else ``None``."""
        return self.digest.read() if self.digest is not None and self.digest.fresh else None

    def _group(self, copies) -> int | None:
        return None if self.digest is None else self.digest.group([d for d, _ in copies])

    def _landed(self, group: int | None, stream: torch.cuda.Stream, used: list[torch.cuda.Stream]) -> None:
        behind = None if group is None else self.digest.landed(group, stream)
        if behind is not None and behind not in used:
            used.append(behind)

    def _batched(self, copies, spread, spread_sources) -> Callable[[], None] | None:
        if self.digest is not None:
            return self.digest.batched(copies, spread, spread_sources)
        return BatchedCopy(copies, spread=spread, spread_sources=spread_sources) if copies or spread else None

    def _issue(self, compute: torch.cuda.Stream) -> list[torch.cuda.Stream]:
        """Enqueue the whole sync after ``compute``'s work (current); returns the streams it ran on."""
        if self.digest is not None:
            self.digest.zero()
        used = []
        for stream, lane in zip(self._direct_streams, self._lane_groups):
            stream.wait_stream(compute)
            used.append(stream)
            with torch.cuda.stream(stream):
                for copies, group in lane:
                    for d, s in copies:
                        self._peer_copy(d, s, stream)
                    self._landed(group, stream, used)
        for key, launch in (("far", self._far_reads), ("rows", self._row_reads)):
            if launch is not None:
                stream = self._streams[key]
                stream.wait_stream(compute)
                with torch.cuda.stream(stream):
                    launch()
                used.append(stream)
        if self._spans:
            used += self._copy_spans(compute)
        if self._local and not self.pace_local:
            stream = self._streams["local"]
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for chunk in range(len(self._local_chunks)):
                    self._copy_local(chunk, stream)
            used.append(stream)
        if self._quantize:
            stream = self._streams["quantize"]
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for op in self._quantize:
                    op()
            used.append(stream)
        return used

    def _capture(self, compute: torch.cuda.Stream) -> torch.cuda.CUDAGraph | None:
        """The whole sync as one CUDA graph (its streams forked from and joined back into one capture stream), or
        ``None`` where capture fails (then every sync is issued eagerly, same-GPU copies still from graphs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(compute)
        self._capturing = True

        def whole_sync():
            for stream in self._issue(side):
                side.wait_stream(stream)

        try:
            return captured(whole_sync, side)
        except RuntimeError as e:  # capture is an optimisation: issue eagerly instead
            log.warning("rank %d: CUDA graph capture of the IPC sync failed (%s); issuing it eagerly", self.rank, e)
            self._whole_failed = True
            return None
        finally:
            self._capturing = False

    def _copy_spans(self, compute: torch.cuda.Stream) -> list[torch.cuda.Stream]:
        """Span DMAs round-robin on the DMA streams (several in flight hide each DMA's start-up), placements on
        one stream; a part of the ring is refilled only once what it held has been placed."""
        place = self._streams["place"]
        used = [*self._dma_streams[: len(self._spans)], place]
        for stream in used:
            stream.wait_stream(compute)
        placed: list[torch.cuda.Event] = []
        local_at = (
            {}
            if not self.pace_local
            else {j * len(self._spans) // len(self._local_chunks): j for j in range(len(self._local_chunks))}
        )
        for i, span in enumerate(self._spans):
            dma = self._dma_streams[i % len(self._dma_streams)]
            landed = torch.cuda.Event()
            with torch.cuda.stream(dma):
                if span.after is not None:
                    dma.wait_event(placed[span.after])
                if self._span_reads and self._span_reads[i] is not None:
                    self._span_reads[i]()
                else:
                    pull_bytes(self._ring.data_ptr() + span.offset, span.source, span.nbytes, dma)
                landed.record(dma)
            with torch.cuda.stream(place):
                place.wait_event(landed)
                for copy in span.placed:
                    copy()
                free = torch.cuda.Event()
                free.record(place)
                placed.append(free)
                self._landed(self._span_groups.get(i), place, used)
                if i in local_at:
                    self._copy_local(local_at[i], place)
        return used

    def _kernel_address(self, pointer: int) -> int | None:
        """Where this GPU's kernels read the byte at ``pointer`` (memory of another GPU), or ``None`` where they
        cannot."""
        for mapped in self._mapped:
            if mapped.region_of(pointer) is not None:
                return mapped.kernel_address(pointer, self.device)
        return pointer  # this process's own memory: readable with peer access (enabled above)

    def _kernel_readable(self, copies: list[Copy], by_row: bool = False) -> tuple[list[Copy], list[int], list[Copy]]:
        """``(copies this GPU's kernels can read, the addresses they read them at, the rest)``; ``by_row``: those
        that can go row by row (:func:`row_copy`; rows too short for a block of :data:`ROW_BLOCK_MIN` stay)."""
        yes, at, rest = [], [], []
        for d, s in copies:
            if by_row:
                shape = row_copy(d, s)
                readable = shape is not None and shape[1] % ROW_BLOCK_MIN == 0
            else:
                readable = batchable(d, s, peer=True)
            address = self._kernel_address(s.data_ptr()) if readable else None
            if address is not None and address % 16 == 0:
                yes.append((d, s))
                at.append(address)
            else:
                rest.append((d, s))
        return yes, at, rest

    def _by_source(self, copies: list[Copy], at: list[int]) -> tuple[list[Copy], list[int]]:
        """Copies (with their read addresses) in the order that reads every source evenly through a launch, in
        pieces of :data:`READ_CHUNK` bytes (outside verify mode, whose digests follow the plan's pieces)."""
        if self.digest is None:
            copies, at = in_chunks(copies, at, READ_CHUNK)
        order = interleave_by_source(
            list(zip(copies, at)), lambda x: x[0][1].device, lambda x: x[0][0].nbytes, self.rank
        )
        return [c for c, _ in order], [a for _, a in order]

    def _span_read(self, span) -> Callable[[], None] | None:
        """A span pulled into the ring by one kernel launch (``None``: a DMA pulls it)."""
        ring = self._ring[span.offset : span.offset + span.nbytes]
        address = self._kernel_address(span.source)
        if address is None or not batchable(ring, ring) or address % 16:
            return None
        return BatchedCopy([], spread=[(ring, ring)], spread_sources=[address])  # (reads at `address`)

    def _peer_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            pull(dst, src, stream)  # issued in this GPU's context (see awex.transport.peer_dma)
        else:  # only pieces too large for a bounce buffer and not contiguous (PyTorch's copy kernel)
            dst.copy_(src, non_blocking=True)

    def _copy_local(self, chunk: int, stream: torch.cuda.Stream) -> None:
        """One slice of the same-GPU copies, replayed from a CUDA graph captured on first use.

        The slice's copies are dealt to a few branches (streams forked from ``stream``, balanced by bytes), so
        one copy's tail and the gaps between kernels overlap the next copies instead of adding up.
        """
        if not any(self._local_chunks[chunk]) and self._local_batched[chunk] is None:
            return
        if self._capturing:  # part of the whole sync's graph
            self._issue_local(chunk, stream)
            return
        if self._graphs[chunk] is None and self.cuda_graph:
            try:
                self._graphs[chunk] = captured(lambda: self._issue_local(chunk, stream), stream)
            except RuntimeError as e:  # capture is an optimisation: fall back to plain copies
                log.warning("rank %d: CUDA graph capture of IPC copies failed (%s); copying eagerly", self.rank, e)
                self.cuda_graph = False
        if self._graphs[chunk] is not None:
            self._graphs[chunk].replay()
        else:
            self._issue_local(chunk, stream)

    def _issue_local(self, chunk: int, stream: torch.cuda.Stream) -> None:
        lanes = [lane for lane in self._local_chunks[chunk] if lane]
        for branch, copies in zip(self._branches, lanes):
            branch.wait_stream(stream)
            with torch.cuda.stream(branch):
                for d, s in copies:
                    copier(d, s)()
        batched = self._local_batched[chunk]
        if batched is not None:
            with torch.cuda.stream(stream):
                batched()
        for branch in self._branches[: len(lanes)]:
            stream.wait_stream(branch)
