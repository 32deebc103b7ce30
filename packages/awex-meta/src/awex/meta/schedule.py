"""Relaying (or broadcasting) fan-out and cutting every pair's traffic into waves.

A *wave* is one step of the whole sync world: every rank posts all its sends and receives of a wave at once
(one grouped operation), waits for them, and goes on to the next wave. Waves are global and every transfer
of a wave depends only on data sent in earlier waves, so processing waves in increasing order cannot
deadlock, while a rank still talks to all its peers at once within a wave (all its links busy).

The number of waves ``W`` is chosen so that no rank moves more than about ``wave_bytes`` (sent plus received)
in one wave, which bounds a transport's staging memory to about two waves (double buffering). A pair large
enough is spread evenly over all ``W`` waves; a smaller one goes in fewer chunks (no message below a floor),
placed where its two ports are least loaded so far, so every port's load stays level over the waves and the
busiest port is busy in all of them: each wave lasts as long as its busiest port, and the schedule then costs
little over the link lower bound besides the per-wave start-up (one grouped call per wave).

*Relay*: when one source would send the same region to several destinations and that makes the source the
busiest rank (one trainer GPU feeding three inference instances), the source sends each such region once, to
one of its destinations (chosen to balance), and that destination forwards it :data:`RELAY_LAG` waves later,
from its own freshly written memory. The source's egress no longer multiplies with the number of instances.

*Broadcast* (opt-in, instead of relays): what one source sends to several destinations is cut into waves once
per destination set (:func:`split_broadcasts`), into identical buckets for each of them, which a transport
sends as one broadcast per wave; the source's load counts them once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable

from awex.meta.balance import PairTransfers
from awex.meta.plan import RELAY_LAG, Bucket, Transfer

Relays = dict[tuple[int, int, Transfer], list[int]]
"""``(source, first destination, transfer) -> other destinations`` that get the transfer from the first one."""

Ports = Callable[[int, int], tuple[Hashable, Hashable, float]]
"""``(src, dst) -> (sending port, receiving port, seconds per byte)``: the links a pair's bytes load
(:meth:`awex.meta.topology.Placement.ports`); the two ports are one for a copy on one device."""

Broadcasts = dict[tuple[int, tuple[int, ...]], list[Transfer]]
"""``(source, destinations) -> transfers`` the source sends to all of those destinations alike (broadcasts)."""


def plan_relays(per_pair: PairTransfers, world_size: int) -> Relays:
    """Choose which multi-destination transfers a destination forwards instead of the source (edits ``per_pair``).

    Only sources that would be busier than every receiver relay, largest regions first, each to the
    destination that sends least so far, as long as that destination stays below the source.
    """
    send = [0] * world_size
    recv = [0] * world_size
    for (s, d), ts in per_pair.items():
        n = sum(t.nbytes for t in ts)
        send[s] += n
        recv[d] += n
    max_recv = max(recv, default=0)
    hot = {s for s in range(world_size) if send[s] > max_recv}
    if not hot:
        return {}
    dsts_of: dict[tuple[int, Transfer], list[int]] = {}
    for (s, d), ts in per_pair.items():
        if s in hot:
            for t in ts:
                dsts_of.setdefault((s, t), []).append(d)
    candidates = sorted(
        ((key, ds) for key, ds in dsts_of.items() if len(ds) > 1),
        key=lambda kv: (-kv[0][1].nbytes * (len(kv[1]) - 1), kv[0][0], kv[0][1]),
    )
    relays: Relays = {}
    dropped: set[tuple[int, int, Transfer]] = set()
    for (s, t), ds in candidates:
        if send[s] <= max_recv:
            continue
        extra = t.nbytes * (len(ds) - 1)
        first = min(ds, key=lambda d: (send[d], d))
        if send[first] + extra > send[s] - extra:
            continue
        send[s] -= extra
        send[first] += extra
        others = sorted(d for d in ds if d != first)
        relays[(s, first, t)] = others
        dropped.update((s, d, t) for d in others)
    if dropped:
        for (s, d), ts in list(per_pair.items()):
            kept = [t for t in ts if (s, d, t) not in dropped]
            if kept:
                per_pair[(s, d)] = kept
            else:
                del per_pair[(s, d)]
    return relays


def assign_waves(
    per_pair: PairTransfers,
    relays: Relays,
    itemsizes: list[int],
    wave_bytes: int,
    world_size: int,
    min_piece_bytes: int,
    broadcasts: Broadcasts | None = None,
    row_multiples: list[int] | None = None,
    ports: Ports | None = None,
) -> tuple[list[Bucket], int]:
    """Buckets (one per pair and wave) and the number of waves.

    Every pair's transfers, sorted by tensor and offset, are laid end to end and cut (along the outermost
    dimension) into equal consecutive chunks, one per wave, so every wave carries the same share of every
    pair; a pair whose share would fall below ``min(min_piece_bytes, wave_bytes / 32)`` gets fewer, equal chunks
    (a rank with many peers sends few large messages rather than tiny ones in every wave, and the plan stays
    small), placed in the waves where the pair's two ports are least loaded so far (pairs are placed largest
    first): a wave lasts as long as its busiest port, so every port's load is kept as level over the waves as the
    chunks allow.
    ``ports(src, dst)`` gives a pair's sending and receiving port and the seconds a byte costs on them
    (:meth:`awex.meta.topology.Placement.ports`: a GPU's NIC, NVLink or copy engine); by default every rank is
    one port each way, all alike.
    Relayed transfers follow their first hop :data:`RELAY_LAG` waves later. ``broadcasts`` (from
    :func:`split_broadcasts`) are cut the same way, once per source and destination set, into identical
    buckets for each destination (a bucket for the pair in that wave besides the pair's own); they count once
    in their source's load. ``row_multiples`` (per tensor, default 1): cuts of a tensor fall on multiples of this
    many rows (whole FP8 tiles of weights quantised on receive).
    """
    broadcasts = broadcasts or {}
    ports = ports or rank_ports
    load = [0] * world_size
    totals = {pair: sum(t.nbytes for t in ts) for pair, ts in per_pair.items()}
    for (s, d), n in totals.items():
        load[s] += n
        load[d] += n
    for (s, ds), ts in broadcasts.items():
        n = sum(t.nbytes for t in ts)
        load[s] += n
        for d in ds:
            load[d] += n
    for (_, first, t), others in relays.items():
        load[first] += t.nbytes * len(others)
        for o in others:
            load[o] += t.nbytes
    waves = max(1, -(-max(load, default=0) // wave_bytes))
    floor = max(1, min(min_piece_bytes, wave_bytes // 32))
    level = _Level(waves)
    hops: dict[tuple[int, int], tuple[Hashable, Hashable, float]] = {}  # ports of relays' hops, looked up once
    buckets: list[Bucket] = []
    relayed: dict[tuple[int, int], dict[int, list[Transfer]]] = {}
    for pair in sorted(per_pair, key=lambda p: (-totals[p], p)):  # largest first: the small ones fill around them
        src, dst = pair

        def forward(piece: Transfer, item: Transfer, wave: int, src=src, dst=dst) -> None:
            for other in relays.get((src, dst, item), ()):
                relayed.setdefault((dst, other), {}).setdefault(wave + RELAY_LAG, []).append(piece)
                hop = hops.get((dst, other))
                if hop is None:
                    hop = hops[(dst, other)] = ports(dst, other)
                level.add(hop, wave + RELAY_LAG, piece.nbytes)

        link = ports(src, dst)
        chunks = _chunks(totals[pair], waves, floor)
        slots = level.least_loaded(link, chunks)
        by_wave = _spread(
            sorted(per_pair[pair]), waves, floor, itemsizes, forward if relays else None, slots, row_multiples
        )
        for wave, nbytes in _emit(buckets, src, dst, by_wave):
            level.add(link, wave, nbytes)
    for (src, dst), by_wave in sorted(relayed.items()):
        _emit(buckets, src, dst, by_wave)
    for src, dsts in sorted(broadcasts):
        by_wave = _spread(sorted(broadcasts[(src, dsts)]), waves, floor, itemsizes, None, None, row_multiples)
        for dst in dsts:
            _emit(buckets, src, dst, by_wave)
    buckets.sort(key=lambda b: (b.wave, b.src, b.dst))
    used = (buckets[-1].wave + 1) if buckets else 0
    return buckets, used


def rank_ports(src: int, dst: int) -> tuple[Hashable, Hashable, float]:
    """Every rank one link, sending and receiving at once, all links alike (no topology known)."""
    return ("out", src), ("in", dst), 1.0


class _Level:
    """Each port's load per wave so far (bytes times the port's seconds per byte), to place a pair's chunks where
    its two ports are least loaded. Sums in a fixed order: every rank computes the same plan. A pair's ports are
    ``(sending, receiving, seconds per byte)`` as :data:`Ports` gives them."""

    def __init__(self, waves: int):
        self.waves = waves
        self.load: dict[Hashable, list[float]] = {}

    def _of(self, port: Hashable) -> list[float]:
        got = self.load.get(port)
        if got is None:
            got = self.load[port] = [0.0] * self.waves
        return got

    def add(self, link: tuple[Hashable, Hashable, float], wave: int, nbytes: int) -> None:
        if wave >= self.waves:  # relays' last hops run after the last wave
            return
        out, into, cost = link
        self._of(out)[wave] += nbytes * cost
        if into != out:
            self._of(into)[wave] += nbytes * cost

    def least_loaded(self, link: tuple[Hashable, Hashable, float], chunks: int) -> list[int] | None:
        """The ``chunks`` waves (in order) where the busier of the pair's two ports is least loaded (the earlier
        wave on a tie); ``None`` for every wave."""
        if chunks >= self.waves:
            return None
        a, b = self._of(link[0]), self._of(link[1])
        busier = [x if x >= y else y for x, y in zip(a, b)]
        return sorted(heapq.nsmallest(chunks, range(self.waves), key=busier.__getitem__))


def split_broadcasts(per_pair: PairTransfers) -> tuple[PairTransfers, Broadcasts]:
    """Separate what one source sends to several destinations: ``(source, destinations) -> transfers`` for
    every transfer with two or more destinations from one source, and the pairs' remaining transfers."""
    dsts_of: dict[tuple[int, Transfer], list[int]] = {}
    for (s, d), ts in sorted(per_pair.items()):
        for t in ts:
            dsts_of.setdefault((s, t), []).append(d)
    rest: PairTransfers = {}
    groups: Broadcasts = {}
    for (s, t), ds in dsts_of.items():
        if len(ds) > 1:
            groups.setdefault((s, tuple(sorted(ds))), []).append(t)
        else:
            rest.setdefault((s, ds[0]), []).append(t)
    return rest, groups


