"""The planner: a pure, deterministic function from source and destination layouts to a :class:`Plan`.

1. Check that destinations can be served: every tensor they need exists on a source with the same shape and
   dtype. Otherwise raise :class:`PlanError` naming every offending tensor; nothing is planned.
2. Cut every box a destination rank holds into pieces, each lying inside one distinct source box, and note
   which source ranks hold each piece (replicas hold the same box).
3. Pick a source for every piece, spreading load over replicas (:mod:`awex.meta.balance`).
4. Where one source would feed several destinations with the same region and be the busiest rank, let
   destinations relay it; cut every pair's traffic into waves of bounded size (:mod:`awex.meta.schedule`).

The result does not depend on the order of the input layouts (they are sorted by instance name) and is
identical on every rank; compare :attr:`Plan.digest` across ranks to prove it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from itertools import product
from typing import Callable, Sequence

from awex.meta.balance import PairTransfers, Piece, assign_sources
from awex.meta.box import Box, intersect
from awex.meta.dtypes import is_exact_cast
from awex.meta.errors import AwexValueError
from awex.meta.fanout import NodeFanout, take_local
from awex.meta.layout import Layout
from awex.meta.plan import Plan, PlanStats, Transfer
from awex.meta.problems import missing as missing_lines
from awex.meta.problems import narrowed as narrowed_lines
from awex.meta.quant import FP8_DTYPES, SCALE_SUFFIX, quantized_weights, scale_name
from awex.meta.schedule import assign_waves, plan_relays, split_broadcasts
from awex.meta.spec import RankDescriptor, Role, TensorSpec
from awex.meta.topology import Placement, Topology

log = logging.getLogger("awex.meta")


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the planner.

    ``wave_bytes`` is about the most a rank sends plus receives in one wave; a transport stages about two waves
    (double buffering), so it bounds staging memory per rank to about ``2 * wave_bytes`` (512 MiB by
    default). A piece of at least ``2 * split_bytes`` may be split over several source replicas in parts
    of at least ``split_bytes``; smaller pieces go whole to one source. ``relay`` lets destinations forward
    regions a single source would otherwise send to several of them.

    ``devices`` names the physical device of ranks, as ``(instance, local_rank, device)``: a destination takes
    a piece from a source rank on its own device when one holds it (the least loaded of them), and only the
    rest is spread over sources by load. With CUDA IPC (engines sharing GPUs) that turns a link transfer into
    a same-GPU copy, e.g. for trainer data-parallel replicas colocated with rollout engines.

    Dtype policy: the destination's dtype decides what moves (the sender converts while packing). A widening
    cast that loses nothing (bf16 -> fp32) is allowed and logged; a narrowing one (fp32 -> bf16, which would
    silently change precision, e.g. of an MoE router) is a :class:`PlanError` unless the tensor's name matches
    one of the ``allow_cast`` glob patterns (``("*.mlp.gate.weight",)``, or ``("*",)`` for all).

    ``direct_bytes``: a transfer of at least this many bytes travels as its own message, which a transport
    may send straight from and receive straight into an engine's memory where that is contiguous (no staging
    copies); smaller ones share one message per bucket. ``None``: every bucket is one message. Part of the
    plan's digest, since both ends of a message must agree on it.

    ``broadcast``: regions one source sends to several destinations go, wave by wave, as one broadcast to all
    of them (NCCL pipelines a broadcast through its members, so the source's egress stays one copy) instead of
    relays; implies ``relay=False``. Such regions are cut into waves once per source and destination set, into
    identical buckets for each destination (:func:`awex.meta.schedule.split_broadcasts`; a pair may then meet
    in two buckets of one wave, its own and a shared one), counted once in the source's load; part of the
    digest. Not the default: not yet measured on GPUs against relays.

    ``topology``: where ranks run (:class:`~awex.meta.topology.Topology`: nodes of GPUs, a NIC per GPU, NVLink
    inside a node). A destination takes a piece from a holder on its own node where there is one; the rest enters
    each node that needs it once, through the NIC of the destination that has received least, which forwards it
    to the node's other destinations (relays, :mod:`awex.meta.fanout`); sources are balanced on what then crosses
    NICs. Replaces the hot-source relays of ``relay``; not with ``broadcast``. ``hosts`` names the host of ranks,
    as ``(instance, local_rank, host)``: with a topology, ranks on one host share a node whatever its placement
    rule says (how the writer and reader plan a sync across hosts).

    ``quantize_on_receive``: a destination's block-quantised FP8 weight (with its ``weight_scale_inv``) may come
    from a source that holds it unquantised: the weight travels in the source's dtype and the receiver quantises it
    into its FP8 weight and scales (the scales have no transfers). Listed in :attr:`Plan.quantized`; CUDA IPC
    receivers fuse it with the copy (``awex.transport.ipc``). Receivers' boxes and sources' must be whole tiles.
    """

    wave_bytes: int = 256 << 20
    split_bytes: int = 16 << 20
    relay: bool = True
    allow_cast: tuple[str, ...] = ()
    devices: tuple[tuple[str, int, str], ...] = ()
    direct_bytes: int | None = 64 << 20
    broadcast: bool = False
    topology: Topology | None = None
    hosts: tuple[tuple[str, int, str], ...] = ()
    quantize_on_receive: bool = False

    def __post_init__(self) -> None:
        if self.broadcast:
            object.__setattr__(self, "relay", False)
            if self.topology is not None:
                raise AwexValueError("broadcast and topology do not combine: a topology fans out by node relays")
        if self.wave_bytes <= 0 or self.split_bytes <= 0:
            raise AwexValueError("wave_bytes and split_bytes must be positive")
        if self.direct_bytes is not None and self.direct_bytes <= 0:
            raise AwexValueError("direct_bytes must be positive (None: no direct messages)")
        if isinstance(self.allow_cast, str):
            object.__setattr__(self, "allow_cast", (self.allow_cast,))
        object.__setattr__(self, "devices", tuple(sorted((str(i), int(r), str(d)) for i, r, d in self.devices)))
        object.__setattr__(self, "hosts", tuple(sorted((str(i), int(r), str(h)) for i, r, h in self.hosts)))


