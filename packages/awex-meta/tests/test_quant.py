"""FP8 block quantisation in layouts: which tensors are quantised, where scales live, sender tile checks."""

import pytest
from conftest import MODELS
from oracle import check_plan_by_elements

from awex.meta import (
    Box,
    ExplicitSharding,
    Fp8BlockQuant,
    PlanError,
    canonical_tensors,
    load_config,
    plan_transfers,
    quantize_layout,
    sender_quant,
    verify_plan,
)
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.quant import scale_name

Q8B = canonical_tensors(load_config(MODELS / "qwen3-8b.json"))
QUANT = Fp8BlockQuant()


def small_moe(layers=1, experts=4):
    return canonical_tensors(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "num_hidden_layers": layers,
            "vocab_size": 512,
            "moe_intermediate_size": 256,
            "num_experts": experts,
            "intermediate_size": 512,
            "tie_word_embeddings": False,
        },
        dtype="bfloat16",
    )


def test_from_hf_config():
    cfg = {
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"],
        }
    }
    q = Fp8BlockQuant.from_hf_config(cfg)
    assert q == Fp8BlockQuant(block=(128, 128), dtype="float8_e4m3fn", skip=("lm_head",))
    assert Fp8BlockQuant.from_hf_config({}) is None
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8BlockQuant.from_hf_config({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="awq"):
        Fp8BlockQuant.from_hf_config({"quantization_config": {"quant_method": "awq"}})


def test_which_tensors_are_quantised():
    moe = {t.name: t.spec.shape for t in small_moe()}
    quantised = {n for n, shape in moe.items() if QUANT.quantises(n, shape)}
    # attention and every expert's projections; never the router, norms, embedding or LM head
    assert "model.layers.0.self_attn.q_proj.weight" in quantised
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in quantised
    for kept in (
        "model.layers.0.mlp.gate.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert kept in moe and kept not in quantised
    skipping = Fp8BlockQuant(skip=("model.layers.0.self_attn", "experts.3"))
    assert not skipping.quantises("model.layers.0.self_attn.q_proj.weight", (256, 256))
    assert not skipping.quantises("model.layers.0.mlp.experts.3.up_proj.weight", (256, 256))
    assert skipping.quantises("model.layers.0.mlp.experts.13.up_proj.weight", (256, 256))


def test_vllm_tp2_scales_follow_the_weight_tiles():
    lay = quantize_layout(vllm_layout(Q8B, VllmParallel(tp=2)), QUANT)
    q = lay.tensor("model.layers.0.self_attn.q_proj.weight")
    s = lay.tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
    assert q.spec.dtype == "float8_e4m3fn" and q.spec.shape == (4096, 4096)
    assert s.spec.dtype == "float32" and s.spec.shape == (32, 32)
    assert not isinstance(s.sharding, ExplicitSharding)  # aligned: the weight's placements, in tiles
    for rank in (0, 1):
        (wbox,) = lay.rank_boxes(rank)["model.layers.0.self_attn.q_proj.weight"]
        (sbox,) = lay.rank_boxes(rank)["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        assert sbox == QUANT.block_image(wbox) == Box((16 * rank, 0), (16, 32))
    # o_proj splits columns: scale columns split the same way
    (sbox,) = lay.rank_boxes(1)["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert sbox == Box((0, 16), (32, 16))
    assert lay.tensor("model.embed_tokens.weight").spec.dtype == "bfloat16"
    assert "lm_head.weight_scale_inv" not in lay


def test_receiver_with_tiles_cut_gets_shared_tiles_explicitly():
    # a receiver whose boxes cut tiles still gets every tile that scales its rows (neighbours share it)
    tensors = canonical_tensors(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_hidden_layers": 1,
            "vocab_size": 512,
            "intermediate_size": 512,
        }
    )
    lay = quantize_layout(vllm_layout(tensors, VllmParallel(tp=8)), QUANT, sender=False)
    name = "model.layers.0.self_attn.q_proj.weight"  # 512 rows / 8 = 64 rows per rank: half a tile
    for rank in range(8):
        (wbox,) = lay.rank_boxes(rank)[name]
        (sbox,) = lay.rank_boxes(rank)[name + "_scale_inv"]
        assert sbox == QUANT.block_image(wbox) == Box((rank // 2, 0), (1, 2))
    assert isinstance(lay.tensor(name + "_scale_inv").sharding, ExplicitSharding)


def test_sender_must_hold_whole_tiles():
    dense = canonical_tensors(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "num_hidden_layers": 1,
            "vocab_size": 512,
            "intermediate_size": 384,
        }
    )
    with pytest.raises(
        ValueError,
        match=r"mlp.gate_proj.weight: rank 0 holds \[0:192, 0:256\] of \(384, 256\), "
        r"which cuts through 128x128 FP8 tiles",
    ):
        quantize_layout(megatron_layout(dense, MegatronParallel(tp=2, vocab_pad=1)), QUANT)
    # TP=2 cuts Qwen3-8B's tensors into whole tiles; the same layout as a receiver is fine either way
    quantize_layout(megatron_layout(Q8B, MegatronParallel(tp=2)), QUANT)
    quantize_layout(megatron_layout(dense, MegatronParallel(tp=2, vocab_pad=1)), QUANT, sender=False)


@pytest.mark.parametrize(
    "train,infer",
    [
        (MegatronParallel(tp=2, vocab_pad=1), VllmParallel(tp=1)),
        (MegatronParallel(dp=2, ep=2, vocab_pad=1), VllmParallel(tp=2)),
        (MegatronParallel(tp=2, vocab_pad=1), VllmParallel(tp=4)),
    ],
)
def test_plan_moves_fp8_weights_and_scales(train, infer):
    tensors = small_moe(experts=4)
    src = quantize_layout(megatron_layout(tensors, train), QUANT)
    dst = quantize_layout(vllm_layout(tensors, infer, instance="vllm"), QUANT)
    plan = plan_transfers([src], [dst])
    assert verify_plan(plan, [src], [dst]).ok
    check_plan_by_elements(plan, [src], [dst])
    moved = {t.name: t.dtype for t in plan.tensors}
    assert moved["model.layers.0.mlp.experts.2.up_proj.weight"] == "float8_e4m3fn"
    assert moved["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"] == "float32"
    assert moved["model.layers.0.mlp.gate.weight"] == "bfloat16"
    assert not plan.casts


def test_unquantised_sender_to_fp8_receiver_is_refused_with_a_hint():
    tensors = small_moe()
    src = megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1))
    dst = quantize_layout(vllm_layout(tensors, VllmParallel(tp=1), instance="vllm"), QUANT)
    with pytest.raises(PlanError) as err:
        plan_transfers([src], [dst])
    text = str(err.value)
    assert "weight_scale_inv: needed by the destination but held by no source (the destination loads FP8" in text
    assert "quantise on the sender" in text and "quantize_on_receive='auto' picks who quantises" in text
    # allow_cast cannot turn a plain cast into block quantisation
    from awex.meta import PlanOptions

    with pytest.raises(PlanError, match="a cast from bfloat16 cannot produce that"):
        plan_transfers([src], [dst], PlanOptions(allow_cast=("*",)))


@pytest.mark.parametrize(
    "train,infer",
    [
        (MegatronParallel(tp=2, vocab_pad=1), VllmParallel(tp=1)),
        (MegatronParallel(dp=2, ep=2, vocab_pad=1), VllmParallel(tp=2)),
    ],
)
def test_receivers_can_quantise_what_an_unquantised_sender_holds(train, infer):
    """PlanOptions(quantize_on_receive=True): quantised weights travel in the sender's dtype, their scales not at
    all (the receivers compute them); every other tensor as before; the plan says which weights and scales."""
    from awex.meta import PlanOptions

    tensors = small_moe(experts=4)
    src = megatron_layout(tensors, train)
    dst = quantize_layout(vllm_layout(tensors, infer, instance="vllm"), QUANT)
    plan = plan_transfers([src], [dst], PlanOptions(quantize_on_receive=True))
    assert verify_plan(plan, [src], [dst]).ok
    moved = {t.name: t.dtype for t in plan.tensors}
    up = "model.layers.0.mlp.experts.2.up_proj.weight"
    assert moved[up] == "bfloat16" and scale_name(up) not in moved
    assert (up, "float8_e4m3fn", scale_name(up), (128, 128)) in plan.quantized
    assert moved["model.layers.0.mlp.gate.weight"] == "bfloat16"
    quantised = {q[0] for q in plan.quantized}
    assert quantised == {n for n in dst.names if scale_name(n) in dst.names}
    dense = plan_transfers([src], [vllm_layout(tensors, infer, instance="vllm")])
    assert plan.stats.total_bytes == dense.stats.total_bytes  # what moves: the bf16 weights, nothing more
    assert plan.digest != dense.digest  # both ends must agree on who quantises


def test_vllm_engine_layout_reads_fp8_from_the_config():
    from awex.meta.layouts import vllm_engine_layout

    cfg = {
        **load_config(MODELS / "qwen3-8b.json"),
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    lay = vllm_engine_layout(cfg, "bfloat16", VllmParallel(tp=2), instance="vllm-0")
    assert lay.tensor("model.layers.3.mlp.down_proj.weight").spec.dtype == "float8_e4m3fn"
    assert lay.tensor("model.layers.3.mlp.down_proj.weight_scale_inv").spec.shape == (32, 96)
    assert lay.tensor("lm_head.weight").spec.dtype == "bfloat16"
    plain = vllm_engine_layout(load_config(MODELS / "qwen3-8b.json"), "bfloat16", VllmParallel(tp=2))
    assert "model.layers.3.mlp.down_proj.weight_scale_inv" not in plain
    with pytest.raises(ValueError, match="awq"):
        vllm_engine_layout({**cfg, "quantization_config": {"quant_method": "awq"}}, "bfloat16", VllmParallel())


def test_tile_edges_are_found_from_sizes_and_tile_counts():
    from awex.meta.quant import tile_block

    assert tile_block(4096, 32) == 128
    assert tile_block(4097, 33) == 128
    assert tile_block(100, 1) == 128  # one tile: any edge of at least 100 alike; the smallest power of two
    assert tile_block(300, 3) == 128
    with pytest.raises(ValueError):
        tile_block(300, 4)


def test_weights_quantised_on_receive_are_cut_into_waves_on_tile_rows_only():
    from awex.meta import PlanOptions

    src = megatron_layout(Q8B, MegatronParallel(tp=2))
    dst = quantize_layout(vllm_layout(Q8B, VllmParallel(tp=1), instance="vllm"), QUANT)
    plan = plan_transfers([src], [dst], PlanOptions(quantize_on_receive=True, wave_bytes=64 << 20))
    assert plan.stats.waves > 10  # small waves: most weights are cut
    rows = {plan.tensors.index(next(t for t in plan.tensors if t.name == q[0])): q[3][0] for q in plan.quantized}
    cut = 0
    for b in plan.buckets:
        for t in b.transfers:
            if t.tensor in rows:
                full = plan.tensors[t.tensor].shape[0]
                assert t.offsets[0] % rows[t.tensor] == 0, (plan.tensors[t.tensor].name, t.region)
                assert t.sizes[0] % rows[t.tensor] == 0 or t.offsets[0] + t.sizes[0] == full, t.region
                cut += t.sizes[0] != full
    assert cut > 0
    assert verify_plan(plan, [src], [dst]).ok


def test_a_sender_quantises_exactly_what_its_receivers_hold_in_fp8():
    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    trainer = megatron_layout(tensors, MegatronParallel(tp=2), instance="trainer")
    skip = Fp8BlockQuant(block=(32, 32), skip=("layers.0.mlp",))  # as a config's modules_to_not_convert
    engine = quantize_layout(vllm_layout(tensors, VllmParallel(tp=2), instance="vllm"), skip)
    quant = sender_quant([trainer], [engine])
    held = {t.spec.name for t in engine.tensors if t.spec.dtype == "float8_e4m3fn"}
    assert quant.names == held and not any(".layers.0.mlp." in n for n in held) and quant.block == (32, 32)
    assert not quant.quantises("model.layers.0.mlp.down_proj.weight", (128, 256))  # by its name alone it would
    sent = quantize_layout(trainer, quant)
    plan = plan_transfers([sent], [engine])  # the sender's tiles and scales are the receivers', shape for shape
    assert not plan.quantized and {s.name for s in plan.tensors if s.dtype == "float8_e4m3fn"} == held
    assert sender_quant([trainer], [vllm_layout(tensors, VllmParallel(tp=2), instance="bf16")]) is None


def test_receivers_in_two_fp8_dtypes_cannot_share_one_senders_tiles():
    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    trainer = megatron_layout(tensors, MegatronParallel(tp=1), instance="trainer")
    e4m3 = quantize_layout(vllm_layout(tensors, VllmParallel(tp=1), instance="a"), Fp8BlockQuant(block=(32, 32)))
    e5m2 = quantize_layout(
        vllm_layout(tensors, VllmParallel(tp=1), instance="b"), Fp8BlockQuant(block=(32, 32), dtype="float8_e5m2")
    )
    with pytest.raises(ValueError, match=r"as \['float8_e4m3fn', 'float8_e5m2'\]: a sender quantises to one dtype"):
        sender_quant([trainer], [e4m3, e5m2])
