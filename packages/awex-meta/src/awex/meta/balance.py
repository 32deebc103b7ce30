"""Assigning each needed piece to one of the source ranks that hold it, spreading the send load.

Pieces whose holders are the same set of ranks form a group.

1. Greedy: groups from the most constrained (fewest holders) to the least, pieces largest first, each to the
   least loaded holder. A piece of at least ``2 * split_bytes`` is cut along its outermost dimension and
   spread over the least loaded holders by water-filling, in contiguous parts of at least ``split_bytes``.
   For holder sets that nest or are disjoint this meets :func:`send_lower_bound`.
2. When the greedy result is more than 0.1% above that bound (holder sets that cross, e.g. tied embeddings
   on the first and last pipeline stage next to expert replicas within a stage), the optimal fractional
   spread is found by max-flow (binary search on the busiest sender's volume) and pieces are dealt out to
   meet those per-rank quotas. The flow's infeasible side is a tighter lower bound.
"""

from __future__ import annotations

import heapq

from awex.meta.flow import FlowGraph
from awex.meta.plan import Transfer

Piece = tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A region some destination ranks need: ``(-nbytes, tensor, offsets, sizes, destination ranks)``.

Plain tuples (negated size first) so that sorting a group largest-first needs no key function: the planner
makes hundreds of thousands of these for a large job.
"""

PairTransfers = dict[tuple[int, int], list[Transfer]]
"""Transfers per (source, destination) pair, in assignment order."""


def assign_sources(
    groups: dict[tuple[int, ...], list[Piece]], world_size: int, split_bytes: int, whole: frozenset[int] = frozenset()
) -> tuple[PairTransfers, int]:
    """Choose a source for every piece and destination (splitting large ones, except pieces of the tensors in
    ``whole``: weights quantised on receive, whose tiles a split could cut); deterministic.

    Returns the transfers per pair and the lower bound on the busiest sender's volume.
    """
    group_bytes = {h: -sum(p[0] * len(p[4]) for p in ps) for h, ps in groups.items()}
    bound = send_lower_bound(group_bytes)
    out, loads = _greedy(groups, world_size, split_bytes, whole)
    if max(loads, default=0) <= bound * 1.001:
        return out, bound
    quotas, bound = _optimal_quotas(group_bytes, world_size, bound, max(loads))
    by_quota, quota_loads = _deal_by_quota(groups, quotas, world_size, split_bytes, whole)
    if max(quota_loads) < max(loads):
        return by_quota, bound
    return out, bound


def _emitter(out: PairTransfers):
    def emit(src: int, dst: int, transfer: Transfer) -> None:
        lst = out.get((src, dst))
        if lst is None:
            lst = out[(src, dst)] = []
        lst.append(transfer)

    return emit


def _greedy(
    groups: dict[tuple[int, ...], list[Piece]], world_size: int, split_bytes: int, whole: frozenset[int]
) -> tuple[PairTransfers, list[int]]:
    loads = [0] * world_size
    out: PairTransfers = {}
    emit = _emitter(out)
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        pieces = groups[holders]
        pieces.sort()
        if len(holders) == 1:
            src = holders[0]
            for neg, tensor, offsets, sizes, dsts in pieces:
                transfer = Transfer(tensor, offsets, sizes, -neg)
                for dst in dsts:
                    emit(src, dst, transfer)
                loads[src] -= neg * len(dsts)
            continue
        heap = [(loads[r], r) for r in holders]
        heapq.heapify(heap)
        threshold = -2 * split_bytes
        pop, push = heapq.heappop, heapq.heappush
        for neg, tensor, offsets, sizes, dsts in pieces:
            if neg <= threshold and _splittable(sizes) and tensor not in whole:
                for dst in dsts:
                    parts = _water_fill(-neg, offsets, sizes, holders, loads, split_bytes)
                    for src, p_off, p_size, nbytes in parts:
                        emit(src, dst, Transfer(tensor, p_off, p_size, nbytes))
                        loads[src] += nbytes
                heap = [(loads[r], r) for r in holders]
                heapq.heapify(heap)
                continue
            transfer = Transfer(tensor, offsets, sizes, -neg)
            for dst in dsts:
                load, src = pop(heap)
                emit(src, dst, transfer)
                push(heap, (load - neg, src))
            for load, src in heap:
                loads[src] = load
    return out, loads


def _optimal_quotas(
    group_bytes: dict[tuple[int, ...], int], world_size: int, low: int, high: int
) -> tuple[dict[tuple[int, ...], dict[int, float]], int]:
    """Per group, how many bytes each holder should send so the busiest sender sends as little as possible.

    Binary search on the busiest sender's volume T, each step a max-flow (source -> group (its bytes) -> holder
    -> sink (T)). Returns the quotas for the smallest feasible T found and the largest infeasible T (a lower
    bound on what any plan can achieve).
    """
    order = sorted(group_bytes)
    total = sum(group_bytes.values())
    ranks = sorted({r for h in order for r in h})
    node_of = {r: 1 + len(order) + i for i, r in enumerate(ranks)}
    sink = 1 + len(order) + len(ranks)

    def solve(limit: float):
        g = FlowGraph(sink + 1)
        edges = []
        for gi, h in enumerate(order):
            g.add_edge(0, 1 + gi, float(group_bytes[h]))
            for r in h:
                edges.append((h, r, g.add_edge(1 + gi, node_of[r], float(total))))
        for r in ranks:
            g.add_edge(node_of[r], sink, float(limit))
        flow = g.max_flow(0, sink, eps=1e-6)
        return flow >= total - 1e-3 * len(order) - 1, g, edges

    best = None
    lo, hi = float(low), float(high)
    for _ in range(40):
        if hi - lo <= max(1.0, 1e-4 * hi):
            break
        mid = (lo + hi) / 2
        ok, g, edges = solve(mid)
        if ok:
            hi, best = mid, (g, edges)
        else:
            lo = mid
    if best is None:
        _, g, edges = solve(hi)
        best = (g, edges)
    g, edges = best
    quotas: dict[tuple[int, ...], dict[int, float]] = {h: {} for h in order}
    for h, r, e in edges:
        f = g.flow_on(e)
        if f > 0:
            quotas[h][r] = f
    return quotas, int(lo)


def _deal_by_quota(
    groups: dict[tuple[int, ...], list[Piece]],
    quotas: dict[tuple[int, ...], dict[int, float]],
    world_size: int,
    split_bytes: int,
    whole: frozenset[int],
) -> tuple[PairTransfers, list[int]]:
    """Give each group's pieces to its holders, largest piece to the holder with the most quota left."""
    loads = [0] * world_size
    out: PairTransfers = {}
    emit = _emitter(out)
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        pieces = groups[holders]
        pieces.sort()
        left = {r: quotas[holders].get(r, 0.0) for r in holders}
        heap = [(-q, r) for r, q in sorted(left.items())]
        heapq.heapify(heap)
        for neg, tensor, offsets, sizes, dsts in pieces:
            for dst in dsts:
                q, src = heapq.heappop(heap)
                if -q < -neg and -neg >= 2 * split_bytes and _splittable(sizes) and tensor not in whole:
                    heapq.heappush(heap, (q, src))
                    # spread by remaining quota: holders with more quota left take more rows
                    remaining = {r: -qq for qq, r in heap}
                    fake_loads = [0] * world_size
                    top = max(remaining.values())
                    for r, qq in remaining.items():
                        fake_loads[r] = int(top - qq)
                    parts = _water_fill(-neg, offsets, sizes, holders, fake_loads, split_bytes)
                    for r, p_off, p_size, nbytes in parts:
                        emit(r, dst, Transfer(tensor, p_off, p_size, nbytes))
                        loads[r] += nbytes
                        remaining[r] -= nbytes
                    heap = [(-qq, r) for r, qq in sorted(remaining.items())]
                    heapq.heapify(heap)
                    continue
                emit(src, dst, Transfer(tensor, offsets, sizes, -neg))
                loads[src] -= neg
                heapq.heappush(heap, (q - neg, src))
    return out, loads