def _spread(
    items: list[Transfer],
    waves: int,
    floor: int,
    itemsizes: list[int],
    forward: Callable[[Transfer, Transfer, int], None] | None,
    slots: list[int] | None = None,
    row_multiples: list[int] | None = None,
) -> dict[int, list[Transfer]]:
    """One pair's transfers (sorted) cut into its chunks of the ``waves`` (see :func:`assign_waves`);
    ``forward(piece, item, wave)`` is told where each piece of each item went (relays). Chunk ``k`` goes to wave
    ``slots[k]`` (ascending, one per chunk); without ``slots``, fewer chunks than waves go to every
    ``waves / chunks``-th wave."""
    total = sum(t.nbytes for t in items)
    chunks = _chunks(total, waves, floor)
    by_wave: dict[int, list[Transfer]] = {}
    k = 0
    done = 0
    used = 0  # bytes in chunk k so far
    for item in items:
        todo = [item]
        while todo:
            piece = todo.pop()
            room = (k + 1) * total // chunks - done
            if piece.nbytes > room and k < chunks - 1:
                multiple = row_multiples[piece.tensor] if row_multiples else 1
                head, tail = _cut(piece, room, itemsizes[piece.tensor], multiple)
                if head is None and used:  # not even one row fits: close this chunk, retry in the next
                    k += 1
                    used = 0
                    todo.append(piece)
                    continue
                if head is not None:
                    todo.append(tail)
                    piece = head
            wave = k if chunks == waves else slots[k] if slots else k * waves // chunks
            by_wave.setdefault(wave, []).append(piece)
            if forward is not None:
                forward(piece, item, wave)
            done += piece.nbytes
            used += piece.nbytes
            while k < chunks - 1 and done >= (k + 1) * total // chunks:
                k += 1
                used = 0
    return by_wave