class PlanError(AwexValueError):
    """The layouts cannot be served: lists every problem found (missing tensors, shape or dtype mismatches)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"cannot plan weight transfer ({len(problems)} problem(s)):\n  {shown}{more}")


def plan_transfers(
    sources: Sequence[Layout],
    destinations: Sequence[Layout],
    options: PlanOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Plan:
    """Plan moving every tensor the destinations hold from the sources that hold it. ``progress(stage, done,
    total)``, if given, hears how far planning is (stages ``tensors``, ``sources``, ``waves``); it changes nothing
    in the plan."""
    started = time.perf_counter()
    tell = progress or (lambda stage, done, total: None)
    options = options or PlanOptions()
    sources = sorted(sources, key=lambda layout: layout.instance)
    destinations = sorted(destinations, key=lambda layout: layout.instance)
    if not sources or not destinations:
        raise PlanError(["need at least one source and one destination layout"])
    names = [layout.instance for layout in (*sources, *destinations)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PlanError([f"instance name(s) used twice: {dupes}"])

    ranks: list[RankDescriptor] = []
    offsets: dict[str, int] = {}
    for role, layouts in ((Role.TRAINER, sources), (Role.INFERENCE, destinations)):
        for layout in layouts:
            first = offsets[layout.instance] = len(ranks)
            ranks.extend([RankDescriptor(first + i, layout.instance, role, i) for i in range(layout.world_size)])

    dst_groups = _group_identical(destinations, offsets)
    tensors, casts, quantized = _check_tensors(
        _group_identical(sources, offsets), dst_groups, options.allow_cast, options.quantize_on_receive
    )
    if casts:
        log.info(
            "plan casts %d tensor(s) on the way (source -> destination dtype): %s",
            len(casts),
            ", ".join(f"{n} {a}->{b}" for n, a, b in casts[:20]) + (" ..." if len(casts) > 20 else ""),
        )
    itemsizes = [t.itemsize for t in tensors]

    groups: dict[tuple[int, ...], list[Piece]] = {}
    recv = [0] * len(ranks)
    known = {(i, r): d for i, r, d in options.devices}
    device_of = [known.get((rank.instance, rank.local_rank)) for rank in ranks]
    same_device: PairTransfers = {}  # pieces a destination takes from a source on its own device
    same_device_load = [0] * len(ranks)
    fanout = ports = None
    if options.topology:
        placement = Placement.of(options.topology, ranks, options.hosts)
        fanout, ports = NodeFanout(placement, len(ranks)), placement.ports(options.topology)
    piece_cache: dict[tuple, list] = {}
    src_cache: dict[tuple, list[tuple[Box, tuple[int, ...]]]] = {}
    problems: list[str] = []
    for tidx, spec in enumerate(tensors):
        if tidx % 64 == 0:
            tell("tensors", tidx, len(tensors))
        name = spec.name
        isz = itemsizes[tidx]
        holders = [layout for layout in sources if name in layout]
        src_key = tuple(layout.sharding_key(name) for layout in holders)
        src_boxes = src_cache.get(src_key)
        if src_boxes is None:
            src_boxes = _merge_source_holdings(holders, offsets, name)
            src_cache[src_key] = src_boxes
        for gi, (rep, bases) in enumerate(dst_groups):
            if name not in rep:
                continue
            t = rep.tensor(name)
            key = (src_key, gi, t.sharding, t.spec.shape)
            pieces = piece_cache.get(key)
            if pieces is None:
                pieces, missing = _cut_pieces(rep.holdings(name), src_boxes)
                for box in missing:
                    problems.append(f"{name}: region {box} needed by {rep.instance} is held by no source rank")
                piece_cache[key] = pieces
            for p_off, p_size, cands, dst_locals in pieces:
                nbytes = isz
                for n in p_size:
                    nbytes *= n
                group = groups.get(cands)
                if group is None:
                    group = groups[cands] = []
                dsts = tuple(base + local for base in bases for local in dst_locals)
                for g in dsts:
                    recv[g] += nbytes
                if known or fanout:
                    transfer = Transfer(tidx, p_off, p_size, nbytes)
                    if known:
                        dsts = take_local(dsts, cands, device_of, same_device, same_device_load, transfer)
                    if fanout and dsts:
                        dsts = fanout.route(transfer, cands, dsts)
                    if not dsts:
                        continue
                group.append((-nbytes, tidx, p_off, p_size, dsts))
    if problems:
        raise PlanError(sorted(set(problems)))

    tell("tensors", len(tensors), len(tensors))
    index = {t.name: i for i, t in enumerate(tensors)}
    whole = frozenset(index[q[0]] for q in quantized)  # tiles quantised on receive: never cut through
    per_pair, lower_send = assign_sources(groups, len(ranks), options.split_bytes, whole)
    tell("sources", 1, 1)
    del groups
    relays = fanout.relays(per_pair) if fanout else {}
    for local in (same_device, fanout.local if fanout else {}):
        for pair, transfers in local.items():
            per_pair.setdefault(pair, []).extend(transfers)
    if options.relay and not fanout:
        relays = plan_relays(per_pair, len(ranks))
    broadcasts = None
    if options.broadcast:
        per_pair, broadcasts = split_broadcasts(per_pair)
    row_multiples = [1] * len(tensors)
    for q in quantized:
        row_multiples[index[q[0]]] = q[3][0]
    ordered, waves = assign_waves(
        per_pair, relays, itemsizes, options.wave_bytes, len(ranks), options.split_bytes, broadcasts, row_multiples,
        ports,
    )  # fmt: skip
    tell("waves", 1, 1)
    role_of = [r.role for r in ranks]

    send = [0] * len(ranks)
    got = [0] * len(ranks)
    ops = 0
    relayed = 0
    for b in ordered:
        send[b.src] += b.nbytes
        got[b.dst] += b.nbytes
        ops += len(b.transfers)
        if role_of[b.src] == Role.INFERENCE:
            relayed += b.nbytes
    stats = PlanStats(
        total_bytes=sum(send),
        tensors=len(tensors),
        ops=ops,
        buckets=len(ordered),
        waves=waves,
        max_rank_send_bytes=max(send),
        max_rank_recv_bytes=max(got),
        lower_bound_send_bytes=lower_send,
        lower_bound_recv_bytes=max(recv),
        redundant_bytes=sum(got) - sum(recv),
        plan_seconds=time.perf_counter() - started,
        relayed_bytes=relayed,
        nic_bound_bytes=max(fanout.recv_bound(), lower_send) if fanout else 0,
    )
    return Plan(
        tuple(ranks), tuple(tensors), tuple(ordered), stats, options, casts=tuple(casts), quantized=tuple(quantized)
    )


def _group_identical(layouts: Sequence[Layout], offsets: dict[str, int]) -> list[tuple[Layout, list[int]]]:
    """Group instances with identical layouts (e.g. N vLLM engines of one shape): (representative, base ranks)."""
    groups: list[tuple[Layout, list[int]]] = []
    for layout in layouts:
        for rep, bases in groups:
            if (
                rep.world_size == layout.world_size
                and rep.meshes == layout.meshes
                and (rep.tensors is layout.tensors or rep.tensors == layout.tensors)
            ):
                bases.append(offsets[layout.instance])
                break
        else:
            groups.append((layout, [offsets[layout.instance]]))
    return groups


def _check_tensors(
    sources: list[tuple[Layout, list[int]]],
    destinations: list[tuple[Layout, list[int]]],
    allow_cast: tuple[str, ...] = (),
    quantize_on_receive: bool = False,
) -> tuple[list[TensorSpec], list[tuple[str, str, str]], list[tuple]]:
    """Specs of every tensor some destination holds (in the destination's dtype; a weight quantised on receive in
    the source's), the casts on the way and the weights receivers quantise, after checking sources agree."""
    problems: list[str] = []
    casts: list[tuple[str, str, str]] = []
    quantized: list[tuple] = []  # (weight, FP8 dtype, scale tensor, tile block)
    wire: dict[str, TensorSpec] = {}

    def collect(groups: list[tuple[Layout, list[int]]], side: str) -> dict[str, TensorSpec]:
        specs: dict[str, TensorSpec] = {}
        for layout, _ in groups:
            for t in layout.tensors:
                seen = specs.setdefault(t.spec.name, t.spec)
                if seen != t.spec:
                    problems.append(
                        f"{t.spec.name}: {side} instances disagree: {tuple(seen.shape)} {seen.dtype} vs "
                        f"{tuple(t.spec.shape)} {t.spec.dtype} ({layout.instance})"
                    )
        return specs

    src = collect(sources, "source")
    dst = collect(destinations, "destination")
    derived = set()  # scales of weights quantised on receive: computed by the receivers, never moved
    if quantize_on_receive:
        quantized = quantized_weights(src, dst, problems)
        for name, _, scale, _ in quantized:
            wire[name] = src[name]
            derived.add(scale)
    absent: list[tuple[str, str]] = []
    narrowing: list[tuple[str, str, str]] = []
    for name in sorted(dst):
        d = dst[name]
        s = src.get(name)
        if name in wire or name in derived:
            continue
        if s is None:
            hint = (
                " (the destination loads FP8 block-quantised weights: quantise on the sender, see awex.meta.quant; a "
                "writer with quantize_on_receive='auto' picks who quantises)"
                if name.endswith(SCALE_SUFFIX)
                else ""
            )
            absent.append((name, hint))
        elif s.shape != d.shape:
            problems.append(f"{name}: shape mismatch: source {tuple(s.shape)} vs destination {tuple(d.shape)}")
        elif d.dtype in FP8_DTYPES and s.dtype not in FP8_DTYPES and scale_name(name) in dst:
            problems.append(
                f"{name}: the destination holds it block-quantised ({d.dtype} with {scale_name(name)}); "
                f"a cast from {s.dtype} cannot produce that: quantise on the sender (awex.meta.quant), or on "
                "the receiver (PlanOptions.quantize_on_receive, CUDA IPC); a writer with quantize_on_receive='auto' "
                "picks who quantises"
            )
        elif s.dtype != d.dtype:
            if is_exact_cast(s.dtype, d.dtype) or any(fnmatchcase(name, pat) for pat in allow_cast):
                casts.append((name, s.dtype, d.dtype))
            else:
                narrowing.append((name, s.dtype, d.dtype))
    names = tuple(sorted({x.instance for x, _ in sources})), tuple(sorted({x.instance for x, _ in destinations}))
    problems += missing_lines(absent, src, dst, names)
    problems += narrowed_lines(narrowing)
    if problems:
        raise PlanError(problems)
    return [wire.get(n, dst[n]) for n in sorted(dst) if n not in derived], casts, sorted(quantized)


def _merge_source_holdings(
    holders: list[Layout], offsets: dict[str, int], name: str
) -> list[tuple[Box, tuple[int, ...]]]:
    merged: dict[Box, set[int]] = {}
    for layout in holders:
        base = offsets[layout.instance]
        for box, locals_ in layout.holdings(name):
            merged.setdefault(box, set()).update(base + r for r in locals_)
    return [(b, tuple(sorted(r))) for b, r in sorted(merged.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes))]


