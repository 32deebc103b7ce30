"""An FSDP2 trainer's views (``awex.engines.fsdp.dtensor_views``) carry a fingerprint of the local shards: a steady
version checks where each shard is instead of deriving every view again, and views of shards that moved are
re-pointed at their new memory, exactly where deriving them again puts them. One process, a world of one rank
(gloo, CPU), a two-layer Qwen2 sharded per decoder layer as trainers shard it."""

from __future__ import annotations

import pytest
import torch
from steady_counts import counted

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def fsdp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256,
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def test_fsdp2_views_are_checked_by_fingerprint_and_re_pointed_where_shards_moved(fsdp_model):
    from awex.engines.source import TrainerSource
    from awex.transport import LocalShards
    from awex.transport.rebind import rebound

    source = TrainerSource.fsdp(fsdp_model)
    layout, rank = source.layout, source.local_rank
    view_of, calls = counted(source.view_of)
    held, _ = rebound(layout, rank, view_of, LocalShards.from_layout(layout, rank, view_of), quick=True)
    calls.clear()
    for _ in range(3):  # steady: no view asked for
        same, moved = rebound(layout, rank, view_of, held, quick=True)
        assert same is held and moved == [] and calls == []
    fsdp_model._apply(lambda t: t.clone())  # offloaded and loaded back (as module.to() does): new local shards
    now, moved = rebound(layout, rank, view_of, held, quick=True)
    assert calls == [] and now is not held and len(moved) == len(list(layout.tensors))
    derived = LocalShards.from_layout(layout, rank, source.view_of)
    assert now.moved(derived) == []  # each view where deriving it again puts it
    locals_ = {n: p.to_local() for n, p in fsdp_model.named_parameters()}
    name = next(iter(derived.names()))
    assert now.pairs(name)[0][1].data_ptr() == locals_[name].data_ptr()
