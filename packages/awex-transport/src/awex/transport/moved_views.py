"""A rank's views re-pointed at tensors that moved, without deriving them again.

A trainer offloaded and loaded back (or an engine whose weights were re-allocated) holds the same tensors, of the
same shapes, strides and dtypes, at new addresses. Views derived from them by a fixed rule (``view_of``: slices,
transposes, reshapes of each tensor) then lie at the same offsets within the same tensors as before: each view is
re-pointed at the tensor it lay in (``as_strided`` at the same offset), not asked of ``view_of`` again, which for a
Qwen3-8B-shaped rank's views cost 9-20 ms a moved version (docs/performance.md).

:func:`recipe` finds, once, where each view lies (:class:`Recipe`); :func:`repointed` applies it to the tensors as
they are now. Either answers ``None`` where addresses and forms alone cannot tell what deriving the views again
would give, and the caller derives them: a tensor whose form changed, a view in no tensor (a buffer the converter
made) or of another dtype than the tensor it lies in, a tensor with a negative stride, tensors that overlapped (one
buffer) and moved apart, a tensor whose memory is not all there (freed in place: the full check names it).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch

from awex.transport.shards import LocalShards, extent

Form = tuple  # (shape, strides, dtype), as awex.convert.live.forms gives each tensor


@dataclass(frozen=True)
class Recipe:
    """Where each of a rank's views lies in the tensors it was derived from, for tensors of ``forms``: per tensor
    name, per piece, ``(source index, elements from the source's first one, shape, strides)``; the sources some
    view lies in, with the bytes each spans; the groups of sources that overlap (parts of one buffer), which must
    move by one shift."""

    forms: tuple
    pieces: dict[str, tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]]
    spans: dict[int, int]
    clusters: tuple[tuple[int, ...], ...]


def _laid(pointers: Sequence[int], forms: Sequence[Form]) -> list[tuple[int, int, int]] | None:
    """``(first byte, one past the last, index)`` of every tensor with elements, by first byte; ``None`` where one
    has a negative stride (its extent is not read off its first byte)."""
    out = []
    for i, (ptr, (shape, strides, dtype)) in enumerate(zip(pointers, forms)):
        if not prod(shape):
            continue
        if any(s < 0 for s in strides):
            return None
        out.append((ptr, ptr + _span((shape, strides, dtype)), i))
    out.sort()
    return out


def recipe(held: LocalShards, before: Sequence[int], forms: Sequence[Form]) -> Recipe | None:
    """Where ``held``'s views lie in the tensors they were derived from, which lay at ``before`` (addresses) with
    ``forms`` when the views were taken; ``None`` where a view lies in no tensor, or in one of another dtype."""
    laid = _laid(before, forms)
    if laid is None or len(before) != len(forms):
        return None
    starts = [s for s, _, _ in laid]
    reach: list[tuple[int, int]] = []  # per tensor, by first byte: the furthest end of its group so far, and whose
    clusters: list[list[int]] = []
    for start, end, i in laid:
        if reach and start < reach[-1][0]:  # overlaps an earlier tensor: parts of one buffer
            clusters[-1].append(i)
            reach.append((end, i) if end > reach[-1][0] else reach[-1])
        else:
            clusters.append([i])
            reach.append((end, i))
    pieces: dict[str, tuple] = {}
    used: set[int] = set()
    for name in held.names():
        found = []
        for _, view in held.pairs(name):
            a, b = extent(view)
            k = bisect_right(starts, a) - 1
            if k < 0 or not view.numel():
                return None
            i = laid[k][2] if laid[k][1] >= b else reach[k][1]  # the last tensor to start below it, else the
            src_end = laid[k][1] if i == laid[k][2] else reach[k][0]  # furthest reaching of its group
            shape, strides, dtype = forms[i]
            offset = a - before[i]
            if src_end < b or dtype != view.dtype or offset % dtype.itemsize:
                return None
            found.append((i, offset // dtype.itemsize, tuple(view.shape), tuple(view.stride())))
            used.add(i)
        pieces[name] = tuple(found)
    groups = tuple(tuple(c) for c in clusters if len(c) > 1)
    return Recipe(tuple(forms), pieces, {i: _span(forms[i]) for i in sorted(used)}, groups)


def _span(form: Form) -> int:
    """The bytes a tensor of ``form`` spans from its first element to one past its last (strides not negative)."""
    shape, strides, dtype = form
    return (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtype.itemsize


def repointed(
    held: LocalShards, plan: Recipe, before: Sequence[int], sources: Sequence[torch.Tensor], forms: Sequence[Form]
) -> tuple[LocalShards, list[str], tuple[int, ...]] | None:
    """``held``'s views re-pointed at ``sources`` (the tensors they were derived from as they are now, of ``forms``,
    which lay at ``before``) by ``plan``; with the names of the tensors whose views moved, and the sources'
    addresses now. ``None`` unless ``forms`` are the plan's, every source a view lies in holds all its memory, and
    sources that overlapped moved by one shift."""
    if tuple(forms) != plan.forms or len(sources) != len(before):
        return None
    now = tuple([t.data_ptr() for t in sources])
    for group in plan.clusters:
        shift = now[group[0]] - before[group[0]]
        if any(now[i] - before[i] != shift for i in group):
            return None
    first: dict[int, int] = {}
    for i, span in plan.spans.items():
        src = sources[i]
        storage = src.untyped_storage()
        if now[i] - storage.data_ptr() + span > storage.nbytes():  # freed in place, or shrunk
            return None
        first[i] = src.storage_offset()
    out: dict[str, list] = {}
    moved = []
    for name, pieces in plan.pieces.items():
        out[name] = [
            (box, sources[i].as_strided(shape, strides, first[i] + d))
            for (box, _), (i, d, shape, strides) in zip(held.pairs(name), pieces)
        ]
        if any(now[i] != before[i] for i, *_ in pieces):
            moved.append(name)
    return LocalShards(out, held.device if held.on_host else None), sorted(moved), now
