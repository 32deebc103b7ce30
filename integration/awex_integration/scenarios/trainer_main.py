"""A trainer rank of a scenario (runs in a spawned process): holds weights, takes 'RL steps', syncs each."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel
from awex.transport import LocalShards
from awex_integration.engines.tiny_model import decoder_layers, dtype_kwarg, hf_auto_class

ENGINES_START_SECONDS = 300.0  # the first version also waits for the engines, which start beside the trainer ranks


def canonical_delta(name: str, shape: tuple[int, ...], step: int, scale: float = 0.02) -> torch.Tensor:
    """The update an 'RL step' applies to a canonical tensor: the same on every rank that holds a piece."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 7919 + step)
    return scale * torch.randn(shape, generator=g, dtype=torch.float32)


def apply_step(shards: LocalShards, specs: dict, step: int) -> None:
    """Add this step's delta to every box this rank holds (read, add, write back through the views)."""
    for name in shards.names():
        spec = specs[name]
        delta = canonical_delta(name, spec.shape, step)
        for box, view in shards.pairs(name):
            cur = torch.empty(box.sizes, dtype=view.dtype)
            shards.copy_out(name, box.offsets, box.sizes, cur)
            shards.copy_in(name, box.offsets, box.sizes, (cur.float() + delta[box.slices()]).to(cur.dtype))


