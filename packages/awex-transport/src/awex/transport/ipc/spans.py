"""Pieces of the CUDA IPC executor's planning: where two pieces overlap, the spans a receiver pulls into its bounce
ring, how copies are cut to fit it and dealt to streams, and how a sync is captured as a CUDA graph."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from awex.transport.batched_copy import BatchedCopy, split_batchable
from awex.transport.copies import copier
from awex.transport.shards import extent


def overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...] | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def shift(s: tuple[slice, ...], by: tuple[slice, ...]) -> tuple[slice, ...]:
    return tuple(slice(x.start - b.start, x.stop - b.start) for x, b in zip(s, by))


def paired_pieces(name: str, t, mine, source) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple[slice, ...]]]:
    """For transfer ``t`` of tensor ``name``: every overlap of this rank's pieces (``mine``) with the source's
    (``source``, both :class:`~awex.transport.shards.LocalShards`), as ``(destination view, source view, region
    within the transfer)``."""
    whole = tuple(slice(0, n) for n in t.sizes)
    src_pieces = source.pieces(name, t.offsets, t.sizes)
    for here_d, dview in mine.pieces(name, t.offsets, t.sizes):
        here_d = here_d or whole
        for here_s, sview in src_pieces:
            here_s = here_s or whole
            both = overlap(here_d, here_s)
            if both is None:
                continue
            d = dview[shift(both, here_d)] if both else dview
            s = sview[shift(both, here_s)] if both else sview
            yield d, s, both


@dataclass
class Span:
    """One peer DMA of a contiguous address range of a source GPU into a bounce buffer, then local placements."""

    source: int  # device address of the range (mapped in this process)
    nbytes: int
    offset: int  # where it lands in the bounce ring
    after: int | None  # the latest earlier span whose bytes it overwrites: placed before this DMA starts
    placed: list  # copy functions: each destination piece from its source inside the bounce ring
    dsts: list = field(default_factory=list)  # the destination pieces (verify mode digests them once placed)


def captured(issue, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """What ``issue()`` enqueues after ``stream`` (and on streams forked from it and joined back), as a CUDA
    graph. Unlike ``torch.cuda.graph`` this neither synchronizes the device nor collects garbage nor empties
    PyTorch's cache: the receiving process is an inference engine, whose cached memory stays as it is."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            issue()
        finally:
            graph.capture_end()
    return graph


def placements(copies: list[tuple[torch.Tensor, torch.Tensor]], batched: bool) -> list:
    """A span's copies out of the bounce ring as copy functions: those that can go as one kernel launch together
    (:class:`~awex.transport.batched_copy.BatchedCopy`, where ``batched`` and there are several), the rest one
    each."""
    together, apart = split_batchable(copies) if batched else ([], copies)
    if len(together) < 2:
        together, apart = [], copies
    return ([BatchedCopy(together)] if together else []) + [copier(d, s) for d, s in apart]


def nbytes_of(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(d.nbytes for d, _ in copies)


def rows_within(d: torch.Tensor, s: torch.Tensor, nbytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy whose source spans more than ``nbytes`` cut along its first dimension into copies that each span
    at most ``nbytes`` (so they fit a bounce buffer), unless both sides are contiguous (one DMA does it whole)
    or one row alone is too large. Without it such a copy would fall back to a copy across GPUs by PyTorch
    (the down projections' column halves made a sync several times slower; measured: docs/performance.md)."""
    start, end = extent(s)
    if (
        end - start <= nbytes
        or s.dim() == 0
        or s.shape[0] < 2
        or s.stride(0) <= 0
        or (d.is_contiguous() and s.is_contiguous())
    ):
        return [(d, s)]
    per_row = s.stride(0) * s.element_size()
    first_row = end - start - per_row * (s.shape[0] - 1)  # the extent of one row
    rows = (nbytes - first_row) // per_row + 1
    if rows < 1:
        return [(d, s)]
    return [(d[i : i + rows], s[i : i + rows]) for i in range(0, s.shape[0], rows)]


def balance(copies: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Deal copies to ``n`` branches, largest first to the least loaded (by bytes); each keeps plan order."""
    if n <= 1:
        return [list(copies)] if n == 1 else []
    load = [0] * n
    chosen: dict[int, int] = {}
    for i in sorted(range(len(copies)), key=lambda i: -copies[i][0].nbytes):
        b = min(range(n), key=load.__getitem__)
        chosen[i] = b
        load[b] += copies[i][0].nbytes
    return [[c for i, c in enumerate(copies) if chosen[i] == b] for b in range(n)]


def in_chunks(
    copies: list[tuple[torch.Tensor, torch.Tensor]], at: list[int], nbytes: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Copies read by kernels (each with the address its source is read at) cut into pieces of at most about
    ``nbytes`` (a multiple of 16): contiguous ones by bytes, row by row ones by whole rows. A launch reading
    several GPUs then reads them in turn a few MiB at a time: in pieces of a parameter each, a launch's running
    blocks read one GPU at a time, and another receiver reading the same GPUs meets it there."""
    out, out_at = [], []
    for (d, s), a in zip(copies, at):
        if d.is_contiguous() and s.is_contiguous():
            flat_d, flat_s = d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)
            for lo in range(0, flat_d.numel(), nbytes):
                out.append((flat_d[lo : lo + nbytes], flat_s[lo : lo + nbytes]))
                out_at.append(a + lo)
        else:
            rows, step = max(1, nbytes // max(1, d[0].nbytes)), s.stride(0) * s.element_size()
            for lo in range(0, d.shape[0], rows):
                out.append((d[lo : lo + rows], s[lo : lo + rows]))
                out_at.append(a + lo * step)
    return out, out_at
