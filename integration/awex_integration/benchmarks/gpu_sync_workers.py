"""Ranks for the GPU (and NPU) writer/reader tests: a Megatron-layout trainer or a vLLM-layout engine on one device,
and :func:`run_sync_case`, which starts a case's ranks and returns what each reported."""

from __future__ import annotations

import dataclasses
import time


def module_of(params: dict):
    """The parameters as an ``nn.Module`` tree named like the dict (what a trainer holds; its memory can move)."""
    import torch

    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


@dataclasses.dataclass(frozen=True)
class GpuRank:
    """What one rank of a GPU (or NPU) sync case runs (:func:`sync_rank`); picklable."""

    address: str  # the MetaServer
    transport: str
    instance: str  # "trainer", or the engine's instance ("vllm-0", ...)
    local_rank: int
    tp: int
    gpu: int
    destinations: tuple[str, ...] = ()  # the trainer's
    versions: int = 3
    fp8: bool = False
    model: str = "qwen3-8b"
    readers_per_instance: int = 1  # the trainer waits for this many readers of each destination to close
    on_receive: bool | str = False  # True, or "auto"
    delta: bool = False
    device_type: str = "cuda"
    move: bool = False
    layers: int = 2
    let_go: bool = False  # the writer holds no trainer memory between versions (hold_trainer_memory=False)


