"""How a CUDA IPC receiver pulls its copies from other GPUs: pieces too large for the bounce ring, or alone in
their span, as their own DMAs; the rest as contiguous spans of a source allocation pulled into the ring and
placed from there (see :class:`~awex.transport.ipc.executor.IpcExecutor`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from awex.transport.copies import merge_copies
from awex.transport.ipc.digesting import ReceivedDigests
from awex.transport.ipc.mapping import MappedShards
from awex.transport.ipc.options import IpcOptions
from awex.transport.ipc.scheduling import interleave_by_source, ring_slots
from awex.transport.ipc.spans import Span, extent, placements, rows_within
from awex.transport.shards import LocalShards

Copy = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RemotePlan:
    direct: list[Copy]  # each its own DMA
    spans: list[Span]  # pulled into the ring in this order
    ring: torch.Tensor  # the bounce ring (bytes; empty where no span)


def plan_remote(
    remote: list[Copy],
    sources: dict[int, LocalShards],
    device: torch.device,
    o: IpcOptions,
    batched_copy: bool,
    rank: int,
    digest: ReceivedDigests | None = None,
) -> RemotePlan:
    """Cut the copies from other GPUs (``remote``) into direct DMAs and bounce-ring spans; with ``digest`` (verify
    mode) every copy cut into runs of rows is told to it (:meth:`ReceivedDigests.split`)."""
    regions = [x for x in sources.values() if isinstance(x, MappedShards)]

    def region_of(s: torch.Tensor) -> tuple[int, int]:
        for src in regions:
            found = src.region_of(s.data_ptr())
            if found is not None:
                return found
        st = s.untyped_storage()  # not opened over IPC: its own storage is what is known to be mapped
        return st.data_ptr(), st.data_ptr() + st.nbytes()

    direct: list[Copy] = []
    by_region: dict[tuple[int, int], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for whole, s in remote:
        parts = rows_within(whole, s, o.bounce_bytes)
        if digest is not None:  # digested part by part as they land
            digest.split(whole, [d for d, _ in parts])
        for d, s in parts:
            start, end = extent(s)
            if end - start > o.bounce_bytes:
                direct.append((d, s))
            else:
                by_region.setdefault(region_of(s), []).append((start, end, d, s))
    spans: list[tuple[int, int, list[Copy]]] = []
    for (region_lo, _), items in sorted(by_region.items()):
        items.sort(key=lambda x: x[0])
        lo = hi = -1
        cur: list[Copy] = []
        for start, end, d, s in items:
            if cur and (start - hi > o.max_gap_bytes or max(hi, end) - lo > o.bounce_bytes):
                spans.append((lo, hi, cur))
                cur = []
            if not cur:
                lo = max(start & ~15, region_lo)  # 16-byte aligned, so every dtype lands aligned
                hi = end
            cur.append((d, s))
            hi = max(hi, end)
        if cur:
            spans.append((lo, hi, cur))
    kept = []
    for lo, hi, items in spans:
        if len(items) == 1 and items[0][0].is_contiguous() and items[0][1].is_contiguous():
            direct.extend(items)  # already one DMA, no bounce needed
        elif any((s.data_ptr() - lo) % s.element_size() for _, s in items):
            direct.extend(items)  # cannot be placed from an aligned buffer (not seen in practice)
        else:
            kept.append((lo, hi, items))
    # Receivers pulling from several source GPUs (resharding with fan-out) read them all at once, each source's
    # spans spread evenly over the sync, and receivers start at different sources: pulling one source after
    # the other, every receiver would read the same source at the same time (its egress the bottleneck,
    # the other sources idle).
    kept = interleave_by_source(kept, lambda span: span[2][0][1].device, lambda span: span[1] - span[0], rank)
    largest = -(-max((hi - lo for lo, hi, _ in kept), default=0) // 16) * 16
    capacity = largest * min(o.bounce_buffers, len(kept))
    slots = ring_slots([hi - lo for lo, hi, _ in kept], capacity)
    ring = torch.empty(capacity, dtype=torch.uint8, device=device)
    out: list[Span] = []
    for (lo, hi, items), (offset, after) in zip(kept, slots):
        placed = [
            (d, ring.view(s.dtype).as_strided(s.shape, s.stride(), (offset + s.data_ptr() - lo) // s.element_size()))
            for d, s in items
        ]
        dsts = [d for d, _ in items]
        out.append(Span(lo, hi - lo, offset, after, placements(merge_copies(placed), batched_copy), dsts))
    return RemotePlan(direct, out, ring)