def _splittable(sizes: tuple[int, ...]) -> bool:
    return any(s > 1 for s in sizes)


def _water_fill(
    nbytes: int,
    p_offsets: tuple[int, ...],
    p_sizes: tuple[int, ...],
    holders: tuple[int, ...],
    loads: list[int],
    split_bytes: int,
) -> list[tuple[int, tuple[int, ...], tuple[int, ...], int]]:
    """Cut a piece along its outermost non-trivial dimension so the chosen holders end up as level as possible."""
    dim = next(d for d, s in enumerate(p_sizes) if s > 1)
    rows = p_sizes[dim]
    row_bytes = nbytes // rows
    max_parts = max(1, min(len(holders), rows, nbytes // split_bytes))
    cands = sorted(holders, key=lambda r: (loads[r], r))[:max_parts]
    # level L with sum(max(0, L - load_i)) == nbytes over the k least loaded candidates
    k = len(cands)
    while k > 1:
        level = (nbytes + sum(loads[r] for r in cands[:k])) / k
        if level > loads[cands[k - 1]]:
            break
        k -= 1
    cands = cands[:k]
    level = (nbytes + sum(loads[r] for r in cands)) / k
    shares = [(level - loads[r]) / row_bytes for r in cands]
    counts = [int(s) for s in shares]
    rest = rows - sum(counts)
    order = sorted(range(k), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    # parts below split_bytes go to the largest part
    min_rows = max(1, -(-split_bytes // row_bytes))
    big = max(range(k), key=lambda i: (counts[i], -i))
    for i in range(k):
        if i != big and counts[i] < min_rows:
            counts[big] += counts[i]
            counts[i] = 0
    parts = []
    start = 0
    for r, n in sorted(zip(cands, counts)):
        if n == 0:
            continue
        offsets = list(p_offsets)
        sizes = list(p_sizes)
        offsets[dim] += start
        sizes[dim] = n
        parts.append((r, tuple(offsets), tuple(sizes), n * row_bytes))
        start += n
    return parts


def send_lower_bound(group_bytes: dict[tuple[int, ...], int]) -> int:
    """The least the busiest source must send: max over holder sets S of bytes only S can send, over |S|.

    Bytes whose holders all lie in S must leave from ranks in S, so some rank of S sends at least their share.
    """
    sets = [(frozenset(h), b) for h, b in group_bytes.items()]
    best = 0.0
    for s, _ in sets:
        inside = sum(b for t, b in sets if t <= s)
        best = max(best, inside / len(s))
    return int(-(-best // 1))
