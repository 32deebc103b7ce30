"""Which transport a sync should use, from where its ranks run: CUDA IPC on one host for CUDA ranks, shared
memory on one host for CPU ranks, else point to point.

The transports (``awex.transport.registry``) and when ``auto`` takes each:

- ``"ipc"``: every rank on one host. Receivers pull with their GPUs' copy engines straight from the trainers'
  memory (a same-GPU copy where they share a GPU). No relay: a region several receivers need leaves its source
  once per receiver, so a source's egress multiplies with the fan-out.
- ``"p2p"``: NCCL (gloo on CPU) in waves through staging buffers, with relays that keep a source's egress at
  one copy of what it holds however many instances need it. What `auto` takes across hosts.
  NCCL cannot put two ranks on one GPU, so engines sharing a GPU must use ``"ipc"``.
- ``"shm"``: every rank a CPU rank on one host, copying into its own views: each sender writes a version once
  into shared memory, receivers copy out (measured faster than gloo on one host: docs/performance.md). With
  ``refresh_by_wave``, ``"p2p"`` (only it overlaps the refresh with the transfer).
- ``"rdma"``: one-sided reads through Mooncake's transfer engine, across hosts; never chosen by ``auto`` yet
  (which stays with ``"p2p"`` across hosts until rdma is measured against NCCL on RDMA NICs); ask for it by name.

On one host, copy engines move bytes at least as fast as NCCL, with no waves or staging (measured: see
:data:`IPC_RATE_MARGIN`), so ``"ipc"`` wins unless it makes some GPU move more bytes over the links than
the relayed point-to-point plan does, by more than that rate's margin (:data:`IPC_RATE_MARGIN`).
:func:`choose_transport` compares the busiest GPU of both plans; a GPU that several other GPUs pull from at
once (a second one taking at least a quarter of its egress) counts that egress :data:`SHARED_SOURCE_FACTOR`
times (their copy engines share it poorly).

CUDA IPC across GPUs also needs every receiver to *reach* the GPUs it reads from: the source GPU must be
visible in the receiver's process and peer access possible (one GPU per process, as Ray's
``CUDA_VISIBLE_DEVICES`` gives, rules it out). Ranks publish which devices they reach; :func:`unreachable`
lists the reads that cannot happen, and ``"auto"`` then takes ``"p2p"`` (or refuses, where engines share GPUs
and NCCL cannot serve them either).

A sender that derives what it sends wave by wave (FP8 quantisation on the fly) overlaps that work with the
transfer only point to point; over CUDA IPC it finishes before receivers read. Then ``"p2p"`` is chosen unless
engines share GPUs (measured: docs/performance.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from awex.meta.errors import AwexValueError
from awex.meta.plan import Plan

IPC_RATE_MARGIN = 1.05
"""How many more bytes the busiest GPU may move over CUDA IPC than point to point and IPC still be chosen: copy
engines pulling over NVLink against NCCL's point-to-point rate (measured: docs/performance.md)."""

SHARED_SOURCE_FACTOR = 1.5
"""How much longer a GPU takes to serve its bytes over CUDA IPC when two or more other GPUs pull from it at once:
their copy engines share its egress less well than NCCL's relayed plan spreads it (measured: docs/performance.md)."""

Devices = Sequence[tuple[str, int, str]]
"""``(instance, local_rank, device)``, a device written ``host/GPU-uuid``; an empty device: not a CUDA rank, or
one that cannot take part in CUDA IPC."""

Reach = Mapping[tuple[str, int], Collection[str]]
"""``(instance, local_rank) -> devices`` (``host/GPU-uuid``) whose memory that rank can read over CUDA IPC: its
own and the visible GPUs it has peer access to. A rank missing here is assumed to reach its own device only."""


class TransportError(AwexValueError):
    """No transport can serve these ranks where they run (raised before any byte moves)."""


@dataclass(frozen=True)
class TransportChoice:
    """The transport for a sync and why (for logs): ``busiest_ipc`` / ``busiest_p2p`` are the most bytes one GPU
    sends or receives over links in each plan (``None`` where that plan was not considered)."""

    transport: str
    reason: str
    busiest_ipc: int | None = None
    busiest_p2p: int | None = None