def _chunks(total: int, waves: int, floor: int) -> int:
    """How many chunks a pair of ``total`` bytes is cut into: one per wave, fewer where a share would fall below
    ``floor``."""
    return min(waves, max(1, total // floor))


def _cut(t: Transfer, nbytes: int, itemsize: int, multiple: int = 1) -> tuple[Transfer | None, Transfer | None]:
    """Split ``t`` along its outermost dimension into a head of at most ``nbytes`` (a multiple of ``multiple``
    rows) and the rest."""
    if not t.sizes or t.sizes[0] < 2:
        return None, None
    row = t.nbytes // t.sizes[0]
    rows = nbytes // row // multiple * multiple
    if rows < 1 or rows >= t.sizes[0]:
        return None, None
    rest = t.sizes[1:]
    head = Transfer(t.tensor, t.offsets, (rows, *rest), rows * row)
    tail = Transfer(t.tensor, (t.offsets[0] + rows, *t.offsets[1:]), (t.sizes[0] - rows, *rest), t.nbytes - rows * row)
    return head, tail


def _emit(buckets: list[Bucket], src: int, dst: int, by_wave: dict[int, list[Transfer]]) -> list[tuple[int, int]]:
    """Append the pair's buckets, one per wave in order; returns each one's ``(wave, bytes)``."""
    sizes = []
    for seq, wave in enumerate(sorted(by_wave)):
        ts = tuple(by_wave[wave])
        nbytes = sum(t.nbytes for t in ts)
        buckets.append(Bucket(wave, src, dst, seq, ts, nbytes))
        sizes.append((wave, nbytes))
    return sizes
