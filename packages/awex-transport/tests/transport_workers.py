"""Worker processes for the transport tests (spawned: must live in an importable module)."""

from __future__ import annotations

import os
import time
import traceback
import zlib

import torch

from awex.meta import Box, PlanOptions, plan_transfers
from awex.meta.origins import transfer_origins
from awex.transport import LocalShards, WaveExecutor, create_sync_group
from awex.transport.digest import add, region_digest
from awex.transport.p2p.digesting import WaveDigests
from awex.transport.shards import torch_dtype


def canonical_value(name: str, shape: tuple[int, ...], dtype: str, step: int) -> torch.Tensor:
    """A deterministic tensor per (name, step): what the trainer 'holds' at that step."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * step)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch_dtype(dtype))


def worker(
    role: str,
    layout_docs: list[dict],
    instance: str,
    local_rank: int,
    host: str,
    port: int,
    timeout: float,
    results,
    behaviour: str = "normal",
    wave_bytes: int = 256 << 20,
    allow_cast: tuple = (),
    direct_bytes: int | None = 4 << 20,
    receiver_pieces: int = 2,
    broadcast: bool = False,
    topology: str = "",
) -> None:
    from awex.meta.serialize import layout_from_wire
    from awex.meta.topology import Topology

    try:
        layouts = [layout_from_wire(d) for d in layout_docs]
        sources = [lay for lay in layouts if lay.role.value == "trainer"]
        dests = [lay for lay in layouts if lay.role.value == "inference"]
        plan = plan_transfers(
            sources,
            dests,
            PlanOptions(
                wave_bytes=wave_bytes,
                allow_cast=tuple(allow_cast),
                direct_bytes=direct_bytes,
                broadcast=broadcast,
                topology=Topology.parse(topology) if topology else None,
            ),
        )
        me = plan.rank(instance, local_rank)
        layout = next(lay for lay in layouts if lay.instance == instance)
        natives: dict[str, torch.Tensor] = {}

        if role == "trainer":

            def view_of(name, box):
                spec = layout.tensor(name).spec
                if behaviour == "fill_before_pack":  # nothing there until each wave's before_pack fills it
                    return torch.zeros(box.sizes, dtype=torch_dtype(spec.dtype))
                return canonical_value(name, spec.shape, spec.dtype, 1)[box.slices()].clone()
        else:
            # receivers write into views of bigger "native" buffers: every box of a tensor lives inside one
            # fused buffer per rank (like vLLM's qkv_proj), so the writes must land in place
            # and (receiver_pieces=2) boxes with more than one row come as two pieces in separate buffers (as
            # Megatron's per-group QKV); with receiver_pieces=1 each box is one contiguous view
            def view_of(name, box):
                spec = layout.tensor(name).spec
                pieces = []
                subs = [box]
                if box.sizes and box.sizes[0] > 1 and receiver_pieces == 2:
                    half = box.sizes[0] // 2
                    subs = [
                        Box(box.offsets, (half,) + box.sizes[1:]),
                        Box((box.offsets[0] + half,) + box.offsets[1:], (box.sizes[0] - half,) + box.sizes[1:]),
                    ]
                for sub in subs:
                    shape = (2 * sub.sizes[0],) + sub.sizes[1:] if sub.sizes else ()
                    fused = natives.setdefault(f"{name}#{sub}", torch.zeros(shape, dtype=torch_dtype(spec.dtype)))
                    pieces.append((sub, fused[sub.sizes[0] :] if sub.sizes else fused))
                return pieces

        shards = LocalShards.from_layout(layout, local_rank, view_of)
        group = create_sync_group(me.rank, plan.world_size, host, port, timeout=timeout)
        group.process_group.barrier().wait()  # every rank has formed the group: a death below comes after it
        if behaviour == "die_before_send":
            os._exit(3)
        if behaviour == "stall":  # alive, connected, but never sends
            time.sleep(timeout * 3)
            return
        if behaviour == "fill_before_pack":
            executor = WaveExecutor(plan, me.rank, shards, group)
            calls = []

            def before_pack(i: int) -> None:
                calls.append(i)
                for name, offsets, sizes in executor.sent_regions[i]:
                    spec = layout.tensor(name).spec
                    full = canonical_value(name, spec.shape, spec.dtype, 1)
                    shards.copy_in(name, offsets, sizes, full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])

            beside: list[int] = []  # waves packed when the work beside the transfer ran
            stats = executor.run(timeout=timeout, before_pack=before_pack, meanwhile=lambda: beside.append(len(calls)))
            if calls != list(range(len(executor.waves))):
                raise AssertionError(f"before_pack called for waves {calls}, expected 0..{len(executor.waves) - 1}")
            if beside != [1]:  # once, with the first wave posted (gloo waits for each wave), not after the transfer
                raise AssertionError(f"meanwhile ran with {beside} waves packed, expected once, with 1")
        elif behaviour == "digests":  # verify mode: digests taken wave by wave, against this rank's own after
            executor = WaveExecutor(plan, me.rank, shards, group)
            digests = WaveDigests(plan, me.rank, shards)
            executor.run(timeout=timeout, digests=digests)
            stats = executor.run(timeout=timeout, digests=digests)  # a second version: the sums start from zero
            sent, got = digests.read()
            extra = {"sent": _after(plan, me.rank, shards, sends=True), "got": _after(plan, me.rank, shards)}
            if (sent, got) != (extra["sent"], extra["got"]):
                raise AssertionError(f"wave by wave {sent} / {got}, after the transfer {extra}")
        else:
            executor = WaveExecutor(plan, me.rank, shards, group)
            stats = executor.run(timeout=timeout)
        extra = extra if behaviour == "digests" else {}
        bad = []
        if role == "inference":
            for name in shards.names():
                spec = layout.tensor(name).spec
                full = canonical_value(name, spec.shape, spec.dtype, 1)
                for box, view in shards.pairs(name):
                    if not torch.equal(view, full[box.slices()]):
                        bad.append(f"{name} {box}")
            for key, fused in natives.items():
                if fused.dim() and fused.shape[0] >= 2 and torch.count_nonzero(fused[: fused.shape[0] // 2].float()):
                    bad.append(f"{key}: wrote outside its view")
        results.put(
            (
                instance,
                local_rank,
                "ok" if not bad else "mismatch: " + ", ".join(bad[:5]),
                stats.bytes_received,
                stats.bytes_sent,
                executor.direct_bytes,
                extra,
            )
        )
    except BaseException as e:  # reported to the test
        results.put((instance, local_rank, f"error: {type(e).__name__}: {e}\n{traceback.format_exc()}", 0, 0, 0))


def _after(plan, rank: int, shards: LocalShards, sends: bool = False) -> dict[int, tuple[int, int]]:
    """What verify mode digests after the transfer: per receiving rank, the regions this rank originates for it
    (``sends``), else per origin, the regions it got from it."""
    out: dict[int, tuple[int, int]] = {}
    for b, t, o in transfer_origins(plan):
        if (o if sends else b.dst) != rank:
            continue
        spec = plan.tensors[t.tensor]
        d = region_digest(shards, spec.name, tuple(spec.shape), spec.dtype, t.offsets, t.sizes)
        group = b.dst if sends else o
        out[group] = add(out.get(group, (0, 0)), d)
    return out
