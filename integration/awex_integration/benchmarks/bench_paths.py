"""The two paths a GPU benchmark worker times: the transport's executor driven directly (``--path executor``) and
the public writer/reader path (``--path public``)."""

from __future__ import annotations

import json
import statistics
import time
from functools import partial
from pathlib import Path

from awex_integration.benchmarks.bench_common import (
    fill,
    mismatches,
    scenario_devices,
    sparse_value,
)
from awex_integration.benchmarks.timeline import Timeline


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
            quantize_on_receive=a.extra.get("fp8_on_receive") or False,  # True, or "auto"
            delta=bool(a.extra.get("delta")),
            verify=bool(a.extra.get("verify")),
        )
        step = lambda version: side.write(version, dests)  # noqa: E731
    elif a.extra.get("staged"):
        side, step, live = _staged_reader(client, layout, a.local_rank, view_of, result, a.extra["staged"])
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
    timeline = Timeline() if a.extra.get("timeline") else None
    if timeline is not None:  # the steady versions' steps (awex_integration.benchmarks.timeline)
        timeline.install()
    step_seconds, waiting = a.extra.get("step_seconds") or 0.0, a.extra.get("waiting_receivers")
    for i in range(a.iters):
        side.flush()  # the requests a sync leaves for afterwards get the time a training step gives them (not timed)
        if not waiting:
            time.sleep(step_seconds)  # a training step's gap, where asked (not timed)
        if changed and trainer:
            fill(weights, base_layout, i + 2, device, changed)  # not timed
        torch.cuda.synchronize()
        if waiting:  # receivers wait through the trainer's step; the time runs from its write
            result["steady_seconds"].append(timed(sync_once, step_seconds if trainer else 0.0, starts=trainer))
        else:
            result["steady_seconds"].append(timed(sync_once))
    result["steady_phases"] = side.last_phases
    if timeline is not None:
        timeline.uninstall()
        result["timeline"] = timeline.events
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
    shards = live if a.extra.get("staged") and not trainer else side.shards  # staged: what was applied is checked
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


def _staged_reader(client, layout, local_rank, view_of, result, where: str):
    """A receiver that takes each version into staging (on the GPU or in pinned host memory: ``where``) and applies
    it by a copy into its live weights once the whole version arrived, as vLLM's engines do with
    ``receive="staged"`` (``awex.engines.staging``; here with nothing to pause): the reader, its step, and the live
    weights. Records per version the seconds until staged and the commit's."""
    from awex.engines.reader import WeightsReader
    from awex.engines.staging import StagingBuffers, commit, transport_device
    from awex.transport import LocalShards

    live = LocalShards.from_layout(layout, local_rank, view_of)
    staging = StagingBuffers(layout, where, live.device)  # as vLLM's and SGLang's bindings stage
    reader = WeightsReader(client, layout, local_rank, staging, device=transport_device(where, live.device))
    targets = {(name, box): view for name in live.names() for box, view in live.pairs(name)}
    marks: dict[str, float] = {}
    result["staged_seconds"], result["commit_seconds"] = [], []

    def apply(shards) -> None:
        commit(shards, live.names(), lambda name, box: targets[(name, box)], live.device)

    def step(version):
        started = time.perf_counter()
        stats = reader.receive(
            version, apply=apply, before_apply=lambda: marks.__setitem__("staged", time.perf_counter())
        )
        done = time.perf_counter()
        result["staged_seconds"].append(marks["staged"] - started)
        result["commit_seconds"].append(done - marks["staged"])
        return stats

    return reader, step, live


def staged_summary(per_rank: list[dict]) -> dict:
    """``--staged``: the receivers' steady medians (slowest rank) of the sync until staged and of the commit."""
    receivers = [p for p in per_rank if not p["trainer"] and p.get("commit_seconds")]
    if not receivers:
        return {}

    def slowest(key: str) -> float:
        return round(max(statistics.median(p[key][1:-1] or p[key]) for p in receivers), 6)  # steady versions

    staged, commit = slowest("staged_seconds"), slowest("commit_seconds")
    return {"staged": {"sync_to_staged_seconds": staged, "commit_seconds": commit}}


def describe_staged(staged: dict) -> str:
    sync, commit = staged["sync_to_staged_seconds"], staged["commit_seconds"]
    return f"  staged: sync {sync * 1e3:.2f} ms, stall (commit) {commit * 1e3:.2f} ms"


def phases_of(per_rank: list[dict], key: str) -> dict[str, dict[str, float]]:
    """Seconds of each phase of a sync on the trainers and on the receivers (the slowest rank's of each)."""
    out: dict[str, dict[str, float]] = {"trainer": {}, "inference": {}}
    for p in per_rank:
        side = out["trainer" if p["trainer"] else "inference"]
        for name, seconds in (p.get(key) or {}).items():
            side[name] = round(max(side.get(name, 0.0), seconds), 6)
    return out


def _cuda_seconds(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