def sync_rank(job: GpuRank) -> dict:
    """One rank: the trainer writes ``versions`` versions, engines receive and check each (FP8 receivers: the
    trainer quantises on the fly, receivers check FP8 tiles and scales bit for bit), then close; the trainer
    returns once every reader (``readers_per_instance`` ranks of each destination) has closed. ``on_receive``: FP8
    receivers quantise from the trainer's bf16 memory themselves (``quantize_on_receive``, CUDA IPC).
    ``delta``: the writer sends delta buckets: each version after the first changes 1% of the elements, and
    before version 3 the engine's rank 0 changes one of its tensors behind the writer's back (its buckets must come
    whole and exact). ``device_type``: ``"cuda"`` or ``"npu"`` (Ascend, HCCL). ``move``: the trainer's parameters (an
    ``nn.Module``) are offloaded to the host and loaded back into new device memory before every version after the
    first (as colocated RL stacks do), and so are the engine's: writer and reader re-bind; the trainer measures the
    device memory each offload gave back (``freed``: free memory after it less before, the caching allocator
    emptied). ``let_go``: the writer holds no trainer memory between versions. Both sides return their transfer
    stats (and phases) per version."""
    import torch

    address, transport, instance, local_rank, tp, gpu = (
        job.address,
        job.transport,
        job.instance,
        job.local_rank,
        job.tp,
        job.gpu,
    )
    destinations, versions, fp8, model, readers_per_instance = (
        list(job.destinations),
        job.versions,
        job.fp8,
        job.model,
        job.readers_per_instance,
    )
    on_receive, delta, device_type, move, layers = job.on_receive, job.delta, job.device_type, job.move, job.layers

    from awex.convert import (
        Fp8Views,
        MegatronNames,
        megatron_param_shapes,
        megatron_views,
        vllm_param_dtypes,
        vllm_param_shapes,
        vllm_views,
    )
    from awex.convert.live import LiveTensors
    from awex.engines.reader import WeightsReader
    from awex.engines.writer import WeightsWriter
    from awex.meta import Fp8BlockQuant, canonical_tensors, load_config, quantize_layout
    from awex.meta.client import MetaClient
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
    from awex.meta.models import model_dims
    from awex.transport import LocalShards
    from awex.transport.accelerator import device_api
    from awex_integration.benchmarks.bench_common import (
        MODELS,
        NamedParams,
        bits,
        canonical_value,
        expected_value,
        sparse_value,
    )

    device = torch.device(device_type, gpu)
    device_api(device).set_device(gpu)
    dims = dataclasses.replace(model_dims(load_config(MODELS / f"{model}.json"), "bfloat16"), layers=layers)
    quant = Fp8BlockQuant() if fp8 else None
    tensors = canonical_tensors(dims)
    client = MetaClient(address, job="gpu")
    if instance == "trainer":
        where = MegatronNames(local_rank, 0, MegatronParallel(tp=tp))
        params = {
            n: torch.zeros(s, dtype=torch.bfloat16, device=device)
            for n, s in megatron_param_shapes(dims, where)[0].items()
        }
        layout = megatron_layout(tensors, MegatronParallel(tp=tp), instance="trainer")
        module = module_of(params) if move else None
        view_of = megatron_views(module if move else NamedParams(params), dims, where)
        weights = LocalShards.from_layout(layout, local_rank, view_of)
        model_bytes = sum(t.nbytes for t in params.values())
        params = params if not move else None  # the module holds them (nothing else may, for the offload to free)
        if quant and on_receive:
            writer = WeightsWriter(
                client,
                layout,
                local_rank,
                view_of,
                transport=transport,
                timeout=120,
                host="127.0.0.1",
                quantize_on_receive=on_receive,  # True, or "auto"
            )
        elif quant:
            fp8_views = Fp8Views(quantize_layout(layout, quant), local_rank, view_of, quant)
            writer = WeightsWriter(
                client,
                quantize_layout(layout, quant),
                local_rank,
                fp8_views.view_of,
                transport=transport,
                timeout=120,
                host="127.0.0.1",
                refresh=fp8_views.quantize,
                refresh_by_wave=fp8_views.by_wave,
            )
        else:
            writer = WeightsWriter(
                client, layout, local_rank, view_of, transport=transport, timeout=120, host="127.0.0.1", delta=delta
            )
        writer.hold_trainer_memory = not job.let_go
        stats, freed = [], []
        value = sparse_value if delta else canonical_value
        for v in range(1, versions + 1):
            if move and v > 1:  # offloaded while the engine generates, loaded back into new memory
                weights = None  # this worker's own views of them (the values it writes) go too
                torch.cuda.empty_cache()  # what was freed before is not this offload's
                before = torch.cuda.mem_get_info(device)[0]
                for p in module.parameters():
                    p.data = p.data.to("cpu")
                torch.cuda.empty_cache()
                freed.append(torch.cuda.mem_get_info(device)[0] - before)
                for p in module.parameters():
                    p.data = p.data.to(device)
                weights = LocalShards.from_layout(layout, local_rank, view_of)  # where the values go now
            for name in weights.names():
                full = value(name, layout.tensor(name).spec.shape, v, device)
                for box, view in weights.pairs(name):
                    view.copy_(full[box.slices()])
            if v == 1 and local_rank == 0:
                for d in destinations:  # the engines are up before the first version goes out
                    client.get(f"ready/{d}", timeout=120)
            started = time.monotonic()
            written = writer.write(f"v{v}", destinations)
            stats.append({"bytes_sent": written.bytes_sent, "bytes_dense": getattr(written, "bytes_dense", None)})
            stats[-1].update(seconds=time.monotonic() - started, phases=written.phases)
        transport_in_use = writer.transport_in_use
        for d in destinations:  # readers release this process's memory (CUDA IPC) before it exits
            for r in range(readers_per_instance):
                client.get(f"closed/{d}/{r}", timeout=120)
        writer.close()
        out = {"versions": versions, "transport": transport_in_use, "stats": stats, "quantizing": writer.quantizing}
        return {**out, "freed": freed, "model_bytes": model_bytes}
    parallel = VllmParallel(tp=tp)
    shapes = vllm_param_shapes(dims, parallel, local_rank, quant=quant)
    dtypes = vllm_param_dtypes(shapes, "bfloat16", quant)
    params = {n: torch.zeros(s, dtype=dtypes[n], device=device) for n, s in shapes.items()}
    layout = vllm_layout(tensors, parallel, instance=instance)
    if quant:
        layout = quantize_layout(layout, quant)
    engine = module_of(params) if move else None  # an engine that re-allocates its weights between versions
    found = LiveTensors(engine, buffers=False) if move else params
    reader = WeightsReader(
        client, layout, local_rank, vllm_views(found, dims, parallel, tp_rank=local_rank), timeout=120
    )
    if local_rank == 0:
        client.put(f"ready/{instance}", True)
    bad, checked, stats = [], 0, []
    for v in range(1, versions + 1):
        if delta and v == 3 and local_rank == 0:  # behind the writer's back: its baseline for this tensor is stale
            name = sorted(n for n in reader.shards.names() if len(layout.tensor(n).spec.shape) == 2)[0]
            reader.shards.pairs(name)[0][1][0, :7] = 3.0
        if move and v > 1:  # offloaded (vLLM's sleep level 2, say) and allocated anew before the version lands
            for p in engine.parameters():
                p.data = p.data.to("cpu")
            for p in engine.parameters():
                p.data = p.data.to(device)
        got = reader.receive(f"v{v}")
        stats.append(
            {
                "bytes_received": got.bytes_received,
                "bytes_dense": getattr(got, "bytes_dense", None),
                "buckets_resent": getattr(got, "buckets_resent", None),
                "phases": got.phases,
            }
        )
        for name in reader.shards.names():
            full = sparse_value(name, layout.tensor(name).spec.shape, v, device) if delta else None
            full = full if full is not None else expected_value(layout, name, v, device, quant)
            for box, view in reader.shards.pairs(name):
                checked += 1
                if not torch.equal(bits(view), bits(full[box.slices()])):
                    bad.append(f"v{v} {name} {box}")
    reader.close()
    client.put(f"closed/{instance}/{local_rank}", True)
    return {"checked": checked, "bad": bad[:10], "stats": stats}


