"""Pure scheduling rules of the CUDA IPC executor: where spans land in the bounce ring, in what order sources are
read, and when same-GPU copies are paced between peer DMAs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from awex.meta.errors import AwexValueError

T = TypeVar("T")

COPY_OVER_LINK = 5.0
"""How many times faster a GPU copies within its memory than it pulls from a peer (bytes moved per second;
measured: docs/performance.md)."""


def paces_local(remote_bytes: int, local_bytes: int) -> bool:
    """Whether a receiver's same-GPU copies should run in slices between its peer DMAs' placements.

    Run at once, same-GPU copies saturate the GPU's memory for a while and the DMAs into it stall meanwhile:
    where the DMAs take longer than the local copies, spreading the local copies over the DMAs hides them. Where
    the local copies take longer (a MoE model whose experts every trainer rank holds whole), pacing ties them to
    the DMAs' progress (measured: docs/performance.md)."""
    return remote_bytes * COPY_OVER_LINK >= local_bytes


def ring_slots(sizes: Sequence[int], capacity: int, align: int = 16) -> list[tuple[int, int | None]]:
    """Where each of a sequence of spans lands in a ring of ``capacity`` bytes, and which earlier span must be
    placed (read out) before it may be written: ``(offset, after)``, ``after`` the latest earlier span whose
    bytes overlap (``None``: none). Spans go end to end (``align``-ed) and start again at 0 when the next one
    does not fit, so small spans keep many DMAs in flight where fixed slots of the largest size would keep few.
    Placements run in order on one stream, so waiting for ``after`` covers every earlier overlapping span."""
    out: list[tuple[int, int | None]] = []
    live: list[tuple[int, int, int]] = []  # (start, end, span) of earlier spans, latest last
    pos = 0
    for i, n in enumerate(sizes):
        if n > capacity:
            raise AwexValueError(f"a span of {n} bytes does not fit a ring of {capacity} bytes")
        if pos + n > capacity:
            pos = 0
        start, end = pos, pos + n
        after = next((j for a, b, j in reversed(live) if a < end and start < b), None)
        out.append((start, after))
        live.append((start, end, i))
        pos = -(-end // align) * align
    return out


def interleave_sources(groups: Sequence[Sequence[tuple[int, T]]], first: int = 0) -> list[T]:
    """Merge per-source lists of ``(nbytes, item)`` into one order in which every source is read evenly.

    Each list keeps its order; the next item always comes from the source that has had the smallest fraction
    of its bytes taken so far (ties: sources in turn from ``first``), so at any point of the sync every source
    has been asked for about the same share of what it holds.
    """
    k = len(groups)
    totals = [sum(n for n, _ in g) or 1 for g in groups]
    taken = [0] * k
    pos = [0] * k
    out: list[T] = []
    while True:
        left = [i for i in range(k) if pos[i] < len(groups[i])]
        if not left:
            return out
        i = min(left, key=lambda i: (taken[i] / totals[i], (i - first) % k))
        n, item = groups[i][pos[i]]
        pos[i] += 1
        taken[i] += n
        out.append(item)


def interleave_by_source(
    items: Sequence[T], source: Callable[[T], object], size: Callable[[T], int], first: int
) -> list[T]:
    """``items`` grouped by ``source`` (sources in the order of their names; each group keeps its order) and merged
    by :func:`interleave_sources` with sizes ``size``."""
    groups: dict[str, list[tuple[int, T]]] = {}
    for x in items:
        groups.setdefault(str(source(x)), []).append((size(x), x))
    return interleave_sources([groups[k] for k in sorted(groups)], first=first)
