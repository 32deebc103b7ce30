"""Independent check of a plan against the layouts it was made from.

Used by the CLI (``coverage_ok``) and the tests: every element every destination rank holds is received
exactly once, and every transfer reads from a box the source rank holds and writes into a box the
destination rank holds (so nothing is sent that nobody needs). A destination that relays a region must have
received it at least :data:`~awex.meta.plan.RELAY_LAG` waves before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Sequence

from awex.meta.box import Box
from awex.meta.layout import Layout
from awex.meta.plan import RELAY_LAG, Plan, Transfer
from awex.meta.spec import Role


@dataclass
class CoverageReport:
    ok: bool
    needed_bytes: int
    received_bytes: int
    problems: list[str] = field(default_factory=list)


def verify_plan(
    plan: Plan, sources: Sequence[Layout], destinations: Sequence[Layout], max_problems: int = 20
) -> CoverageReport:
    """Check coverage, exactness and that sources really hold what they send."""
    by_instance = {layout.instance: layout for layout in (*sources, *destinations)}
    base: dict[str, int] = {}
    for r in plan.ranks:
        base.setdefault(r.instance, r.rank)
    names = [t.name for t in plan.tensors]
    index = {n: i for i, n in enumerate(names)}
    itemsizes = [t.itemsize for t in plan.tensors]
    tables: dict[tuple[str, int], dict[int, list[Box]]] = {}

    def boxes_of(rank: int, tensor: int) -> list[Box]:
        r = plan.ranks[rank]
        key = (r.instance, tensor)
        table = tables.get(key)
        if table is None:
            table = {}
            layout = by_instance[r.instance]
            if names[tensor] in layout:
                for box, locals_ in layout.holdings(names[tensor]):
                    for local in locals_:
                        table.setdefault(local, []).append(box)
            tables[key] = table
        return table.get(r.local_rank, [])

    problems: list[str] = []
    received: dict[tuple[int, int], list[Transfer]] = {}
    checked: set[tuple[int, int]] = set()  # (src, id(transfer)): transfers are shared between destinations
    sized: set[int] = set()
    received_bytes = 0
    arrived: dict[tuple[int, Transfer], int] = {}  # (destination, transfer) -> wave, for relay checks
    relaying = any(r.role == Role.INFERENCE for r in plan.ranks) and plan.stats.relayed_bytes > 0
    for b in sorted(plan.buckets, key=lambda b: b.wave):
        src = b.src
        relay = relaying and plan.ranks[src].role == Role.INFERENCE
        for t in b.transfers:
            if relaying:
                if relay:
                    when = arrived.get((src, t))
                    if when is None or when > b.wave - RELAY_LAG:
                        problems.append(
                            f"{names[t.tensor]} {t.region}: rank {src} relays it in wave {b.wave} "
                            f"but received it {'never' if when is None else f'in wave {when}'}"
                        )
                arrived[(b.dst, t)] = b.wave
            received_bytes += t.nbytes
            if id(t) not in sized:
                sized.add(id(t))
                if t.nbytes != prod(t.sizes) * itemsizes[t.tensor]:
                    problems.append(f"{names[t.tensor]} {t.region}: nbytes {t.nbytes} does not match the region")
            if (src, id(t)) not in checked:
                checked.add((src, id(t)))
                if not _inside(t.offsets, t.sizes, boxes_of(src, t.tensor)):
                    problems.append(f"{names[t.tensor]} {t.region}: sent by rank {src}, which does not hold it")
            key = (b.dst, t.tensor)
            lst = received.get(key)
            if lst is None:
                lst = received[key] = []
            lst.append(t)

    needed_bytes = 0
    groups: dict[int, tuple[Layout, list[int]]] = {}
    for layout in destinations:  # identical engines share their tensor table: walk it once
        groups.setdefault(id(layout.tensors), (layout, []))[1].append(base[layout.instance])
    derived = {q[2] for q in plan.quantized}  # computed by the receivers that quantise
    for layout, bases in groups.values():
        for t in layout.tensors:
            tensor = index.get(t.spec.name)
            if tensor is None and t.spec.name in derived:
                continue
            if tensor is None:
                problems.append(f"{t.spec.name}: held by {layout.instance} but missing from the plan")
                continue
            need: dict[int, list[Box]] = {}
            for box, locals_ in layout.holdings(t.spec.name):
                for local in locals_:
                    need.setdefault(local, []).append(box)
            isz = itemsizes[tensor]
            for local, boxes in need.items():
                numel = sum(b.numel for b in boxes)
                for first in bases:
                    rank = first + local
                    needed_bytes += numel * isz
                    got = received.pop((rank, tensor), [])
                    if len(got) == 1 and len(boxes) == 1:
                        exact = got[0].offsets == boxes[0].offsets and got[0].sizes == boxes[0].sizes
                    else:
                        exact = (
                            sum(prod(g.sizes) for g in got) == numel
                            and all(_inside(g.offsets, g.sizes, boxes) for g in got)
                            and _pairwise_disjoint([g.region for g in got])
                        )
                    if not exact:
                        r = plan.ranks[rank]
                        problems.append(
                            f"{t.spec.name}: rank {rank} ({r.instance}:{r.local_rank}) is not covered exactly once"
                        )
    for rank, tensor in sorted(received):
        problems.append(f"{names[tensor]}: rank {rank} receives data it does not hold")
    return CoverageReport(not problems, needed_bytes, received_bytes, problems[:max_problems])


def _inside(offsets: tuple[int, ...], sizes: tuple[int, ...], boxes: list[Box]) -> bool:
    for box in boxes:
        for o, s, bo, bs in zip(offsets, sizes, box.offsets, box.sizes):
            if o < bo or o + s > bo + bs:
                break
        else:
            return True
    return False


def _pairwise_disjoint(boxes: list[Box]) -> bool:
    """Whether no two boxes overlap (sorted sweep along the first dimension)."""
    if len(boxes) < 2:
        return True
    if boxes[0].ndim == 0:
        return False
    boxes = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):
        end = a.offsets[0] + a.sizes[0]
        for b in boxes[i + 1 :]:
            if b.offsets[0] >= end:
                break
            if a.intersect(b) is not None:
                return False
    return True
