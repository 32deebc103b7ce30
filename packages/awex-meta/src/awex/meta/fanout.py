"""Routing pieces over a topology: from a holder on the destination's own device or node where there is one,
else into each node that needs a piece once, over one GPU's NIC, and on to that node's other GPUs over NVLink.

The planner calls :func:`take_local` for ranks sharing a device (``PlanOptions.devices``) and, with a
:class:`~awex.meta.topology.Topology`, :meth:`NodeFanout.route` for every piece; after sources are chosen,
:meth:`NodeFanout.relays` says which destination forwards what to whom (the relays :mod:`awex.meta.schedule`
schedules :data:`~awex.meta.plan.RELAY_LAG` waves after the first hop).
"""

from __future__ import annotations

from awex.meta.balance import PairTransfers
from awex.meta.plan import Transfer
from awex.meta.schedule import Relays
from awex.meta.topology import Placement


def take_local(
    dsts: tuple[int, ...],
    cands: tuple[int, ...],
    where: list | tuple,
    out: PairTransfers,
    load: list[int],
    transfer: Transfer,
) -> tuple[int, ...]:
    """Give each destination with a candidate source at its own place (``where[rank]``: a device or a node;
    ``None`` is nowhere) the piece from there, from the least loaded such source; returns the destinations left."""
    rest = []
    for g in dsts:
        here = where[g]
        local = [c for c in cands if here is not None and where[c] == here]
        if not local:
            rest.append(g)
            continue
        src = min(local, key=lambda c: (load[c], c))
        load[src] += transfer.nbytes
        out.setdefault((src, g), []).append(transfer)
    return tuple(rest)


class NodeFanout:
    """Per piece: destinations on a GPU or else a node where a source holds it take it from there (a copy on the
    GPU, NVLink in the node); of the others,
    one per node (the one whose NIC has received least so far) receives it for the node and forwards it.

    Also keeps the bound on the busiest receiving NIC: every node's distinct needed bytes (those no GPU of the
    node holds) over the number of that node's GPUs that need any (each has a NIC).
    """

    def __init__(self, placement: Placement, world_size: int):
        self.node = placement.node
        self.gpu = placement.gpu
        self.device = list(zip(placement.node, placement.gpu))
        self.ingress = [0] * world_size
        self.local: PairTransfers = {}  # pieces taken from a holder on the destination's node
        self.local_load = [0] * world_size
        self.followers: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]] = {}
        self.node_bytes: dict[int, int] = {}
        self.node_gpus: dict[int, set[int]] = {}

    def route(self, transfer: Transfer, cands: tuple[int, ...], dsts: tuple[int, ...]) -> tuple[int, ...]:
        """The destinations that receive ``transfer`` over their NIC (one per node), for the source assignment."""
        rest = take_local(dsts, cands, self.device, self.local, self.local_load, transfer)
        rest = take_local(rest, cands, self.node, self.local, self.local_load, transfer) if rest else rest
        by_node: dict[int, list[int]] = {}
        for d in rest:
            by_node.setdefault(self.node[d], []).append(d)
        entries = []
        for node, ds in sorted(by_node.items()):
            self.node_bytes[node] = self.node_bytes.get(node, 0) + transfer.nbytes
            self.node_gpus.setdefault(node, set()).update(self.gpu[d] for d in ds)
            entry = min(ds, key=lambda d: (self.ingress[d], d))
            self.ingress[entry] += transfer.nbytes
            entries.append(entry)
            if len(ds) > 1:
                others = tuple(d for d in ds if d != entry)
                self.followers.setdefault((entry, transfer.tensor), []).append(
                    (transfer.offsets, transfer.sizes, others)
                )
        return tuple(entries)

    def relays(self, per_pair: PairTransfers) -> Relays:
        """For every transfer an entry receives, the node's other destinations it forwards it to."""
        out: Relays = {}
        for (src, dst), ts in per_pair.items():
            for t in ts:
                for off, size, others in self.followers.get((dst, t.tensor), ()):
                    if _inside(t.offsets, t.sizes, off, size):
                        out[(src, dst, t)] = list(others)
                        break
        return out

    def recv_bound(self) -> int:
        return max((-(-n // len(self.node_gpus[node])) for node, n in self.node_bytes.items()), default=0)


def _inside(offsets, sizes, outer_offsets, outer_sizes) -> bool:
    return all(o >= oo and o + s <= oo + os for o, s, oo, os in zip(offsets, sizes, outer_offsets, outer_sizes))
