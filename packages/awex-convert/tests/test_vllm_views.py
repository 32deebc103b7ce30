"""awex.convert.vllm: vLLM's fused parameters as canonical boxes (shapes fit the vLLM layout; packing order)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from awex.convert import vllm_param_shapes, vllm_views
from awex.meta import canonical_tensors
from awex.meta.layouts import VllmParallel, vllm_layout
from awex.meta.models import model_dims

# LocalShards checks the views against the layout; awex-convert itself does not depend on awex-transport
LocalShards = pytest.importorskip("awex.transport", reason="awex-transport is not installed here").LocalShards

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen3-8b.json").read_text())
DIMS = dataclasses.replace(model_dims(CONFIG, "float32"), layers=2, hidden=64, intermediate=96, heads=8,
                           kv_heads=2, head_dim=8, vocab=1000)


@pytest.mark.parametrize("tp", [1, 2, 4])  # tp=4 > kv_heads=2: KV heads replicated
def test_params_fit_the_layout_and_pack_q_k_v_and_gate_up_in_vllm_order(tp):
    tensors = canonical_tensors(DIMS)
    layout = vllm_layout(tensors, VllmParallel(tp=tp), "v")
    g = torch.Generator().manual_seed(0)
    full = {t.name: torch.randn(t.spec.shape, generator=g) for t in tensors}
    for rank in range(tp):
        params = {n: torch.full(s, float("nan")) for n, s in vllm_param_shapes(DIMS, VllmParallel(tp=tp), rank).items()}
        shards = LocalShards.from_layout(layout, rank, vllm_views(params, DIMS, VllmParallel(tp=tp)))
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        # what vLLM's loaders build: [q shard; k shard; v shard] and [gate shard; up shard]
        hd, q = DIMS.head_dim, DIMS.heads // tp * DIMS.head_dim
        kv_head = rank * DIMS.kv_heads // tp if tp > DIMS.kv_heads else None
        kv_rows = DIMS.kv_heads // tp * hd
        kv = slice(kv_head * hd, (kv_head + 1) * hd) if kv_head is not None else slice(rank * kv_rows, (rank + 1) * kv_rows)
        pre = "model.layers.1."
        want_qkv = torch.cat([full[pre + "self_attn.q_proj.weight"][rank * q:(rank + 1) * q],
                              full[pre + "self_attn.k_proj.weight"][kv], full[pre + "self_attn.v_proj.weight"][kv]])
        assert torch.equal(params[pre + "self_attn.qkv_proj.weight"], want_qkv)
        i = DIMS.intermediate // tp
        want_gate_up = torch.cat([full[pre + "mlp.gate_proj.weight"][rank * i:(rank + 1) * i],
                                  full[pre + "mlp.up_proj.weight"][rank * i:(rank + 1) * i]])
        assert torch.equal(params[pre + "mlp.gate_up_proj.weight"], want_gate_up)
        # every element except vocabulary padding rows was written
        for name, p in params.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                block = p.shape[0]
                p = p[: max(0, min(block, DIMS.vocab - rank * block))]
            assert not torch.isnan(p).any(), name
