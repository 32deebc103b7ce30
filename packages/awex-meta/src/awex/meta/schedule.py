"""Relaying (or broadcasting) fan-out and cutting every pair's traffic into waves.

A *wave* is one step of the whole sync world: every rank posts all its sends and receives of a wave at once
(one grouped operation), waits for them, and goes on to the next wave. Waves are global and every transfer
of a wave depends only on data sent in earlier waves, so processing waves in increasing order cannot
deadlock, while a rank still talks to all its peers at once within a wave (all its links busy).

Each pair's traffic is spread evenly over the same number of waves ``W``, chosen so that no rank moves more
than about ``wave_bytes`` (sent plus received) in one wave. Every rank therefore moves a constant fraction of
its total in every wave, and the busiest rank is busy in all of them: the wave schedule costs nothing over the
link lower bound except the per-wave start-up (one grouped call per wave), and it bounds a transport's
staging memory to about two waves (double buffering).

*Relay*: when one source would send the same region to several destinations and that makes the source the
busiest rank (one trainer GPU feeding three inference instances), the source sends each such region once, to
one of its destinations (chosen to balance), and that destination forwards it :data:`RELAY_LAG` waves later,
from its own freshly written memory. The source's egress no longer multiplies with the number of instances.

*Broadcast* (opt-in, instead of relays): what one source sends to several destinations is cut into waves once
per destination set (:func:`split_broadcasts`), into identical buckets for each of them, which a transport
sends as one broadcast per wave; the source's load counts them once.
"""

from __future__ import annotations

from collections.abc import Callable

from awex.meta.balance import PairTransfers
from awex.meta.plan import RELAY_LAG, Bucket, Transfer

Relays = dict[tuple[int, int, Transfer], list[int]]
"""``(source, first destination, transfer) -> other destinations`` that get the transfer from the first one."""

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
) -> tuple[list[Bucket], int]:
    """Buckets (one per pair and wave) and the number of waves.

    Every pair's transfers, sorted by tensor and offset, are laid end to end and cut (along the outermost
    dimension) into equal consecutive chunks, one per wave, so every wave carries the same share of every
    pair; a pair whose share would fall below ``min_piece_bytes`` gets fewer, equal chunks, spread evenly over
    the waves (a rank with many peers sends few large messages rather than tiny ones in every
    wave, and the plan stays small).
    Relayed transfers follow their first hop :data:`RELAY_LAG` waves later. ``broadcasts`` (from
    :func:`split_broadcasts`) are cut the same way, once per source and destination set, into identical
    buckets for each destination (a bucket for the pair in that wave besides the pair's own); they count once
    in their source's load. ``row_multiples`` (per tensor, default 1): cuts of a tensor fall on multiples of this
    many rows (whole FP8 tiles of weights quantised on receive).
    """
    broadcasts = broadcasts or {}
    load = [0] * world_size
    for (s, d), ts in per_pair.items():
        n = sum(t.nbytes for t in ts)
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
    floor = max(1, min(min_piece_bytes, wave_bytes // 4))
    buckets: list[Bucket] = []
    relayed: dict[tuple[int, int], dict[int, list[Transfer]]] = {}
    for pair in sorted(per_pair):
        src, dst = pair
        shift = _shift(src, dst, waves)

        def forward(piece: Transfer, item: Transfer, wave: int, src=src, dst=dst) -> None:
            for other in relays.get((src, dst, item), ()):
                relayed.setdefault((dst, other), {}).setdefault(wave + RELAY_LAG, []).append(piece)

        chunks = _spread(
            sorted(per_pair[pair]), waves, floor, itemsizes, forward if relays else None, shift, row_multiples
        )
        _emit(buckets, src, dst, chunks)
    for (src, dst), by_wave in sorted(relayed.items()):
        _emit(buckets, src, dst, by_wave)
    for src, dsts in sorted(broadcasts):
        by_wave = _spread(sorted(broadcasts[(src, dsts)]), waves, floor, itemsizes, None, 0, row_multiples)
        for dst in dsts:
            _emit(buckets, src, dst, by_wave)
    buckets.sort(key=lambda b: (b.wave, b.src, b.dst))
    used = (buckets[-1].wave + 1) if buckets else 0
    return buckets, used


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


def _shift(src: int, dst: int, waves: int) -> int:
    """Where a pair with fewer chunks than waves starts: spread low-discrepancy over the waves both among one
    source's destinations and among one destination's sources (golden-ratio sequences), so that no port gets
    the chunks of many of its pairs in the same wave."""
    return int((src * 0.6180339887498949 + dst * 0.7548776662466927) % 1.0 * waves) % waves


def _spread(
    items: list[Transfer],
    waves: int,
    floor: int,
    itemsizes: list[int],
    forward: Callable[[Transfer, Transfer, int], None] | None,
    shift: int = 0,
    row_multiples: list[int] | None = None,
) -> dict[int, list[Transfer]]:
    """One pair's transfers (sorted) cut into its chunks of the ``waves`` (see :func:`assign_waves`);
    ``forward(piece, item, wave)`` is told where each piece of each item went (relays). Fewer chunks than waves
    go to every ``waves / chunks``-th wave from ``shift`` on (wrapping around), so pairs that differ in ``shift``
    do not all load the same waves."""
    total = sum(t.nbytes for t in items)
    chunks = min(waves, max(1, total // floor))  # a pair's share per wave is never below `floor`
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
            wave = k if chunks == waves else (k * waves // chunks + shift) % waves
            by_wave.setdefault(wave, []).append(piece)
            if forward is not None:
                forward(piece, item, wave)
            done += piece.nbytes
            used += piece.nbytes
            while k < chunks - 1 and done >= (k + 1) * total // chunks:
                k += 1
                used = 0
    return by_wave


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


def _emit(buckets: list[Bucket], src: int, dst: int, by_wave: dict[int, list[Transfer]]) -> None:
    for seq, wave in enumerate(sorted(by_wave)):
        ts = tuple(by_wave[wave])
        buckets.append(Bucket(wave, src, dst, seq, ts, sum(t.nbytes for t in ts)))
