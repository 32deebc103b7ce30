"""An element-by-element oracle for plans: slow, obviously correct, independent of the planner's code."""

from __future__ import annotations

import itertools

from awex.meta import Layout, Plan
from awex.meta.plan import RELAY_LAG


def elements(offsets, sizes):
    return itertools.product(*[range(o, o + s) for o, s in zip(offsets, sizes)])


def check_plan_by_elements(plan: Plan, sources: list[Layout], destinations: list[Layout]) -> None:
    """Assert: each needed element is received exactly once, nothing unneeded is sent, senders hold what they send."""
    layouts = {layout.instance: layout for layout in (*sources, *destinations)}
    name = [t.name for t in plan.tensors]

    def holds(rank: int, tensor: str) -> set:
        r = plan.ranks[rank]
        layout = layouts[r.instance]
        if tensor not in layout:
            return set()
        out = set()
        for box in layout.rank_boxes(r.local_rank).get(tensor, ()):
            out.update(elements(box.offsets, box.sizes))
        return out

    received: dict[tuple[int, str], list] = {}
    arrival: dict[tuple[int, str, tuple], int] = {}  # element -> wave it reached a destination
    for bucket in sorted(plan.buckets, key=lambda b: b.wave):
        assert sum(t.nbytes for t in bucket.transfers) == bucket.nbytes
        for t in bucket.transfers:
            cells = list(elements(t.offsets, t.sizes))
            assert t.nbytes == len(cells) * plan.tensors[t.tensor].itemsize
            assert set(cells) <= holds(bucket.src, name[t.tensor]), "sender does not hold what it sends"
            if plan.ranks[bucket.src].role.value == "inference":  # a relay: it must have received them before
                for c in cells:
                    assert arrival.get((bucket.src, name[t.tensor], c), 1 << 30) <= bucket.wave - RELAY_LAG, (
                        "a destination relays data before it arrived"
                    )
            for c in cells:
                arrival[(bucket.dst, name[t.tensor], c)] = bucket.wave
            received.setdefault((bucket.dst, name[t.tensor]), []).extend(cells)

    for r in plan.ranks:
        if r.role.value != "inference":
            assert not any(key[0] == r.rank for key in received), "a trainer rank receives"
            continue
        for tensor in layouts[r.instance].names:
            need = holds(r.rank, tensor)
            got = received.pop((r.rank, tensor), [])
            assert len(got) == len(set(got)), f"{tensor}: rank {r.rank} receives an element twice"
            assert set(got) == need, f"{tensor}: rank {r.rank} misses or gets unneeded elements"
    assert not received, f"data sent that nobody needs: {sorted(received)[:3]}"
