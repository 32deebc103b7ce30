"""A trainer rank of a scenario (runs in a spawned process): holds weights, takes 'RL steps', syncs each."""

from __future__ import annotations

import time
import zlib

import torch

from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel
from awex.transport import LocalShards
from awex_integration.tiny_model import decoder_layers, dtype_kwarg, hf_auto_class


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


def trainer_rank(*args) -> dict:
    """Run :func:`trainer_body`, announcing a failure on the MetaServer so the driver stops waiting at once."""
    meta = args[7]
    try:
        return trainer_body(*args)
    except BaseException as e:
        try:
            client = MetaClient(meta["address"], job=meta["job"], token=meta["token"], timeout=10)
            client.publish_event("trainer_failed", f"trainer:{args[1]}", data=f"{type(e).__name__}: {e}"[:2000])
        finally:
            raise


def trainer_body(
    kind: str,
    rank: int,
    world: int,
    port: int,
    parallel: MegatronParallel | None,
    config: dict,
    model_dir: str,
    meta: dict,
    destinations: list[str],
    steps: int,
    timeout: float,
    fp8: bool = False,
    wave_bytes: int | None = None,
) -> dict:
    """Run one trainer rank for ``steps`` steps; returns per-step bytes sent and seconds.

    ``fp8``: the receivers hold FP8 block-quantised weights; this rank quantises its own on the fly.
    ``wave_bytes``: the writer's wave size (default: the writer's).
    """
    import logging

    from safetensors.torch import load_file

    from awex.engines.source import TrainerSource

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("awex").setLevel(meta.get("log_level", "warning").upper())
    from awex.engines.writer import WeightsWriter

    client = MetaClient(meta["address"], job=meta["job"], token=meta["token"], timeout=timeout)
    hf = load_file(f"{model_dir}/model.safetensors")
    if kind == "megatron":
        from awex_integration.megatron_workers import load_hf_into, megatron_rank

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
    options = {"wave_bytes": wave_bytes} if wave_bytes else {}
    options["transport"] = meta.get("transport", "auto")
    if meta.get("host"):
        options["host"] = meta["host"]
    engine = None
    if meta.get("endpoints") or meta.get("ray_engines"):  # vLLM's trainer-side API drives the engines
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

        from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo

        info = AwexTrainerInitInfo(
            rank=rank,
            meta_address=meta["address"],
            job=meta["job"],
            token=meta["token"],
            instances=tuple(destinations),
            timeout=timeout,
            receive=meta["receive"],
            **options,
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info,
            client={  # over HTTP (scenario --control vllm-http) or Ray (vllm-ray: vLLM's LLM actors' handles)
                **{
                    name: HTTPVLLMWeightSyncClient(url, timeout=timeout + 30) for name, url in meta["endpoints"].items()
                },
                **{name: RayVLLMWeightSyncClient(handle) for name, handle in meta.get("ray_engines", {}).items()},
            },
            source=AwexSource(layout, local_rank, view_of),
        )
        writer = engine.writer
    elif fp8:
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
        event = client.wait_event("step", after=seq, timeout=timeout)
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
