"""GPU benchmark: Awex syncs against the link limit and against the usual approaches, in one run.

Every scenario runs in fresh processes, one per (engine rank, GPU). Trainer ranks hold a Qwen3-8B-shaped bf16
model in Megatron-core's exact parameter layout (fused QKV by query group, fused gate/up, padded vocabulary),
receivers in vLLM's exact layout (fused qkv_proj / gate_up_proj), both built by ``awex.convert`` (whose layouts
the CPU tests check against the real engines). Per scenario:

- the limits measured in the same run: the bandwidth between two GPUs (the fastest of an NCCL send, two NCCL
  senders into one GPU, and one copy-engine peer copy) and the device-to-device copy bandwidth; the lower
  bound is, over GPUs, the largest of (bytes it must receive from other GPUs, bytes only it holds that other
  GPUs need) / link bandwidth and (bytes copied on the GPU) / copy bandwidth;
- Awex: the first sync (plan, groups, buffers, IPC handles, first transfer) and the steady-state sync (median);
- baselines, same data and layouts: gather to trainer rank 0 then per-tensor NCCL broadcast (the common RL
  stack approach); the same with vLLM-style packed 1 GiB buckets; for colocated scenarios, CUDA IPC handles
  exported and opened again on every update (what per-update IPC backends do);
- correctness: after the first sync and after a second, changed version, every receiver view equals the
  trainer's tensor, bit for bit;
- peak extra GPU memory of the sync on each side (PyTorch allocator).

Run on a machine with 4 GPUs (scenarios needing fewer GPUs use the first ones):

    python -m awex_integration.bench_gpu --out integration/bench-results.json

with ``PYTHONPATH`` holding ``packages/*/src`` and ``integration`` (``nox -s bench`` sets it). Workers talk
through files and the sync groups only: nothing is pickled across processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from awex_integration.bench_common import (
    GIB,
    SCENARIOS,
    auto_transport,
    bits,
    fill,
    launch_workers,
    layouts_of,
    mismatches,
    model_tensors,
    native_params,
    scenario_devices,
    sparse_value,
)
from awex_integration.estimate_check import predict


def sources_ranks(plan):
    return [r for r in plan.ranks if r.role.value == "trainer"]


def dest_ranks(plan):
    return [r for r in plan.ranks if r.role.value != "trainer"]


def lower_bound(plan, gpu_of: dict[int, int], link_bps: float, copy_bps: float) -> tuple[float, dict]:
    """Seconds the busiest GPU needs at the measured limits (see the module docstring); plan without relay."""
    inbound: dict[int, int] = {}
    outbound: dict[int, int] = {}
    local: dict[int, int] = {}
    unique_out: set = set()
    for b in plan.buckets:
        gs, gd = gpu_of[b.src], gpu_of[b.dst]
        if gs == gd:
            local[gd] = local.get(gd, 0) + b.nbytes
            continue
        inbound[gd] = inbound.get(gd, 0) + b.nbytes
        for t in b.transfers:
            if (gs, t) not in unique_out:  # what only this GPU holds leaves it at least once
                unique_out.add((gs, t))
                outbound[gs] = outbound.get(gs, 0) + t.nbytes
    worst = 0.0
    for g in set(inbound) | set(outbound) | set(local):
        remote = max(inbound.get(g, 0), outbound.get(g, 0))
        worst = max(worst, remote / link_bps if remote else 0.0, local.get(g, 0) / copy_bps)
    return worst, {"inbound": inbound, "outbound": outbound, "local": local}


def fused_bound(plan, gpu_of: dict[int, int], copy_bps: float) -> float | None:
    """Seconds the busiest GPU needs to quantise on the copy (``plan``: quantising on receive, every piece read on
    its own GPU): each quantised weight's bytes read once and half of them (FP8) written, the rest copied, at the
    device's memory rate (twice ``copy_bps``, which counts each byte copied once); ``None`` where a piece crosses
    GPUs."""
    quantised = {i for i, t in enumerate(plan.tensors) if t.name in {q[0] for q in plan.quantized}}
    traffic: dict[int, float] = {}
    for b in plan.buckets:
        if gpu_of[b.src] != gpu_of[b.dst]:
            return None
        for t in b.transfers:
            traffic[gpu_of[b.dst]] = traffic.get(gpu_of[b.dst], 0) + t.nbytes * (1.5 if t.tensor in quantised else 2)
    return max(traffic.values(), default=0.0) / (2 * copy_bps)


# ----------------------------------------------------------------------------------------------- worker


@dataclass
class WorkerArgs:
    scenario: str
    model: str
    layers: int | None
    rank: int  # sync-world rank (plan order)
    world: int
    instance: str
    local_rank: int
    gpu: int
    ports: list[int]
    workdir: str
    iters: int
    baseline_iters: int
    wave_mb: float
    fp8: bool = False
    trainer_buffer: str = "per-param"
    extra: dict = field(default_factory=dict)


def worker(a: WorkerArgs) -> dict:
    import torch
    import torch.distributed as dist

    from awex.convert import Fp8Views
    from awex.meta import Fp8BlockQuant, Role, quantize_layout
    from awex.transport import LocalShards

    torch.cuda.set_device(a.gpu)
    device = torch.device("cuda", a.gpu)
    scenario = next(s for s in SCENARIOS if s.name == a.scenario)
    dims, tensors = model_tensors(a.model, a.layers)
    base_layouts = layouts_of(scenario, tensors)
    quant = Fp8BlockQuant() if a.fp8 else None
    on_receive = bool(a.extra.get("fp8_on_receive"))  # receivers quantise from the trainer's bf16 (CUDA IPC)
    layouts = (
        [quantize_layout(lay, quant) if lay.role == Role.INFERENCE or not on_receive else lay for lay in base_layouts]
        if quant
        else base_layouts
    )
    sources = [lay for lay in layouts if lay.role == Role.TRAINER]
    dests = [lay for lay in layouts if lay.role == Role.INFERENCE]
    engine = next(e for e in scenario.engines if e.instance == a.instance)
    layout = next(lay for lay in layouts if lay.instance == a.instance)
    trainer = engine.kind == "megatron"

    # control group (gloo): barriers and timing only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.ports[0]}", rank=a.rank, world_size=a.world)

    def barrier():
        dist.barrier()

    def span(t0: float, t1: float) -> float:
        x = torch.tensor([t0, t1], dtype=torch.float64)
        out = [torch.zeros(2, dtype=torch.float64) for _ in range(a.world)]
        dist.all_gather(out, x)
        return max(float(o[1]) for o in out) - min(float(o[0]) for o in out)

    own: list[float] = []  # this rank's seconds in each timed call (diagnosis: start skew between ranks)
    late: list[float] = []  # how late this rank reached the common start, where it did

    def start_together() -> float:
        """A barrier, then every rank waits for one instant rank 0 picked a few milliseconds ahead: the ranks of a
        benchmark share one host's monotonic clock (which ``span`` relies on too), so every timed call starts on
        all ranks within microseconds instead of the barrier's release skew (0.1-0.5 ms over gloo)."""
        barrier()
        torch.cuda.synchronize()
        instant = torch.tensor([time.perf_counter() + 0.005], dtype=torch.float64)
        dist.broadcast(instant, 0)
        start = float(instant)
        now = time.perf_counter()
        if now > start:
            late.append(now - start)
        while now < start:
            now = time.perf_counter()
        return now

    def timed(fn) -> float:
        """Seconds from the common start of ``fn`` on every rank to the last rank finishing it."""
        t0 = start_together()
        fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        own.append(t1 - t0)
        return span(t0, t1)

    params, view_of = native_params(
        engine, a.local_rank, dims, device, None if trainer else quant, flat=a.trainer_buffer == "flat"
    )
    base_layout = next(lay for lay in base_layouts if lay.instance == a.instance)
    quantize = None
    if trainer:
        weights = LocalShards.from_layout(base_layout, a.local_rank, view_of)  # the bf16 weights themselves
        fill(weights, base_layout, 1, device)
        if quant and not on_receive:  # FP8 receivers: this rank quantises into FP8 tiles before each sync (timed)
            fp8_views = Fp8Views(layout, a.local_rank, view_of, quant)
            view_of, quantize = fp8_views.view_of, fp8_views.quantize
            quantize()
    shards = LocalShards.from_layout(layout, a.local_rank, view_of)
    torch.cuda.synchronize()
    result: dict = {"rank": a.rank, "instance": a.instance, "gpu": a.gpu, "trainer": trainer}
    result["_base_alloc"] = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)

    # ---- Awex: first sync (everything built) and steady state
    if a.extra.get("path", "public") == "public":
        plan, shards = _public_path(
            a,
            scenario,
            layout,
            trainer,
            view_of,
            weights if trainer else None,
            base_layout,
            quantize,
            fp8_views if trainer and quant and not on_receive else None,
            result,
            barrier,
            span,
            timed,
            device,
            quant,
        )
    else:
        plan = _executor_path(
            a,
            scenario,
            sources,
            dests,
            layout,
            shards,
            trainer,
            quantize,
            fp8_views if trainer and quant else None,
            weights if trainer else None,
            base_layout,
            result,
            barrier,
            span,
            timed,
            device,
            quant,
        )
    result["plan"] = {
        "waves": plan.stats.waves,
        "relayed_bytes": plan.stats.relayed_bytes,
        "total_bytes": plan.stats.total_bytes,
    }

    # ---- baselines
    result["own_seconds"] = own[:]
    result["late_starts"] = late[:]
    result["baselines"] = (
        baselines(a, scenario, plan, layouts, shards, layout, trainer, device, barrier, timed, quant)
        if a.baseline_iters
        else {}
    )
    dist.barrier()
    return result


