"""A sender's bytes laid out once by the plan, for transports whose receivers read what senders staged (shared
memory, RDMA): where each region lies, and the copies that fill such a buffer and empty it into views.

A sender's buffer holds each distinct region it sends once, however many receivers read it
(:func:`segment_layout`, a pure function of the plan: every rank computes where each region lies).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from math import prod

import torch

from awex.meta import Plan
from awex.transport.copies import copier, merge_copies
from awex.transport.shards import LocalShards, torch_dtype
from awex.transport.shards import extent as span

ALIGN = 64
RegionKey = tuple[int, tuple[int, ...], tuple[int, ...]]  # (plan tensor index, offsets, sizes)


def segment_layout(plan: Plan, rank: int) -> tuple[dict[RegionKey, int], int]:
    """Where each distinct region sync rank ``rank`` sends lies in its buffer (byte offsets, aligned), and the
    buffer's size. The same on every rank of the plan."""
    offsets: dict[RegionKey, int] = {}
    pos = 0
    for step in plan.schedule(rank):
        if step.op != "send":
            continue
        for t in step.bucket.transfers:
            key = (t.tensor, t.offsets, t.sizes)
            if key not in offsets:
                pos = -(-pos // ALIGN) * ALIGN
                offsets[key] = pos
                pos += t.nbytes
    return offsets, pos


def region_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor:
    """The region of ``sizes`` elements of ``dtype`` at byte ``offset`` of a flat byte ``buffer``."""
    return buffer[offset : offset + dtype.itemsize * prod(sizes)].view(dtype).view(sizes)


Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)


def fill_pairs(plan: Plan, rank: int, shards: LocalShards, buffer: torch.Tensor) -> list[Pair]:
    """The copies that write sender ``rank``'s regions from its views into ``buffer`` (laid out by
    :func:`segment_layout`), merged, in the buffer's order."""
    names = [t.name for t in plan.tensors]
    dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
    copies = []
    for (tensor, offs, sizes), at in sorted(segment_layout(plan, rank)[0].items(), key=lambda kv: kv[1]):
        region = region_view(buffer, at, dtypes[tensor], sizes)
        for here, piece in shards.pieces(names[tensor], offs, sizes):
            copies.append((region[here] if here else region, piece))
    return merge_copies(copies)


def empty_pairs(
    plan: Plan, rank: int, shards: LocalShards, where: Mapping[int, tuple[torch.Tensor, Mapping[RegionKey, int]]]
) -> list[tuple[int, Pair]]:
    """The copies that write receiver ``rank``'s regions into its views, merged, each with the peer it reads from;
    ``where[peer]`` is the buffer holding what ``peer`` sends it and each region's byte offset there."""
    names = [t.name for t in plan.tensors]
    dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
    out = []
    for peer in sorted({s.peer for s in plan.schedule(rank) if s.op == "recv"}):
        buffer, offsets = where[peer]
        copies = []
        for step in plan.schedule(rank):
            if step.op != "recv" or step.peer != peer:
                continue
            for t in step.bucket.transfers:
                region = region_view(buffer, offsets[(t.tensor, t.offsets, t.sizes)], dtypes[t.tensor], t.sizes)
                for here, piece in shards.pieces(names[t.tensor], t.offsets, t.sizes):
                    copies.append((piece, region[here] if here else region))
        out += [(peer, pair) for pair in merge_copies(copies)]
    return out


def fill_copies(plan: Plan, rank: int, shards: LocalShards, buffer: torch.Tensor) -> list[Callable[[], None]]:
    """:func:`fill_pairs` as copy functions."""
    return [copier(d, s) for d, s in fill_pairs(plan, rank, shards, buffer)]


def empty_copies(
    plan: Plan, rank: int, shards: LocalShards, where: Mapping[int, tuple[torch.Tensor, Mapping[RegionKey, int]]]
) -> list[Callable[[], None]]:
    """:func:`empty_pairs` as copy functions."""
    return [copier(d, s) for _, (d, s) in empty_pairs(plan, rank, shards, where)]


def extent(t: torch.Tensor, base: int) -> tuple[int, int]:
    """The byte range ``[start, end)`` that view ``t`` spans, relative to address ``base``."""
    if t.numel() == 0:
        return 0, 0
    start, end = span(t)
    return start - base, end - base
