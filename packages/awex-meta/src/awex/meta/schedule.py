"""Grouping assigned transfers into bounded buckets per peer pair, and ordering pairs into rounds."""

from __future__ import annotations

from awex.meta.balance import PairTransfers
from awex.meta.box import Box, split_box
from awex.meta.plan import Bucket, Transfer


def make_buckets(
    per_pair: PairTransfers, itemsizes: list[int], bucket_bytes: int
) -> dict[tuple[int, int], list[tuple[tuple[Transfer, ...], int]]]:
    """Per (src, dst) pair, transfers sorted by tensor and offset, packed into buckets of <= ``bucket_bytes``.

    A transfer larger than a bucket is cut into pieces that fit (outermost dimension first).
    """
    out: dict[tuple[int, int], list[tuple[tuple[Transfer, ...], int]]] = {}
    for pair in sorted(per_pair):
        items = per_pair[pair]
        items.sort()
        buckets: list[tuple[tuple[Transfer, ...], int]] = []
        current: list[Transfer] = []
        size = 0
        for item in items:
            if item.nbytes > bucket_bytes:
                isz = itemsizes[item.tensor]
                pieces = [
                    Transfer(item.tensor, b.offsets, b.sizes, b.numel * isz)
                    for b in split_box(Box(item.offsets, item.sizes), isz, bucket_bytes)
                ]
            else:
                pieces = [item]
            for t in pieces:
                if current and size + t.nbytes > bucket_bytes:
                    buckets.append((tuple(current), size))
                    current, size = [], 0
                current.append(t)
                size += t.nbytes
        if current:
            buckets.append((tuple(current), size))
        out[pair] = buckets
    return out


def assign_rounds(pair_bytes: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Colour peer pairs so that no rank has two pairs in one round (a proper edge colouring).

    Pairs are taken heaviest first, each into the lowest round free at both ends; this uses at most
    ``2 * max_degree - 1`` rounds and puts the largest transfers first.
    """
    used: dict[int, set[int]] = {}
    rounds: dict[tuple[int, int], int] = {}
    for pair in sorted(pair_bytes, key=lambda p: (-pair_bytes[p], p)):
        a = used.setdefault(pair[0], set())
        b = used.setdefault(pair[1], set())
        r = 0
        while r in a or r in b:
            r += 1
        a.add(r)
        b.add(r)
        rounds[pair] = r
    return rounds


def order_buckets(
    buckets: dict[tuple[int, int], list[tuple[tuple[Transfer, ...], int]]], rounds: dict[tuple[int, int], int]
) -> list[Bucket]:
    out = [
        Bucket(rounds[pair], pair[0], pair[1], seq, transfers, nbytes)
        for pair, bs in buckets.items()
        for seq, (transfers, nbytes) in enumerate(bs)
    ]
    out.sort(key=lambda b: (b.round, b.src, b.dst, b.seq))
    return out