def link_bytes_per_pair(plan: Plan, device_of: dict[int, str]) -> dict[tuple[str, str], int]:
    """``(source device, destination device) -> bytes`` over links: transfers between ranks on one device are
    left out (same-GPU copies)."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for b in plan.buckets:
        src, dst = device_of[b.src], device_of[b.dst]
        if src != dst:
            out[(src, dst)] += b.nbytes
    return dict(out)


def link_bytes_per_gpu(
    plan: Plan, device_of: dict[int, str], pairs: dict[tuple[str, str], int] | None = None
) -> dict[str, tuple[int, int]]:
    """``device -> (bytes sent, bytes received)`` over links (from :func:`link_bytes_per_pair`, given or
    computed)."""
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    for (src, dst), n in (link_bytes_per_pair(plan, device_of) if pairs is None else pairs).items():
        sent[src] += n
        received[dst] += n
    return {d: (sent[d], received[d]) for d in set(sent) | set(received)}


def unreachable(ipc_plan: Plan, devices: Devices, reach: Reach | None) -> list[str]:
    """The reads of ``ipc_plan`` a receiver cannot make over CUDA IPC (``"vllm-0:0 cannot read trainer:1 on
    host/GPU-b"``); empty when every receiver reaches every device it reads from."""
    known = {(i, r): d for i, r, d in devices}
    reach = reach or {}
    out = set()
    for b in ipc_plan.buckets:
        src, dst = ipc_plan.ranks[b.src], ipc_plan.ranks[b.dst]
        there = known.get((src.instance, src.local_rank), "")
        here = known.get((dst.instance, dst.local_rank), "")
        if there and there != here and there not in reach.get((dst.instance, dst.local_rank), ()):
            out.add(f"{dst.instance}:{dst.local_rank} cannot read {src.instance}:{src.local_rank} on {there}")
    return sorted(out)


def quantized_afar(ipc_plan: Plan, devices: Devices) -> list[str]:
    """The reads of ``ipc_plan`` that a receiver would quantise on receive (:attr:`Plan.quantized`) from a source on
    another GPU (``"vllm-0:0 would quantise model.layers.0.mlp.down_proj.weight read from trainer:0 on
    host/GPU-a"``): quantising on receive reads the source on the receiver's own GPU. Empty where every such read is
    on one GPU, or a rank's device is not known."""
    weights = {q[0] for q in ipc_plan.quantized}
    known = {(i, r): d for i, r, d in devices}
    out = set()
    for b in ipc_plan.buckets:
        src, dst = ipc_plan.ranks[b.src], ipc_plan.ranks[b.dst]
        there = known.get((src.instance, src.local_rank), "")
        here = known.get((dst.instance, dst.local_rank), "")
        if not there or not here or there == here:
            continue
        for t in b.transfers:
            name = ipc_plan.tensors[t.tensor].name
            if name in weights:
                out.add(f"{dst.instance}:{dst.local_rank} would quantise {name} read from {src.instance}:"
                        f"{src.local_rank} on {there}")  # fmt: skip
    return sorted(out)


def choose_transport(
    ipc_plan: Plan,
    p2p_plan: Plan,
    devices: Devices,
    refresh_by_wave: bool = False,
    reach: Reach | None = None,
    shm_ok: bool = False,
) -> TransportChoice:
    """``"ipc"``, ``"shm"`` or ``"p2p"`` for a sync whose ranks run on ``devices`` (see the module docstring);
    ``shm_ok``: every rank is a CPU rank copying into its own views, all on one host.

    ``ipc_plan`` is the plan without relays (planned with ``devices``), ``p2p_plan`` the plan with relays; both
    over the same layouts; ``refresh_by_wave``: the senders quantise (or otherwise derive) what they send wave by
    wave; ``reach``: which devices each rank can read (``None``: every rank reaches every GPU of its host).
    Deterministic: every rank that sees the same devices chooses the same. Raises :class:`TransportError` when
    engines share GPUs (no NCCL) and some receiver cannot reach a GPU it must read.
    """
    device_of: dict[int, str] = {}
    known = {(i, r): d for i, r, d in devices}
    for rank in ipc_plan.ranks:
        device_of[rank.rank] = known.get((rank.instance, rank.local_rank), "")
    missing = sorted(f"{r.instance}:{r.local_rank}" for r in ipc_plan.ranks if not device_of[r.rank])
    if missing:
        if shm_ok and not refresh_by_wave and len(missing) == len(ipc_plan.ranks):
            return TransportChoice("shm", "CPU ranks on one host: each sender writes a version once to shared memory")
        return TransportChoice("p2p", f"not on a CUDA device that can share memory: {', '.join(missing[:8])}")
    hosts = {d.split("/", 1)[0] for d in device_of.values()}
    if len(hosts) > 1:
        return TransportChoice("p2p", f"ranks on {len(hosts)} hosts ({', '.join(sorted(hosts)[:4])})")
    blocked = unreachable(ipc_plan, devices, reach) if reach is not None else []
    if len(set(device_of.values())) < len(device_of):
        if blocked:
            raise TransportError(
                "engines share GPUs, so NCCL cannot serve them, and CUDA IPC cannot either: "
                + "; ".join(blocked[:8])
                + ". Make every GPU of the host visible to every engine "
                "process (CUDA_VISIBLE_DEVICES) and peer access possible between them"
            )
        return TransportChoice("ipc", "engines share GPUs (NCCL cannot put two ranks on one GPU)")
    if blocked:
        return TransportChoice("p2p", "CUDA IPC not possible: " + "; ".join(blocked[:4]))
    if refresh_by_wave:
        return TransportChoice(
            "p2p",
            "the senders refresh what they send wave by wave, which only point to point overlaps with the transfer",
        )
    pairs = link_bytes_per_pair(ipc_plan, device_of)
    read: dict[str, list[int]] = defaultdict(list)  # source GPU -> bytes each other GPU reads from it
    for (src, _), n in pairs.items():
        read[src].append(n)

    def shared(d: str, sent: int) -> bool:  # a second reader takes a real share (not a few boundary rows)
        return len(read[d]) > 1 and sorted(read[d])[-2] * 4 >= sent

    busiest_ipc = max(
        (
            max(int(s * SHARED_SOURCE_FACTOR) if shared(d, s) else s, r)
            for d, (s, r) in link_bytes_per_gpu(ipc_plan, device_of, pairs).items()
        ),
        default=0,
    )
    p2p_device_of = {r.rank: device_of[ipc_plan.rank(r.instance, r.local_rank).rank] for r in p2p_plan.ranks}
    busiest_p2p = max((max(s, r) for s, r in link_bytes_per_gpu(p2p_plan, p2p_device_of).values()), default=0)
    if busiest_ipc <= busiest_p2p * IPC_RATE_MARGIN:
        return TransportChoice(
            "ipc",
            f"one host, the busiest GPU moves {busiest_ipc} B over CUDA IPC, {busiest_p2p} B point to point",
            busiest_ipc,
            busiest_p2p,
        )
    return TransportChoice(
        "p2p",
        f"one host, but fan-out: over CUDA IPC the busiest GPU would move {busiest_ipc} B, "
        f"{busiest_p2p} B point to point with relays",
        busiest_ipc,
        busiest_p2p,
    )