def model_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype most of a checkpoint's tensors have (a few, such as a router's FP32 bias, may differ)."""
    counts: dict[torch.dtype, int] = {}
    for t in weights.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get)


@dataclass(frozen=True)
class TrainerJob:
    """What one trainer rank of a scenario runs (picklable: spawned processes and Ray tasks take it as it is)."""

    kind: str  # "megatron", "fsdp" or "hf"
    rank: int
    world: int
    port: int  # where the trainer's own process group meets (Megatron, FSDP2)
    parallel: MegatronParallel | None
    config: dict
    model_dir: str
    address: str  # the MetaServer
    job: str
    token: str | None
    destinations: tuple[str, ...]
    steps: int
    timeout: float
    receive: str = "in_place"
    transport: str = "auto"
    host: str | None = None  # where the trainers' sync group and version channel listen
    log_level: str = "warning"
    endpoints: dict[str, str] = field(default_factory=dict)  # vLLM servers driven over HTTP (vLLM's trainer API)
    ray_engines: dict[str, Any] = field(default_factory=dict)  # vLLM LLM actors' handles (vLLM's trainer API)
    fp8: bool = False  # the receivers hold FP8 block-quantised weights; this rank quantises its own on the fly
    fp8_auto: bool = False  # with fp8: the writer's quantize_on_receive="auto" instead of FP8 views of its own
    wave_bytes: int | None = None  # the writer's wave size (None: the writer's default)


def trainer_rank(job: TrainerJob) -> dict:
    """Run :func:`trainer_body`, announcing a failure on the MetaServer so the driver stops waiting at once."""
    try:
        return trainer_body(job)
    except BaseException as e:
        try:
            client = MetaClient(job.address, job=job.job, token=job.token, timeout=10)
            client.publish_event("trainer_failed", f"trainer:{job.rank}", data=f"{type(e).__name__}: {e}"[:2000])
        finally:
            raise


def trainer_body(job: TrainerJob) -> dict:
    """Run one trainer rank for ``job.steps`` steps; returns per-step bytes sent and seconds."""
    kind, rank, world, port, parallel, config = job.kind, job.rank, job.world, job.port, job.parallel, job.config
    model_dir, destinations, steps, timeout = job.model_dir, list(job.destinations), job.steps, job.timeout
    import logging

    from safetensors.torch import load_file

    from awex.engines.source import TrainerSource

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("awex").setLevel(job.log_level.upper())
    from awex.engines.writer import WeightsWriter

    client = MetaClient(job.address, job=job.job, token=job.token, timeout=timeout)
    hf = load_file(f"{model_dir}/model.safetensors")
    if kind == "megatron":
        from awex_integration.engines.megatron_workers import load_hf_into, megatron_rank

        model, dims, layout, shards, _, _ = megatron_rank(rank, world, port, parallel, config)
        with torch.no_grad():
            load_hf_into(shards, hf)
        source = TrainerSource.megatron(model, config, parallel)  # reads this rank's place from parallel_state
    elif kind == "fsdp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dtype = model_dtype(hf)
        model = hf_auto_class(config).from_pretrained(model_dir, **dtype_kwarg(dtype))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for block in decoder_layers(model):  # each decoder layer its own FSDP unit, as trainers shard them
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = TrainerSource.fsdp(model)
    else:
        model = hf_auto_class(config).from_pretrained(model_dir, **dtype_kwarg(model_dtype(hf))).eval()
        source = TrainerSource.hf(model)
    layout, local_rank, view_of = source.layout, source.local_rank, source.view_of
    options = {"wave_bytes": job.wave_bytes} if job.wave_bytes else {}
    options["transport"] = job.transport
    if job.host:
        options["host"] = job.host
    engine = None
    if job.endpoints or job.ray_engines:  # vLLM's trainer-side API drives the engines
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

        from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo

        info = AwexTrainerInitInfo(
            rank=rank,
            meta_address=job.address,
            job=job.job,
            token=job.token,
            instances=tuple(destinations),
            timeout=timeout,
            receive=job.receive,
            **options,
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info,
            client={  # over HTTP (scenario --control vllm-http) or Ray (vllm-ray: vLLM's LLM actors' handles)
                **{name: HTTPVLLMWeightSyncClient(url, timeout=timeout + 30) for name, url in job.endpoints.items()},
                **{name: RayVLLMWeightSyncClient(handle) for name, handle in job.ray_engines.items()},
            },
            source=AwexSource(layout, local_rank, view_of),
        )
        writer = engine.writer
    elif job.fp8 and job.fp8_auto:  # the bf16 weights: the ranks pick who quantises when they plan
        writer = WeightsWriter.from_source(client, source, timeout=timeout, quantize_on_receive="auto", **options)
    elif job.fp8:
        from awex.convert import Fp8Views
        from awex.meta import Fp8BlockQuant, quantize_layout

        quant = Fp8BlockQuant()
        fp8_layout = quantize_layout(layout, quant)
        fp8_views = Fp8Views(fp8_layout, local_rank, view_of, quant)
        writer = WeightsWriter(
            client,
            fp8_layout,
            local_rank,
            fp8_views.view_of,
            refresh=fp8_views.quantize,
            refresh_by_wave=fp8_views.by_wave,
            timeout=timeout,
            **options,
        )
    else:
        writer = WeightsWriter.from_source(client, source, timeout=timeout, **options)
    shards = LocalShards.from_layout(layout, local_rank, view_of)  # the weights themselves (steps change them)
    specs = {t.spec.name: t.spec for t in layout.tensors}
    out = []
    seq = 0
    client.publish_event("trainer_ready", f"trainer:{rank}")
    for step in range(1, steps + 1):
        event = client.wait_event(
            "step", after=seq, timeout=timeout if step > 1 else max(timeout, ENGINES_START_SECONDS)
        )
        seq = event["seq"]
        if (event.get("data") or {}).get("abort"):
            break
        if (event.get("data") or {}).get("die") == rank:
            import os

            os._exit(7)  # a trainer rank dying mid-sync (fault scenario)
        with torch.no_grad():
            apply_step(shards, specs, step)
        started = time.monotonic()
        if engine is not None:
            engine.send_weights(f"step-{step}", validate=(event.get("data") or {}).get("validate"))
            sent = engine.writer.last_stats.bytes_sent
        else:
            sent = writer.write(f"step-{step}", destinations).bytes_sent
        out.append(
            {
                "step": step,
                "bytes_sent": sent,
                "seconds": time.monotonic() - started,
                "transport": (engine.writer if engine is not None else writer).transport_in_use,
                "stalls": [s.to_json() for s in engine.last_stalls.values()] if engine is not None else [],
            }
        )
        client.publish_event("trainer_sent", f"trainer:{rank}", version=f"step-{step}", data={"bytes": sent})
    return {"rank": rank, "steps": out}