def run_sync_case(case: tuple, device_type: str = "cuda", timeout: float = 240) -> dict:
    """Run one case of ``test_gpu_sync`` / ``test_npu_sync``: ``(transport, trainer tp, trainer devices, [(engine
    tp, engine devices), ...], fp8?, model?, on_receive?, delta?, move?, layers?, versions?, let_go?)`` (``move``:
    True for trainer and engines, ``"trainer"`` for the trainer alone; ``versions``: 4 with delta or move, else 3, by
    default; ``let_go``: the writer holds no trainer memory between versions); ``{(instance, rank): (status,
    value)}``."""
    from awex.meta.server import start_embedded
    from awex_integration.scenarios.spawn import run_processes

    transport, train_tp, train_devices, engines, *extra = case
    fp8, model, on_receive, delta, move, layers, versions, let_go = (
        *extra,
        *(False, "qwen3-8b", False, False, False, 2, None, False)[len(extra) :],
    )
    versions = versions or (4 if delta or move else 3)
    server = start_embedded()
    try:
        destinations = [f"vllm-{i}" for i in range(len(engines))]
        common = {"versions": versions, "fp8": fp8, "model": model, "delta": delta, "device_type": device_type}
        common["layers"] = layers
        jobs = [
            (
                ("trainer", r),
                sync_rank,
                (
                    GpuRank(
                        server.address,
                        transport,
                        "trainer",
                        r,
                        train_tp,
                        train_devices[r],
                        tuple(destinations),
                        readers_per_instance=engines[0][0],
                        on_receive=on_receive,
                        move=bool(move),
                        let_go=let_go,
                        **common,
                    ),
                ),
            )
            for r in range(train_tp)
        ]
        for i, (tp, devices) in enumerate(engines):
            jobs += [
                (
                    (f"vllm-{i}", r),
                    sync_rank,
                    (GpuRank(server.address, transport, f"vllm-{i}", r, tp, devices[r], move=move is True, **common),),
                )  # move="trainer": the trainer only
                for r in range(tp)
            ]
        return run_processes(jobs, timeout=timeout)
    finally:
        server.stop()
