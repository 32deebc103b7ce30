"""Ranks for the GPU writer/reader tests: a Megatron-layout trainer or a vLLM-layout engine on one GPU."""

from __future__ import annotations

import dataclasses


def sync_rank(address: str, transport: str, instance: str, local_rank: int, tp: int, gpu: int,
              destinations: list[str], versions: int = 3) -> dict:
    import torch

    from awex.convert import MegatronNames, megatron_param_shapes, megatron_views, vllm_param_shapes, vllm_views
    from awex.engines.reader import WeightsReader
    from awex.engines.writer import WeightsWriter
    from awex.meta import canonical_tensors
    from awex.meta.client import MetaClient
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
    from awex.meta.models import model_dims
    from awex.meta import load_config
    from awex_integration.bench_gpu import MODELS, NamedParams, canonical_value

    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    dims = dataclasses.replace(model_dims(load_config(MODELS / "qwen3-8b.json"), "bfloat16"), layers=2)
    tensors = canonical_tensors(dims)
    client = MetaClient(address, job="gpu")
    if instance == "trainer":
        where = MegatronNames(local_rank, 0, MegatronParallel(tp=tp))
        params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device)
                  for n, s in megatron_param_shapes(dims, where)[0].items()}
        layout = megatron_layout(tensors, MegatronParallel(tp=tp), instance="trainer")
        writer = WeightsWriter(client, layout, local_rank, megatron_views(NamedParams(params), dims, where),
                               transport=transport, timeout=120, host="127.0.0.1")
        for v in range(1, versions + 1):
            for name in writer.shards.names():
                full = canonical_value(name, layout.tensor(name).spec.shape, v, device)
                for box, view in writer.shards.pairs(name):
                    view.copy_(full[box.slices()])
            if v == 1 and local_rank == 0:
                for d in destinations:  # the engines are up before the first version goes out
                    client.get(f"ready/{d}", timeout=120)
            writer.write(f"v{v}", destinations)
        return {"versions": versions}
    parallel = VllmParallel(tp=tp)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device)
              for n, s in vllm_param_shapes(dims, parallel, local_rank).items()}
    layout = vllm_layout(tensors, parallel, instance=instance)
    reader = WeightsReader(client, layout, local_rank, vllm_views(params, dims, parallel), timeout=120)
    if local_rank == 0:
        client.put(f"ready/{instance}", True)
    bad, checked = [], 0
    for v in range(1, versions + 1):
        reader.receive(f"v{v}")
        for name in reader.shards.names():
            full = canonical_value(name, layout.tensor(name).spec.shape, v, device)
            for box, view in reader.shards.pairs(name):
                checked += 1
                if not torch.equal(view, full[box.slices()]):
                    bad.append(f"v{v} {name} {box}")
    return {"checked": checked, "bad": bad[:10]}