def _cut_pieces(
    dst_holdings, src_boxes: list[tuple[Box, tuple[int, ...]]]
) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]], list[Box]]:
    """Pieces ``(offsets, sizes, source ranks, destination local ranks)`` covering every destination box once."""
    pieces = []
    missing: list[Box] = []
    for dbox, dst_locals in dst_holdings:
        hits = []
        for sbox, cands in src_boxes:
            inter = intersect(dbox.offsets, dbox.sizes, sbox.offsets, sbox.sizes)
            if inter is not None:
                hits.append((inter, cands))
        covered = sum(h.numel for h, _ in hits)
        if covered == dbox.numel and _disjoint([h for h, _ in hits]):
            pieces.extend((h.offsets, h.sizes, c, dst_locals) for h, c in hits)
            continue
        cells, uncovered = _refine(dbox, hits)
        missing.extend(uncovered)
        pieces.extend((c.offsets, c.sizes, cands, dst_locals) for c, cands in cells)
    return pieces, missing


def _disjoint(boxes: list[Box]) -> bool:
    for i, a in enumerate(boxes):
        for b in boxes[:i]:
            if a.intersect(b) is not None:
                return False
    return True


def _refine(dbox: Box, hits: list[tuple[Box, tuple[int, ...]]]) -> tuple[list[tuple[Box, tuple[int, ...]]], list[Box]]:
    """Grid cells of ``dbox`` cut at every source box edge, each with the union of its holders.

    The slow path, taken only when source boxes overlap without being equal (e.g. two source instances with
    different layouts). Cells nobody holds are returned as uncovered.
    """
    cuts = []
    for d in range(dbox.ndim):
        points = {dbox.offsets[d], dbox.offsets[d] + dbox.sizes[d]}
        for h, _ in hits:
            points.add(h.offsets[d])
            points.add(h.offsets[d] + h.sizes[d])
        cuts.append(sorted(points))
    cells = []
    uncovered = []
    for spans in product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        cell = Box(tuple(lo for lo, _ in spans), tuple(hi - lo for lo, hi in spans))
        cands = sorted({r for h, cs in hits if h.contains(cell) for r in cs})
        if cands:
            cells.append((cell, tuple(cands)))
        else:
            uncovered.append(cell)
    return cells, uncovered
