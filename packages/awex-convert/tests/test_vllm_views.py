"""awex.convert.vllm: vLLM's fused parameters as canonical boxes (shapes fit the vLLM layout; packing order)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from awex.convert import vllm_param_dtypes, vllm_param_shapes, vllm_views
from awex.meta import canonical_tensors
from awex.meta.layouts import VllmParallel, vllm_layout
from awex.meta.models import model_dims

# LocalShards checks the views against the layout; awex-convert itself does not depend on awex-transport
LocalShards = pytest.importorskip("awex.transport", reason="awex-transport is not installed here").LocalShards

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen3-8b.json").read_text())
DIMS = dataclasses.replace(
    model_dims(CONFIG, "float32"), layers=2, hidden=64, intermediate=96, heads=8, kv_heads=2, head_dim=8, vocab=1000
)


def received_params(dims, tp: int, seed: int):
    """Random canonical tensors, and each vLLM rank's parameters (NaN-filled first) after receiving them through
    ``vllm_views`` in place: ``(full, [params of rank 0, ...])``."""
    tensors = canonical_tensors(dims)
    layout = vllm_layout(tensors, VllmParallel(tp=tp), "v")
    g = torch.Generator().manual_seed(seed)
    full = {t.name: torch.randn(t.spec.shape, generator=g) for t in tensors}
    out = []
    for rank in range(tp):
        params = {n: torch.full(s, float("nan")) for n, s in vllm_param_shapes(dims, VllmParallel(tp=tp), rank).items()}
        shards = LocalShards.from_layout(layout, rank, vllm_views(params, dims, VllmParallel(tp=tp)))
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        out.append(params)
    return full, out


@pytest.mark.parametrize("tp", [1, 2, 4])  # tp=4 > kv_heads=2: KV heads replicated
def test_params_fit_the_layout_and_pack_q_k_v_and_gate_up_in_vllm_order(tp):
    full, ranks = received_params(DIMS, tp, seed=0)
    for rank, params in enumerate(ranks):
        # what vLLM's loaders build: [q shard; k shard; v shard] and [gate shard; up shard]
        hd, q = DIMS.head_dim, DIMS.heads // tp * DIMS.head_dim
        kv_head = rank * DIMS.kv_heads // tp if tp > DIMS.kv_heads else None
        kv_rows = DIMS.kv_heads // tp * hd
        kv = (
            slice(kv_head * hd, (kv_head + 1) * hd)
            if kv_head is not None
            else slice(rank * kv_rows, (rank + 1) * kv_rows)
        )
        pre = "model.layers.1."
        want_qkv = torch.cat(
            [
                full[pre + "self_attn.q_proj.weight"][rank * q : (rank + 1) * q],
                full[pre + "self_attn.k_proj.weight"][kv],
                full[pre + "self_attn.v_proj.weight"][kv],
            ]
        )
        assert torch.equal(params[pre + "self_attn.qkv_proj.weight"], want_qkv)
        i = DIMS.intermediate // tp
        want_gate_up = torch.cat(
            [
                full[pre + "mlp.gate_proj.weight"][rank * i : (rank + 1) * i],
                full[pre + "mlp.up_proj.weight"][rank * i : (rank + 1) * i],
            ]
        )
        assert torch.equal(params[pre + "mlp.gate_up_proj.weight"], want_gate_up)
        # every element except vocabulary padding rows was written
        for name, p in params.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                block = p.shape[0]
                p = p[: max(0, min(block, DIMS.vocab - rank * block))]
            assert not torch.isnan(p).any(), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp8_scales_fuse_like_their_weights(tp):
    from awex.convert import quantize_fp8_blocks
    from awex.meta import Fp8BlockQuant, quantize_layout

    quant = Fp8BlockQuant(block=(8, 16))  # tiles small enough for this model: every partition is whole tiles
    tensors = canonical_tensors(DIMS)
    layout = quantize_layout(vllm_layout(tensors, VllmParallel(tp=tp), "v"), quant)
    g = torch.Generator().manual_seed(1)
    full = {}
    for t in tensors:
        w = torch.randn(t.spec.shape, generator=g)
        if quant.quantises(t.name, t.spec.shape):
            full[t.name], full[t.name + "_scale_inv"] = quantize_fp8_blocks(w, quant.block)
        else:
            full[t.name] = w
    assert set(full) == set(layout.names)
    for rank in range(tp):
        shapes = vllm_param_shapes(DIMS, VllmParallel(tp=tp), rank, quant=quant)
        dtypes = vllm_param_dtypes(shapes, "float32", quant)
        assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == torch.float8_e4m3fn
        assert dtypes["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == torch.float32
        assert dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
        params = {
            n: torch.zeros(s, dtype=dtypes[n])
            if dtypes[n] == torch.float8_e4m3fn
            else torch.full(s, float("nan"), dtype=dtypes[n])
            for n, s in shapes.items()
        }
        shards = LocalShards.from_layout(
            layout, rank, vllm_views(params, DIMS, VllmParallel(tp=tp), fp8_block=quant.block)
        )
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        pre = "model.layers.0."
        q_tiles = DIMS.heads // tp * DIMS.head_dim // 8
        kv_head = rank * DIMS.kv_heads // tp if tp > DIMS.kv_heads else None
        kv_tiles = max(1, DIMS.kv_heads // tp) * DIMS.head_dim // 8
        kv = slice(kv_head, kv_head + 1) if kv_head is not None else slice(rank * kv_tiles, (rank + 1) * kv_tiles)
        want = torch.cat(
            [
                full[pre + "self_attn.q_proj.weight_scale_inv"][rank * q_tiles : (rank + 1) * q_tiles],
                full[pre + "self_attn.k_proj.weight_scale_inv"][kv],
                full[pre + "self_attn.v_proj.weight_scale_inv"][kv],
            ]
        )
        assert torch.equal(params[pre + "self_attn.qkv_proj.weight_scale_inv"], want)
        i_tiles = DIMS.intermediate // tp // 8
        want = torch.cat(
            [
                full[pre + "mlp.gate_proj.weight_scale_inv"][rank * i_tiles : (rank + 1) * i_tiles],
                full[pre + "mlp.up_proj.weight_scale_inv"][rank * i_tiles : (rank + 1) * i_tiles],
            ]
        )
        assert torch.equal(params[pre + "mlp.gate_up_proj.weight_scale_inv"], want)
        down = full[pre + "mlp.down_proj.weight"][
            :, rank * DIMS.intermediate // tp : (rank + 1) * DIMS.intermediate // tp
        ]
        assert torch.equal(params[pre + "mlp.down_proj.weight"].view(torch.uint8), down.view(torch.uint8))
        for name, p in params.items():  # every scale was written
            if name.endswith("_scale_inv"):
                assert not torch.isnan(p).any(), name


MOE_DIMS = dataclasses.replace(
    DIMS, architecture="Qwen3MoeForCausalLM", num_experts=4, moe_intermediate=32, sparse_layers=frozenset({0, 1})
)


@pytest.mark.parametrize("tp,dp,ep", [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, True)])
def test_moe_experts_fuse_into_w13_and_w2(tp, dp, ep):
    parallel = VllmParallel(tp=tp, dp=dp, ep=ep)
    tensors = canonical_tensors(MOE_DIMS)
    layout = vllm_layout(tensors, parallel, "v")
    g = torch.Generator().manual_seed(2)
    full = {t.name: torch.randn(t.spec.shape, generator=g) for t in tensors}
    held = []
    for rank in range(tp * dp):
        tp_rank, dp_rank = rank % tp, rank // tp
        shapes = vllm_param_shapes(MOE_DIMS, parallel, tp_rank, dp_rank=dp_rank)
        params = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
        shards = LocalShards.from_layout(
            layout, rank, vllm_views(params, MOE_DIMS, parallel, tp_rank=tp_rank, dp_rank=dp_rank)
        )
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        pre = "model.layers.1.mlp."
        w13, w2 = params[pre + "experts.routed_experts.w13_weight"], params[pre + "experts.routed_experts.w2_weight"]
        i = MOE_DIMS.moe_intermediate if ep else MOE_DIMS.moe_intermediate // tp
        cols = slice(0, i) if ep else slice(tp_rank * i, (tp_rank + 1) * i)
        first = (dp_rank * tp + tp_rank) * w13.shape[0] if ep else 0
        for local in range(w13.shape[0]):
            e = first + local
            held.append(e)
            want = torch.cat(
                [full[f"{pre}experts.{e}.gate_proj.weight"][cols], full[f"{pre}experts.{e}.up_proj.weight"][cols]]
            )
            assert torch.equal(w13[local], want)
            assert torch.equal(w2[local], full[f"{pre}experts.{e}.down_proj.weight"][:, cols])
        assert torch.equal(params[pre + "gate.weight"], full[pre + "gate.weight"])
        for name, p in params.items():
            if name.startswith("model.layers."):
                assert not torch.isnan(p).any(), name
    # with expert parallelism each expert lives on exactly one rank; without it on every rank
    assert sorted(held) == (list(range(4)) if ep else sorted(list(range(4)) * tp * dp))


def test_param_name_says_which_vllm_parameter_holds_a_canonical_tensor():
    from awex.convert import vllm_param_name

    pre = "model.layers.3."
    assert vllm_param_name(pre + "self_attn.k_proj.bias") == pre + "self_attn.qkv_proj.bias"
    assert vllm_param_name(pre + "self_attn.v_proj.weight_scale_inv") == pre + "self_attn.qkv_proj.weight_scale_inv"
    assert vllm_param_name(pre + "mlp.up_proj.weight") == pre + "mlp.gate_up_proj.weight"
    assert vllm_param_name(pre + "mlp.shared_expert.gate_proj.weight") == pre + "mlp.shared_expert.gate_up_proj.weight"
    assert vllm_param_name(pre + "mlp.experts.7.up_proj.weight") == pre + "mlp.experts.routed_experts.w13_weight"
    assert (
        vllm_param_name(pre + "mlp.experts.7.down_proj.weight_scale_inv")
        == pre + "mlp.experts.routed_experts.w2_weight_scale_inv"
    )
    assert vllm_param_name(pre + "self_attn.o_proj.weight") == pre + "self_attn.o_proj.weight"
    assert vllm_param_name(pre + "mlp.shared_expert_gate.weight") == pre + "mlp.shared_expert_gate.weight"
    assert vllm_param_name("lm_head.weight") == "lm_head.weight"
    assert vllm_param_name("lm_head.weight", tie_embeddings=True) == "model.embed_tokens.weight"


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_moe_shared_expert_fuses_gate_up_like_a_dense_mlp(tp):
    config = json.loads(
        (Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-moe-tiny.json").read_text()
    )
    dims = model_dims(config, "float32")
    assert dims.shared_expert_intermediate, "the model must have a shared expert for this test to test anything"
    full, ranks = received_params(dims, tp, seed=2)
    for rank, params in enumerate(ranks):
        pre = f"model.layers.{min(dims.sparse_layers)}.mlp."
        i = dims.shared_expert_intermediate // tp
        want = torch.cat(
            [
                full[pre + "shared_expert.gate_proj.weight"][rank * i : (rank + 1) * i],
                full[pre + "shared_expert.up_proj.weight"][rank * i : (rank + 1) * i],
            ]
        )
        assert torch.equal(params[pre + "shared_expert.gate_up_proj.weight"], want)
        assert torch.equal(params[pre + "shared_expert_gate.weight"], full[pre + "shared_expert_gate.weight"])
        for name, p in params.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                p = p[: max(0, min(p.shape[0], dims.vocab - rank * p.shape[0]))]
            assert not torch.isnan(p).any(), name


def test_models_whose_engine_parameters_are_not_mapped_are_refused_naming_the_feature():
    """An architecture with latent attention or DeepSeek-style MoE that an engine's views do not list as mapped is
    refused before any view is made, naming the feature (every such architecture Awex knows is mapped today:
    DeepSeek-V3 and GLM-4.5, in vLLM and Megatron-core)."""
    from awex.convert import megatron as megatron_convert
    from awex.convert import vllm as vllm_convert
    from awex.convert.unsupported import refuse_unconverted

    models = Path(__file__).resolve().parents[3] / "integration" / "models"
    glm = model_dims(json.loads((models / "glm4-moe-tiny.json").read_text()))
    deepseek = model_dims(json.loads((models / "deepseek-v3-tiny.json").read_text()))
    with pytest.raises(ValueError, match="vllm: Glm4MoeForCausalLM: .*DeepSeek-style MoE"):
        refuse_unconverted(glm, "vllm")
    with pytest.raises(ValueError, match="megatron: .*multi-head latent attention"):
        refuse_unconverted(deepseek, "megatron")
    for mapped in (vllm_convert.MAPPED, megatron_convert.MAPPED):
        refuse_unconverted(glm, "x", mapped)
        refuse_unconverted(deepseek, "x", mapped)


def test_glm_45_views_cover_every_box_of_every_tp_rank_with_the_router_in_float32():
    """vLLM's GLM-4.5 parameters (qkv_proj with its bias, q/k norms, a dense first layer, routed experts beside
    shared_experts, the router's score bias) tile exactly the boxes the vLLM engine layout gives each TP rank; vLLM
    holds the router weight in float32 (its GateLinear), and so does the engine layout, so a bf16 trainer's router
    widens exactly (the live engine: integration/tests/test_deepseek_glm_vllm.py)."""
    from awex.meta.layouts.vllm import vllm_engine_layout

    models = Path(__file__).resolve().parents[3] / "integration" / "models"
    config = json.loads((models / "glm4-moe-tiny.json").read_text())
    dims = model_dims(config, "bfloat16")
    tp = 2
    layout = vllm_engine_layout(config, "bfloat16", VllmParallel(tp=tp), "v")
    router = layout.tensor("model.layers.1.mlp.gate.weight").spec
    assert router.dtype == "float32"
    assert layout.tensor("model.layers.1.self_attn.q_proj.weight").spec.dtype == "bfloat16"
    g = torch.Generator().manual_seed(0)
    full = {
        t.spec.name: torch.randn(t.spec.shape, generator=g).to(getattr(torch, t.spec.dtype)) for t in layout.tensors
    }
    for rank in range(tp):
        shapes = vllm_param_shapes(dims, VllmParallel(tp=tp), tp_rank=rank)
        dtypes = vllm_param_dtypes(shapes, "bfloat16", architecture=dims.architecture)
        assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32
        assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
        assert dtypes["model.layers.1.self_attn.qkv_proj.bias"] == torch.bfloat16
        params = {n: torch.full(s, float("nan"), dtype=dtypes[n]) for n, s in shapes.items()}
        shards = LocalShards.from_layout(layout, rank, vllm_views(params, dims, VllmParallel(tp=tp), tp_rank=rank))
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        a = "model.layers.1.self_attn."
        q, k = dims.heads // tp * dims.head_dim, dims.kv_heads // tp * dims.head_dim
        want = torch.cat(
            [
                full[a + "q_proj.bias"][rank * q : (rank + 1) * q],
                full[a + "k_proj.bias"][rank * k : (rank + 1) * k],
                full[a + "v_proj.bias"][rank * k : (rank + 1) * k],
            ]
        )
        assert torch.equal(params[a + "qkv_proj.bias"], want)
        assert torch.equal(params[a + "q_norm.weight"], full[a + "q_norm.weight"])
        gate = "model.layers.1.mlp.gate.weight"
        assert torch.equal(params[gate], full[gate])
        nan = [n for n, p in params.items() if p.is_floating_point() and torch.isnan(p).any()]
        assert set(nan) <= {"model.embed_tokens.weight", "lm_head.weight"}, nan  # only the vocabulary padding


def test_deepseek_v3_views_cover_every_box_of_every_tp_rank():
    """vLLM's DeepSeek-V3 parameters (fused_qkv_a_proj, heads-split q_b/kv_b_proj, shared_experts, FP32 score
    bias) tile exactly the boxes the vLLM layout gives each TP rank, and a canonical tensor written through the
    views reads back whole (the live engine's names and shapes are checked when the awex backend starts, in
    integration/tests/test_deepseek_glm_vllm.py)."""
    models = Path(__file__).resolve().parents[3] / "integration" / "models"
    dims = model_dims(json.loads((models / "deepseek-v3-tiny.json").read_text()), "float32")
    tensors = canonical_tensors(dims)
    tp = 2
    layout = vllm_layout(tensors, VllmParallel(tp=tp), "v")
    g = torch.Generator().manual_seed(0)
    full = {t.name: torch.randn(t.spec.shape, generator=g).to(getattr(torch, t.spec.dtype)) for t in tensors}
    for rank in range(tp):
        shapes = vllm_param_shapes(dims, VllmParallel(tp=tp), tp_rank=rank)
        dtypes = vllm_param_dtypes(shapes, "float32")
        params = {n: torch.full(s, float("nan"), dtype=dtypes[n]) for n, s in shapes.items()}
        assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        shards = LocalShards.from_layout(layout, rank, vllm_views(params, dims, VllmParallel(tp=tp), tp_rank=rank))
        for name in shards.names():
            for box, view in shards.pairs(name):
                view.copy_(full[name][box.slices()])
        pre = "model.layers.1."
        a = pre + "self_attn."
        want = torch.cat([full[a + "q_a_proj.weight"], full[a + "kv_a_proj_with_mqa.weight"]])
        assert torch.equal(params[a + "fused_qkv_a_proj.weight"], want)  # vLLM's [q_a; kv_a], whole on every rank
        rows = dims.heads // tp * (dims.qk_nope_dim + dims.v_head_dim)
        assert torch.equal(
            params[a + "kv_b_proj.weight"], full[a + "kv_b_proj.weight"][rank * rows : (rank + 1) * rows]
        )
        half = dims.shared_expert_intermediate // tp
        gate, up = (
            full[pre + f"mlp.shared_experts.{p}_proj.weight"][rank * half : (rank + 1) * half] for p in ("gate", "up")
        )
        assert torch.equal(params[pre + "mlp.shared_experts.gate_up_proj.weight"], torch.cat([gate, up]))
        bias = pre + "mlp.gate.e_score_correction_bias"
        assert torch.equal(params[bias], full[bias])
        nan = [n for n, p in params.items() if p.is_floating_point() and torch.isnan(p).any()]
        assert set(nan) <= {"model.embed_tokens.weight", "lm_head.weight"}, nan  # only the vocabulary padding