def _executor_path(
    a,
    scenario,
    sources,
    dests,
    layout,
    shards,
    trainer,
    quantize,
    fp8_views,
    weights,
    base_layout,
    result,
    barrier,
    span,
    timed,
    device,
    quant,
):
    """Executors wired by hand (``--path executor``): the plan and executors built here, no MetaServer."""
    import torch

    from awex.meta import PlanOptions, plan_transfers
    from awex.transport import WaveExecutor, create_sync_group
    from awex.transport.ipc import IpcExecutor, IpcExport, IpcOptions, export_shards, open_export

    quantize_in_sync = quantize  # FP8 over IPC: all at once before the copies; over NCCL: per wave (below)
    barrier()
    t0 = time.perf_counter()
    if scenario.transport == "nccl":
        direct = a.extra.get("direct_bytes", PlanOptions.direct_bytes)
        options = PlanOptions(
            wave_bytes=int(a.wave_mb * (1 << 20)), direct_bytes=direct, broadcast=a.extra.get("fanout") == "broadcast"
        )
        plan = plan_transfers(sources, dests, options)
        group = create_sync_group(a.rank, a.world, "127.0.0.1", a.ports[1], backend="nccl", device=device)
        executor = WaveExecutor(plan, a.rank, shards, group)
        run = executor.run
        result["staging_bytes"] = executor.staging_bytes
        if quantize is not None:  # FP8: each wave quantises what it sends just before packing (overlapped)
            quantize_wave = fp8_views.by_wave(executor.sent_regions)
            run = lambda: executor.run(before_pack=quantize_wave)  # noqa: E731
            quantize_in_sync = None
    else:
        plan = plan_transfers(sources, dests, PlanOptions(relay=False, devices=scenario_devices(scenario)))
        exports = Path(a.workdir) / f"ipc-{a.scenario}"
        exports.mkdir(exist_ok=True)
        if trainer:
            torch.cuda.synchronize()
            (exports / f"{a.rank}.json").write_text(json.dumps(export_shards(shards).to_wire()))
        barrier()  # exports written
        if not trainer:
            peers = sorted({s.peer for s in plan.schedule(a.rank)})
            opened = {
                p: open_export(IpcExport.from_wire(json.loads((exports / f"{p}.json").read_text()))) for p in peers
            }
            executor = IpcExecutor(plan, a.rank, shards, opened, IpcOptions.from_dict(a.extra.get("ipc", {})))
            run = executor.run
            result["staging_bytes"] = executor.staging_bytes
        else:
            run = None
    stats = run() if run else None
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    result["first_sync_seconds"] = span(t0, t1)

    last: list = [stats]

    def sync_once():
        if quantize_in_sync:
            quantize_in_sync()
        if a.fp8 and scenario.transport == "ipc":  # receivers read the new tiles only once they are written
            torch.cuda.synchronize()
            barrier()
        if run:
            last[0] = run()

    result["steady_seconds"] = [timed(sync_once) for _ in range(a.iters)]
    stats = last[0]
    result["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - result.pop("_base_alloc")
    if stats is not None:
        result["bytes_received"] = stats.bytes_received
        result["bytes_sent"] = stats.bytes_sent
        result["waves"] = stats.waves
    # the trainer did not change its weights during the steady syncs: the first version must be there
    if "bad_first" not in result:
        result["bad_first"] = [] if trainer else mismatches(shards, layout, 1, device, quant)
    if quantize:
        result["quantize_seconds"] = statistics.median(_cuda_seconds(quantize) for _ in range(3))

    # second version: changed values must arrive too (in place)
    if trainer:
        fill(weights, base_layout, 2, device)
        if quantize_in_sync:
            quantize_in_sync()
    torch.cuda.synchronize()
    barrier()
    if run:
        run()
    torch.cuda.synchronize()
    barrier()
    result["bad_second"] = [] if trainer else mismatches(shards, layout, 2, device, quant)
    return plan


def _public_path(
    a,
    scenario,
    layout,
    trainer,
    view_of,
    weights,
    base_layout,
    quantize,
    fp8_views,
    result,
    barrier,
    span,
    timed,
    device,
    quant,
):
    """What users run (``--path public``, the default): a ``WeightsWriter`` per trainer rank and a
    ``WeightsReader`` per receiver rank, meeting at a MetaServer (planning, agreement, versions, IPC handles,
    everything per version included). Returns the plan and this rank's views (for the baselines)."""
    import torch

    from awex.engines.reader import WeightsReader
    from awex.engines.writer import WeightsWriter
    from awex.meta.client import MetaClient

    client = MetaClient(
        a.extra["meta"],
        job=f"{a.scenario}-{a.trainer_buffer}-{a.model}-{a.layers}",
        timeout=a.extra.get("timeout", 300),
    )
    transport = {"nccl": "p2p", "ipc": "ipc", "shm": "shm"}[scenario.transport]
    dests = [e.instance for e in scenario.engines if e.kind != "megatron"]
    if trainer:
        side = WeightsWriter(
            client,
            layout,
            a.local_rank,
            view_of,
            transport=transport,
            wave_bytes=int(a.wave_mb * (1 << 20)),
            refresh=quantize,
            refresh_by_wave=fp8_views.by_wave if fp8_views is not None else None,
            quantize_on_receive=bool(a.extra.get("fp8_on_receive")),
            delta=bool(a.extra.get("delta")),
        )
        step = lambda version: side.write(version, dests)  # noqa: E731
    else:
        side = WeightsReader(client, layout, a.local_rank, view_of)
        step = side.receive
    barrier()  # every rank's layout is published
    t0 = time.perf_counter()
    stats = step("v1")
    torch.cuda.synchronize()
    result["first_sync_seconds"] = span(t0, time.perf_counter())
    result["first_sync_phases"] = side.last_phases
    last = [stats]
    versions = iter(range(2, 10**6))

    def sync_once():
        last[0] = step(f"v{next(versions)}")

    fraction = a.extra.get("delta")
    changed = partial(sparse_value, fraction=fraction) if fraction else None  # an RL-like step before each sync
    peak = 0
    if changed and not trainer:  # checked now: the steady syncs change the weights (the check's memory not counted)
        peak = torch.cuda.max_memory_allocated(device)
        result["bad_first"] = mismatches(side.shards, layout, 1, device)
        torch.cuda.reset_peak_memory_stats(device)
    result["steady_seconds"] = []
    for i in range(a.iters):
        side.flush()  # the requests a sync leaves for afterwards get the time a training step gives them (not timed)
        if changed and trainer:
            fill(weights, base_layout, i + 2, device, changed)  # not timed
        torch.cuda.synchronize()
        result["steady_seconds"].append(timed(sync_once))
    result["steady_phases"] = side.last_phases
    stats = last[0]
    result["bytes_dense"] = stats.bytes_dense
    result["peak_extra_bytes"] = max(peak, torch.cuda.max_memory_allocated(device)) - result.pop("_base_alloc")
    if changed and not trainer:  # every changed word arrived
        result["bad_steady"] = mismatches(side.shards, layout, a.iters + 1, device, value=changed)
    result["bytes_received"], result["bytes_sent"], result["waves"] = (
        stats.bytes_received,
        stats.bytes_sent,
        stats.waves,
    )
    result["staging_bytes"] = side.held_bytes()
    shards = side.shards
    if "bad_first" not in result:
        result["bad_first"] = [] if trainer else mismatches(shards, layout, 1, device, quant)
    if quantize:
        result["quantize_seconds"] = statistics.median(_cuda_seconds(quantize) for _ in range(3))
    if trainer:  # second version: changed values must arrive too (in place)
        fill(weights, base_layout, 2, device)
    torch.cuda.synchronize()
    barrier()
    step("v-second")
    torch.cuda.synchronize()
    barrier()
    result["bad_second"] = [] if trainer else mismatches(shards, layout, 2, device, quant)
    plan = side._session._plan
    if not trainer:
        side.close()  # release the trainers' memory opened over CUDA IPC before they may exit
    barrier()
    return plan, shards


def _cuda_seconds(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def baselines(a, scenario, plan, layouts, shards, layout, trainer, device, barrier, timed, quant=None) -> dict:
    """The usual approaches on the same layouts; with FP8 they move the trainer's already quantised tiles (the
    quantisation itself is not timed here, unlike in Awex's syncs)."""
    import torch
    import torch.distributed as dist

    from awex.transport.ipc import IpcExecutor, IpcExport, export_shards, open_export
    from awex.transport.shards import torch_dtype

    out: dict = {}
    names = sorted({t.name for t in plan.tensors})
    specs = {t.name: t for t in plan.tensors}
    ranks = plan.ranks
    trainer_ranks = [r.rank for r in ranks if r.role.value == "trainer"]
    receiver_ranks = [r.rank for r in ranks if r.role.value == "inference"]
    if scenario.transport == "ipc":
        # per-update IPC: the trainer exports handles for every update, receivers open them and copy
        exports = Path(a.workdir) / f"ipc-base-{a.scenario}"
        exports.mkdir(exist_ok=True)

        def per_update(i: int) -> None:
            if trainer:
                (exports / f"{a.rank}-{i}.json").write_text(json.dumps(export_shards(shards).to_wire()))
            barrier()
            if not trainer:
                peers = sorted({s.peer for s in plan.schedule(a.rank)})
                opened = {
                    p: open_export(IpcExport.from_wire(json.loads((exports / f"{p}-{i}.json").read_text())))
                    for p in peers
                }
                IpcExecutor(plan, a.rank, shards, opened).run()

        out["ipc_handles_per_update"] = [timed(lambda i=i: per_update(i)) for i in range(a.baseline_iters)]
        trainer_gpus = {g for e in scenario.engines if e.kind == "megatron" for g in e.gpus}
        if any(g in trainer_gpus for e in scenario.engines if e.kind == "vllm" for g in e.gpus):
            return out  # colocated: the NCCL baselines below need GPUs of their own

    tgroup = dist.new_group(trainer_ranks, backend="nccl") if len(trainer_ranks) > 1 else None
    root = trainer_ranks[0]
    bgroup = dist.new_group([root] + receiver_ranks, backend="nccl")
    in_b = a.rank == root or a.rank in receiver_ranks

    def gather_full(name: str):
        """Trainer rank 0 assembles the canonical tensor from every trainer rank's boxes (P2P)."""
        spec = specs[name]
        full = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device) if a.rank == root else None
        if a.rank == root:
            for box, view in shards.pairs(name):
                full[box.slices()].copy_(view)
        for src in trainer_ranks[1:]:
            lay = next(x for x in layouts if x.instance == ranks[src].instance)
            for box in lay.rank_boxes(ranks[src].local_rank).get(name, ()):
                if a.rank == src:
                    buf = torch.empty(box.sizes, dtype=torch_dtype(spec.dtype), device=device)
                    shards.copy_out(name, box.offsets, box.sizes, buf)
                    dist.send(bits(buf), root, group=tgroup)
                elif a.rank == root:
                    buf = torch.empty(box.sizes, dtype=torch_dtype(spec.dtype), device=device)
                    dist.recv(bits(buf), src, group=tgroup)
                    full[box.slices()].copy_(buf)
        return full

    def take(name: str, full):
        for box, view in shards.pairs(name):
            view.copy_(full[box.slices()])

    def per_tensor():
        for name in names:
            full = gather_full(name) if trainer else None
            if in_b:
                if full is None:
                    full = torch.empty(specs[name].shape, dtype=torch_dtype(specs[name].dtype), device=device)
                dist.broadcast(bits(full), root, group=bgroup)
                if not trainer:
                    take(name, full)

    def packed(bucket_bytes: int = GIB):
        batch: list[str] = []
        size = 0
        groups: list[list[str]] = []
        for name in names:
            n = specs[name].nbytes
            if batch and size + n > bucket_bytes:
                groups.append(batch)
                batch, size = [], 0
            batch.append(name)
            size += n
        if batch:
            groups.append(batch)
        for g in groups:
            total = sum(specs[n].nbytes for n in g)
            fulls = {n: gather_full(n) for n in g} if trainer else {}
            if not in_b:
                continue
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            pos = 0
            views = {}
            for n in g:
                v = buf[pos : pos + specs[n].nbytes].view(torch_dtype(specs[n].dtype)).view(specs[n].shape)
                views[n] = v
                if a.rank == root:
                    v.copy_(fulls[n])
                pos += specs[n].nbytes
            dist.broadcast(buf, root, group=bgroup)
            if not trainer:
                for n in g:
                    take(n, views[n])

    for label, fn in (("gather_then_per_tensor_broadcast", per_tensor), ("gather_then_packed_1GiB_broadcast", packed)):
        out[label] = [timed(fn) for _ in range(a.baseline_iters)]
        if not trainer:
            out[label + "_bad"] = mismatches(shards, layout, 2, device, quant)[:5]
    return out


# ----------------------------------------------------------------------------------------------- calibration


def calibrate_worker(rank: int, world: int, port: int, nbytes: int, out_file: str) -> None:
    """Ranks 0..world-1 on GPUs 0..world-1: pair send 0->1, two into one (0,1 -> 2), device copy on GPU 0."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res = {}

    def timed(fn, reps=5):
        ts = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ts.append(float(t))
        return statistics.median(ts[1:])

    def pair():
        if world < 2:
            return
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    res["pair_seconds"] = timed(pair)
    res["pair_bps"] = nbytes / res["pair_seconds"] if world >= 2 else 0.0
    if world >= 2:  # the same link driven by the copy engines (what colocated CUDA IPC syncs use)
        peer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", 1)) if rank == 0 else None

        def dma():
            if peer is not None:
                peer.copy_(buf, non_blocking=True)
                torch.cuda.synchronize(peer.device)

        res["dma_seconds"] = timed(dma)
        res["dma_bps"] = nbytes / res["dma_seconds"]
        del peer
    if world >= 3:
        half = buf[: nbytes // 2]
        other = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")

        def two_into_one():
            ops = []
            if rank in (0, 1):
                ops.append(dist.P2POp(dist.isend, half, 2))
            elif rank == 2:
                ops += [dist.P2POp(dist.irecv, half, 0), dist.P2POp(dist.irecv, other, 1)]
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

        res["two_into_one_seconds"] = timed(two_into_one)
        res["two_into_one_bps"] = nbytes / res["two_into_one_seconds"]
    # the host side of the shm transport: page-locked host memory <-> GPU on the copy engines
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if rank < 2 else None

    def d2h():
        if rank == 0:
            pinned.copy_(buf, non_blocking=True)
            torch.cuda.synchronize()

    def h2d():
        if rank == 0:
            buf.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

    def d2h_while_h2d():  # GPU 0 to host while host to GPU 1: a sender filling while a receiver empties
        if rank == 0:
            pinned.copy_(buf, non_blocking=True)
        elif rank == 1:
            buf.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    res["d2h_seconds"] = timed(d2h)
    res["d2h_bps"] = nbytes / res["d2h_seconds"]
    res["h2d_seconds"] = timed(h2d)
    res["h2d_bps"] = nbytes / res["h2d_seconds"]
    if world >= 2:
        res["d2h_while_h2d_seconds"] = timed(d2h_while_h2d)
        res["d2h_while_h2d_bps"] = nbytes / res["d2h_while_h2d_seconds"]  # each direction's rate meanwhile
    dst = torch.empty_like(buf)
    res["copy_seconds"] = timed(lambda: dst.copy_(buf))
    res["copy_bps"] = nbytes / res["copy_seconds"]  # bytes copied per second (each read once, written once)
    if rank == 0:
        Path(out_file).write_text(json.dumps(res))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver


def _device_name() -> str:
    import torch

    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    if n == 1:
        return f"1x {name}"
    try:
        links = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        link = "NV18" if "NV18" in links else ("NVLink" if " NV" in links else "PCIe")
    except (OSError, subprocess.SubprocessError):
        link = "unknown link"
    return f"{n}x {name}, {link}"


def _write_results(out: str | None, device: str, date: str, cal: dict, results: list, command: list[str]) -> None:
    if not out:
        return
    doc = {
        "device": device,
        "date": date,
        "limits": cal,
        "scenarios": results,
        "command": "python -m awex_integration.bench_gpu " + " ".join(command),
    }
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def _phases(per_rank: list[dict], key: str) -> dict[str, dict[str, float]]:
    """Seconds of each phase of a sync on the trainers and on the receivers (the slowest rank's of each)."""
    out: dict[str, dict[str, float]] = {"trainer": {}, "inference": {}}
    for p in per_rank:
        side = out["trainer" if p["trainer"] else "inference"]
        for name, seconds in (p.get(key) or {}).items():
            side[name] = round(max(side.get(name, 0.0), seconds), 6)
    return out


def run_scenario_workers(
    sc, ranks, gpu_of, args, model, layers, iters, baseline_iters, buffer, work, env, shared
) -> tuple[list[dict], str | None]:
    """One scenario's workers (one process per rank) on ``model``; their results in rank order, or a failure."""
    from awex.transport.net import free_ports

    ports = free_ports(2)
    argv = []
    for r in ranks:
        wa = WorkerArgs(
            sc.name,
            model,
            layers,
            r.rank,
            len(ranks),
            r.instance,
            r.local_rank,
            gpu_of[r.rank],
            ports,
            work,
            iters,
            baseline_iters,
            args.wave_mb,
            args.fp8,
            buffer,
            dict(shared),
        )
        argv.append(["--worker", json.dumps(wa.__dict__)])
    outs = launch_workers(argv, args.timeout, env)
    failed = [o[-4000:] for rc, o in outs if rc != 0]
    if failed:
        return [], "\n".join(failed)
    return [json.loads(Path(work, f"{sc.name}-{r.rank}.json").read_text()) for r in ranks], None


def main(argv: list[str] | None = None) -> int:
    from awex.transport.net import free_ports  # here: upstream Awex's workers import this module before their awex

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (quick runs)")
    ap.add_argument("--scenarios", default="all", help="comma-separated names (default all that fit the GPUs)")
    ap.add_argument("--iters", type=int, default=7, help="steady-state syncs timed per scenario (median)")
    ap.add_argument("--baseline-iters", type=int, default=3, help="0: no baselines (quick runs)")
    ap.add_argument("--wave-mb", type=float, default=256.0, help="wave size per rank in MiB (staging ~2x)")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="receivers hold FP8 block-quantised weights (e4m3, 128x128 tiles + scales); trainers "
        "quantise their bf16 weights in every sync (timed as part of it)",
    )
    ap.add_argument(
        "--fp8-on-receive",
        action="store_true",
        help="with --fp8, CUDA IPC scenarios, public path: the trainer publishes bf16 and receivers quantise from "
        "its memory into their FP8 weights and scales (quantize_on_receive); bound: bf16 read + FP8 written",
    )
    ap.add_argument(
        "--trainer-buffer",
        default="per-param",
        help="per-param: trainer parameters each in their own allocation (as under FSDP2; default); "
        "flat: views of one contiguous buffer (as Megatron-core's DDP keeps them); "
        "'per-param,flat' runs every scenario both ways",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="per scenario")
    ap.add_argument(
        "--upstream",
        action="store_true",
        help="also run checkpoint-engine 0.4.2 where it runs (colocated on one GPU; needs it installed)",
    )
    ap.add_argument(
        "--direct-mb",
        default="64",
        help="NCCL: transfers of at least this many MiB travel as their own message, straight from and "
        "into engine memory where contiguous (PlanOptions.direct_bytes); 'none': all staged",
    )
    ap.add_argument(
        "--fanout",
        default="relay",
        choices=["relay", "broadcast"],
        help="NCCL: regions several instances need go by relays (default) or as broadcasts per wave "
        "(PlanOptions.broadcast)",
    )
    ap.add_argument(
        "--ipc-options",
        default="{}",
        help="JSON keyword arguments for the CUDA IPC executor, e.g. '{\"dma_streams\": 4}' (tuning runs)",
    )
    ap.add_argument(
        "--upstream-awex",
        default=None,
        metavar="DIR",
        help="with --upstream: a directory holding the unpacked awex 0.9.0 wheel; its transfer core "
        "runs as a baseline in the NCCL scenarios (awex_integration.bench_upstream_awex)",
    )
    ap.add_argument(
        "--path",
        default="public",
        choices=["public", "executor"],
        help="public (default): WeightsWriter / WeightsReader meeting at a MetaServer, as users run "
        "them; executor: the transport executors wired by hand (tuning runs)",
    )
    ap.add_argument(
        "--per-sync-model",
        default="qwen2-tiny",
        help="public path: each scenario also runs with this model (a few MB; integration/models/NAME.json) and its "
        "steady time, what a sync costs whatever its size, joins the cost model's prediction; 'none': left out",
    )
    ap.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="FRACTION",
        help="public path: delta syncs (WeightsWriter(delta=True)); before each timed sync the trainer changes about "
        "this fraction of its elements (not timed), and receivers check the last version bit for bit",
    )
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    command = list(sys.argv[1:] if argv is None else argv)
    direct_bytes = None if args.direct_mb == "none" else int(float(args.direct_mb) * (1 << 20))
    ipc_options = json.loads(args.ipc_options)
    if not isinstance(ipc_options, dict):
        ap.error("--ipc-options: a JSON object")
    from awex.transport.ipc.options import IpcOptions

    try:
        IpcOptions.from_dict(ipc_options)  # refused here, before any worker starts
    except (TypeError, ValueError) as e:
        ap.error(f"--ipc-options: {e}")

    if args.worker:
        a = WorkerArgs(**json.loads(args.worker))
        res = worker(a)
        Path(a.workdir, f"{a.scenario}-{a.rank}.json").write_text(json.dumps(res))
        return 0
    if args.calibrate:
        calibrate_worker(**json.loads(args.calibrate))
        return 0

    import torch

    from awex.meta import Fp8BlockQuant, PlanOptions, Role, plan_transfers, quantize_layout

    env = dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
    )
    gpus = torch.cuda.device_count()
    device = _device_name()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    work = tempfile.mkdtemp(prefix="awex-bench-")
    model_label = (
        args.model + (f" ({args.layers} layers)" if args.layers else "") + (", FP8 to receivers" if args.fp8 else "")
    )
    print(f"device: {device}; model {model_label}", flush=True)

    # limits, measured now
    cal_world = min(gpus, 3)
    port = free_ports(1)[0]
    cal_file = str(Path(work) / "calibration.json")
    outs = launch_workers(
        [
            [
                "--calibrate",
                json.dumps({"rank": r, "world": cal_world, "port": port, "nbytes": 4 * GIB, "out_file": cal_file}),
            ]
            for r in range(cal_world)
        ],
        300,
        env,
    )
    if any(rc for rc, _ in outs):
        print("\n".join(o for _, o in outs))
        return 1
    cal = json.loads(Path(cal_file).read_text())
    link_bps = max(cal["pair_bps"], cal.get("two_into_one_bps", 0.0), cal.get("dma_bps", 0.0))
    copy_bps = cal["copy_bps"]
    print(
        f"limits: NCCL one pair {cal['pair_bps'] / 1e9:.0f} GB/s, two into one "
        f"{cal.get('two_into_one_bps', 0) / 1e9:.0f} GB/s, copy-engine peer copy {cal.get('dma_bps', 0) / 1e9:.0f} "
        f"GB/s, device copy {copy_bps / 1e9:.0f} GB/s (bytes copied per second), pinned host memory: D2H "
        f"{cal['d2h_bps'] / 1e9:.0f} GB/s, H2D {cal['h2d_bps'] / 1e9:.0f} GB/s, each while the other runs "
        f"{cal.get('d2h_while_h2d_bps', 0) / 1e9:.0f} GB/s; link = the fastest of the first three",
        flush=True,
    )

    meta = None
    if args.path == "public":
        from awex.meta.server import start_embedded

        meta = start_embedded()  # in this process; the workers reach it over loopback HTTP
    wanted = [s for s in SCENARIOS if (args.scenarios == "all" or s.name in args.scenarios.split(","))]
    results = []
    dims, tensors = model_tensors(args.model, args.layers)
    quant = Fp8BlockQuant() if args.fp8 else None
    model_bytes = sum(t.spec.nbytes for t in tensors)
    if args.fp8_on_receive and (not args.fp8 or args.path != "public"):
        ap.error("--fp8-on-receive needs --fp8 and the public path")
    if args.fp8_on_receive and args.baseline_iters:
        print("--fp8-on-receive: no baselines (they move the trainer's FP8 tiles, which it does not make here)")
        args.baseline_iters = 0
    if args.delta is not None and (args.path != "public" or args.fp8 or not 0 < args.delta < 1):
        ap.error("--delta: a fraction between 0 and 1, on the public path, without --fp8")
    shared = {
        "delta": args.delta,
        "fp8_on_receive": args.fp8_on_receive,
        "ipc": ipc_options,
        "direct_bytes": direct_bytes,
        "fanout": args.fanout,
        "path": args.path,
        "meta": meta.address if meta else None,
        "timeout": args.timeout,
    }
    buffers = args.trainer_buffer.split(",")
    if not set(buffers) <= {"per-param", "flat"}:
        ap.error(f"--trainer-buffer: per-param and/or flat, got {args.trainer_buffer!r}")
    for buffer, sc in ((b, sc) for b in buffers for sc in wanted):
        if sc.gpus > gpus:
            print(f"skip {sc.name}: needs {sc.gpus} GPUs, this machine has {gpus}")
            continue
        layouts = layouts_of(sc, tensors)
        if args.fp8_on_receive and sc.transport != "ipc":
            print(f"skip {sc.name}: FP8 on receive runs over CUDA IPC only")
            continue
        if quant:
            layouts = [
                quantize_layout(x, quant) if x.role == Role.INFERENCE or not args.fp8_on_receive else x for x in layouts
            ]
        sources = [x for x in layouts if x.role == Role.TRAINER]
        dests = [x for x in layouts if x.role == Role.INFERENCE]
        direct = plan_transfers(
            sources,
            dests,
            PlanOptions(
                relay=False,
                devices=scenario_devices(sc) if sc.transport == "ipc" else (),
                quantize_on_receive=args.fp8_on_receive,
            ),
        )
        ranks = direct.ranks
        gpu_of = {r.rank: next(e for e in sc.engines if e.instance == r.instance).gpus[r.local_rank] for r in ranks}
        bound, per_gpu = lower_bound(direct, gpu_of, link_bps, copy_bps)
        fused = None
        if quant and sc.transport == "ipc":  # FP8 on the copy's bound: bf16 read once, FP8 written once
            bf16 = [x for x in layouts_of(sc, tensors) if x.role == Role.TRAINER]
            fused = fused_bound(
                plan_transfers(
                    bf16, dests, PlanOptions(relay=False, devices=scenario_devices(sc), quantize_on_receive=True)
                ),
                gpu_of,
                copy_bps,
            )
            if args.fp8_on_receive:
                bound = fused
        if sc.transport == "shm":  # every byte crosses to host memory and back: D2H by senders, H2D by receivers
            if args.path != "public":
                print(f"skip {sc.name}: the shm transport runs through the public path only")
                continue
            sent = max(sum(b.nbytes for b in direct.buckets if b.src == r.rank) for r in sources_ranks(direct))
            received = max(sum(b.nbytes for b in direct.buckets if b.dst == r.rank) for r in dest_ranks(direct))
            # receivers copy out while the senders fill (chunk by chunk): both directions at once, at the rate each
            # keeps while the other runs (measured: one GPU to host while host to the other GPU)
            both = cal.get("d2h_while_h2d_bps") or min(cal["d2h_bps"], cal["h2d_bps"])
            bound = max(sent, received) / both
            per_gpu = {
                "d2h_bytes": sent,
                "h2d_bytes": received,
                "one_after_the_other_seconds": sent / cal["d2h_bps"] + received / cal["h2d_bps"],
            }
        started = time.monotonic()
        per_rank, failure = run_scenario_workers(
            sc, ranks, gpu_of, args, args.model, args.layers, args.iters, args.baseline_iters, buffer, work, env, shared
        )
        if failure is not None:
            print(f"FAILED {sc.name}:\n{failure}", flush=True)
            results.append({"name": sc.name, "what": sc.what, "device": device, "date": date, "error": failure[-2000:]})
            continue
        rec = [p for p in per_rank if not p["trainer"]]
        bad = [f"{p['instance']}:{b}" for p in rec for b in p["bad_first"] + p.get("bad_steady", []) + p["bad_second"]]
        steady = statistics.median(per_rank[0]["steady_seconds"])
        received = sum(p.get("bytes_received", 0) for p in rec)
        entry = {
            "name": sc.name,
            "what": sc.what,
            "device": device,
            "date": date,
            "model": model_label,
            "trainer_buffer": buffer,
            "model_bytes": model_bytes,
            "wire_bytes": direct.stats.total_bytes,
            "quantize_seconds": max((p.get("quantize_seconds", 0.0) for p in per_rank), default=0.0) or None,
            "transport": sc.transport,
            "path": (
                "public: WeightsWriter / WeightsReader with a MetaServer (plan, agreement, versions)"
                if args.path == "public"
                else "executor: transport executors wired by hand"
            ),
            **(
                {
                    "first_sync_phases": _phases(per_rank, "first_sync_phases"),
                    "steady_phases": _phases(per_rank, "steady_phases"),
                }
                if args.path == "public"
                else {}
            ),
            **({"ipc_options": ipc_options} if ipc_options and sc.transport == "ipc" else {}),
            **({"direct_bytes": direct_bytes, "fanout": args.fanout} if sc.transport == "nccl" else {}),
            # the default's choice for these GPUs (quantising on receive is chosen explicitly, over CUDA IPC)
            "auto_transport": "ipc" if args.fp8_on_receive else auto_transport(sc, sources, dests, fp8=args.fp8),
            "bytes": received,
            **(
                {"delta_fraction": args.delta, "bytes_dense": sum(p.get("bytes_dense", 0) for p in rec)}
                if args.delta
                else {}
            ),
            "seconds": round(steady, 6),
            "seconds_all": [round(x, 6) for x in per_rank[0]["steady_seconds"]],
            # timed calls start on every rank at one instant; where a rank reached it late, by how much (seconds)
            "late_starts": {
                f"{p['instance']}:{p['rank']}": [round(x, 6) for x in p["late_starts"]]
                for p in per_rank
                if p.get("late_starts")
            },
            # each rank's own time in the call (median)
            "rank_seconds": {
                f"{p['instance']}:{p['rank']}": round(statistics.median(p["own_seconds"]), 6)
                for p in per_rank
                if p.get("own_seconds")
            },
            "first_sync_seconds": round(per_rank[0]["first_sync_seconds"], 6),
            "lower_bound_seconds": round(bound, 6),
            **({"fused_bound_seconds": round(fused, 6), "fp8_on_receive": args.fp8_on_receive} if fused else {}),
            "ratio": round(steady / bound, 3) if bound else None,
            "limits": {"link_bytes_per_s": round(link_bps), "copy_bytes_per_s": round(copy_bps)},
            "per_gpu_bytes": per_gpu,
            "waves": per_rank[0]["plan"]["waves"],
            "relayed_bytes": per_rank[0]["plan"]["relayed_bytes"],
            "peak_extra_gpu_bytes": {
                "trainer": max(p["peak_extra_bytes"] for p in per_rank if p["trainer"]),
                "inference": max(p["peak_extra_bytes"] for p in rec),
            },
            "staging_bytes": max((p.get("staging_bytes", 0) for p in per_rank), default=0),
            "correct": not bad,
            "mismatches": bad[:10],
            "baselines": {
                k: round(statistics.median(v), 6) for k, v in per_rank[0]["baselines"].items() if not k.endswith("_bad")
            },
            "baseline_mismatches": sorted(
                {b for p in rec for k, v in p["baselines"].items() if k.endswith("_bad") for b in v}
            )[:5],
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        # the topology cost model's prediction from this run's measured rates (awex_integration.estimate_check),
        # plus, on the public path, what a sync costs whatever its size: the same scenario with a model of a few MB
        per_sync = None
        if args.path == "public" and args.per_sync_model != "none" and not args.fp8:
            tiny_rank, failure = run_scenario_workers(
                sc, ranks, gpu_of, args, args.per_sync_model, None, args.iters, 0, buffer, work, env, shared
            )
            if failure is None:
                per_sync = statistics.median(tiny_rank[0]["steady_seconds"])
            else:
                print(f"per-sync measurement of {sc.name} failed (left out of the prediction):\n{failure}", flush=True)
        entry["per_sync_seconds"] = None if per_sync is None else round(per_sync, 6)
        entry["per_sync_model"] = args.per_sync_model if per_sync is not None else None
        if not args.fp8_on_receive:  # the cost model prices copies, not quantising kernels
            predicted = predict({"limits": cal}, entry, layouts=layouts, per_sync_seconds=per_sync or 0.0)
            entry["predicted_seconds"] = predicted["predicted_seconds"]
            entry["measured_over_predicted"] = predicted["measured_over_predicted"]
        if args.upstream and args.upstream_awex and sc.transport == "nccl" and buffer == buffers[0] and not args.fp8:
            from awex_integration.bench_upstream_awex import run as run_upstream_awex
            from awex_integration.bench_upstream_awex import scenario_spec

            spec = scenario_spec(sc, tensors, layouts, max(1, args.baseline_iters), work, free_ports(1)[0])
            upstream = run_upstream_awex(args.upstream_awex, spec, args.timeout)
            entry["upstream_awex"] = upstream
            if upstream.get("correct"):
                entry["baselines"]["awex_0.9.0_transfer_core"] = upstream["update_seconds"]
            print(f"awex 0.9.0: {json.dumps(upstream)[:600]}", flush=True)
        if args.upstream and sc.name == "colocated_1gpu_ipc" and buffer == buffers[0] and not args.fp8:
            from awex_integration.bench_checkpoint_engine import run as run_checkpoint_engine

            upstream = run_checkpoint_engine(args.model, args.layers, max(1, args.baseline_iters))
            entry["upstream"] = upstream
            if upstream.get("correct"):
                entry["baselines"]["checkpoint_engine_0.4.2_update"] = upstream["update_seconds"]
            print(f"checkpoint-engine 0.4.2: {json.dumps(upstream)[:600]}", flush=True)
        results.append(entry)
        _write_results(args.out, device, date, cal, results, command)  # after every scenario: a later one may time out
        base = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in entry["baselines"].items())
        print(
            f"{sc.name} ({buffer} trainer buffer): {steady * 1e3:.1f} ms steady "
            f"(first {entry['first_sync_seconds'] * 1e3:.0f} ms), "
            f"bound {bound * 1e3:.1f} ms, ratio {entry['ratio']}, cost model "
            f"{(entry.get('predicted_seconds') or 0) * 1e3:.1f} ms ({entry.get('measured_over_predicted')}), "
            f"fused bound {(entry.get('fused_bound_seconds') or 0) * 1e3:.1f} ms, correct={entry['correct']}; {base}",
            flush=True,
        )
        print(f"  each rank's own time (median): {entry['rank_seconds']}", flush=True)
        for key in ("first_sync_phases", "steady_phases"):
            for side, phases in (entry.get(key) or {}).items():
                print(f"  {key} ({side}): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in phases.items()), flush=True)
    _write_results(args.out, device, date, cal, results, command)
    if meta is not None:
        meta.stop()
    print(
        json.dumps(
            {
                "scenarios": [
                    {k: r.get(k) for k in ("name", "seconds", "lower_bound_seconds", "ratio", "correct", "baselines")}
                    for r in results
                ]
            }
        )
    )
    return 0 if all(r.get("correct") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
