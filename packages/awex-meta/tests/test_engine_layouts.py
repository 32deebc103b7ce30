"""Megatron-core and vLLM layout arithmetic.

Expected per-rank shapes come from the real engines' named_parameters on the tiny Qwen2 model (hidden 128,
4 heads x 32, 2 KV heads, intermediate 256, vocab 1000), recorded in shared/notes/cpu-engines.md; awex-convert's
tests check the same against the running engines.
"""

import pytest
from conftest import MODELS

from awex.meta import Box, canonical_tensors, load_config
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.layouts.megatron import pipeline_stages
from awex.meta.layouts.spec import layouts_for, parse_engine_spec
from awex.meta.layouts.vllm import expert_owner, pp_layer_ranges

TINY = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))


def rows(layout, rank, name):
    return [(b.offsets[0], b.sizes[0]) for b in layout.rank_boxes(rank)[name]]


def test_megatron_tp2_matches_gptmodel_parameters():
    lay = megatron_layout(TINY, MegatronParallel(tp=2, vocab_pad=1))
    # linear_qkv (128,128) per rank = q 64 + k 32 + v 32 rows
    for rank in (0, 1):
        boxes = lay.rank_boxes(rank)
        qkv = sum(boxes[f"model.layers.0.self_attn.{p}_proj.weight"][0].sizes[0] for p in "qkv")
        assert qkv == 128
        assert boxes["model.layers.0.self_attn.o_proj.weight"][0].sizes == (128, 64)  # linear_proj (128,64)
        assert boxes["model.layers.0.mlp.down_proj.weight"][0].sizes == (128, 128)  # linear_fc2 (128,128)
        fc1 = sum(boxes[f"model.layers.0.mlp.{p}_proj.weight"][0].sizes[0] for p in ("gate", "up"))
        assert fc1 == 256  # linear_fc1 (256,128) = [gate_shard; up_shard]
    assert rows(lay, 0, "model.embed_tokens.weight") == [(0, 500)]  # GPTModel(vocab_size=1000): (500,128)
    assert rows(lay, 1, "model.layers.1.self_attn.k_proj.weight") == [(32, 32)]


def test_megatron_vocab_padding_and_pipeline_stages():
    lay = megatron_layout(TINY, MegatronParallel(tp=2, pp=2))
    # 1000 padded to a multiple of 128*2 = 1024 -> blocks of 512 rows; rank 1 holds 488 real rows
    assert rows(lay, 0, "model.embed_tokens.weight") == [(0, 512)]
    assert rows(lay, 1, "model.embed_tokens.weight") == [(512, 488)]
    # ranks 0,1 are stage 0 (layer 0, embedding), ranks 2,3 stage 1 (layer 1, final norm, output layer)
    assert "model.layers.0.input_layernorm.weight" in lay.rank_boxes(0)
    assert "model.layers.1.input_layernorm.weight" not in lay.rank_boxes(0)
    assert set(lay.rank_boxes(2)) >= {"model.norm.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"}
    assert "model.embed_tokens.weight" not in lay.rank_boxes(2)


def test_megatron_tied_embeddings_live_on_first_and_last_stage():
    tied = canonical_tensors({**load_config(MODELS / "qwen2-tiny.json"), "tie_word_embeddings": True})
    lay = megatron_layout(tied, MegatronParallel(pp=2))
    assert "model.embed_tokens.weight" in lay.rank_boxes(0) and "model.embed_tokens.weight" in lay.rank_boxes(1)


def test_megatron_stage_rules():
    assert [pipeline_stages(8, MegatronParallel(pp=2, vpp=2))(L) for L in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    uneven = pipeline_stages(94, MegatronParallel(pp=8, first=11, last=11))
    assert [sum(1 for L in range(94) if uneven(L) == s) for s in range(8)] == [11] + [12] * 6 + [11]
    with pytest.raises(ValueError, match="first=11,last=11"):
        pipeline_stages(94, MegatronParallel(pp=8))


def test_megatron_expert_grid():
    cfg = load_config(MODELS / "qwen3-235b-a22b.json")
    cfg.update(num_hidden_layers=2, num_experts=8)
    tensors = canonical_tensors(cfg)
    lay = megatron_layout(tensors, MegatronParallel(tp=2, dp=2, ep=4, etp=1))
    # expert grid (pp, edp, ep, etp) = (1, 1, 4, 1): expert e on rank e // 2; dense grid tp is fastest
    for e in range(8):
        holders = [r for r in range(4) if f"model.layers.0.mlp.experts.{e}.up_proj.weight" in lay.rank_boxes(r)]
        assert holders == [e // 2]
    with pytest.raises(ValueError, match="etp\\*ep"):
        megatron_layout(tensors, MegatronParallel(tp=2, dp=1, ep=4, etp=1))


def test_vllm_tp2_matches_engine_parameters():
    lay = vllm_layout(TINY, VllmParallel(tp=2))
    # embed_tokens / lm_head: [512,128] per rank (vocab padded to 1024)
    assert rows(lay, 0, "model.embed_tokens.weight") == [(0, 512)]
    assert rows(lay, 1, "lm_head.weight") == [(512, 488)]
    for rank in (0, 1):
        boxes = lay.rank_boxes(rank)
        assert sum(boxes[f"model.layers.0.self_attn.{p}_proj.weight"][0].sizes[0] for p in "qkv") == 128
        assert boxes["model.layers.0.self_attn.o_proj.weight"][0].sizes == (128, 64)


def test_vllm_replicates_kv_heads_when_tp_exceeds_them():
    lay = vllm_layout(TINY, VllmParallel(tp=4))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [rows(lay, r, k) for r in range(4)] == [[(0, 32)], [(0, 32)], [(32, 32)], [(32, 32)]]
    assert [rows(lay, r, "model.layers.0.self_attn.q_proj.weight") for r in range(4)] == [
        [(32 * r, 32)] for r in range(4)
    ]


def test_vllm_pipeline_split_and_expert_placement():
    assert pp_layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert pp_layer_ranges(8, 2) == [(0, 4), (4, 8)]
    assert [expert_owner(e, 10, 4) for e in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    cfg = load_config(MODELS / "qwen3-235b-a22b.json")
    cfg.update(num_hidden_layers=1, num_experts=8)
    tensors = canonical_tensors(cfg)
    ep = vllm_layout(tensors, VllmParallel(tp=2, dp=2, ep=True))  # 4 EP ranks: rank = dp*2 + tp
    holders = [r for r in range(4) if "model.layers.0.mlp.experts.5.gate_proj.weight" in ep.rank_boxes(r)]
    assert holders == [2]
    assert ep.rank_boxes(2)["model.layers.0.mlp.experts.5.gate_proj.weight"] == (Box((0, 0), (1536, 4096)),)
    no_ep = vllm_layout(tensors, VllmParallel(tp=2))
    assert no_ep.rank_boxes(1)["model.layers.0.mlp.experts.5.down_proj.weight"] == (Box((0, 768), (4096, 768)),)


def test_engine_spec_parsing_errors_are_clear():
    assert parse_engine_spec("megatron:tp=4,pp=8,ep=8,dp=4").options == {"tp": 4, "pp": 8, "ep": 8, "dp": 4}
    assert parse_engine_spec("vllm:tp=8,ep=8,instances=16").instances == 16
    for bad, msg in [
        ("trt:tp=1", "unknown engine"),
        ("vllm:tp", "key=value"),
        ("vllm:tp=x", "integer"),
        ("vllm:zz=1", "unknown option"),
        ("megatron:instances=2", "one instance"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_engine_spec(bad)
    moe = canonical_tensors(load_config(MODELS / "qwen3-moe-tiny.json"))
    with pytest.raises(ValueError, match="must be 1 or dp\\*tp"):
        layouts_for(parse_engine_spec("vllm:tp=2,ep=4"), moe, "inference")
    with pytest.raises(ValueError, match="ep=2 splits experts, and this model has none"):
        layouts_for(parse_engine_spec("vllm:tp=2,ep=2"), TINY, "inference")
    with pytest.raises(ValueError, match="etp=2 splits experts"):
        layouts_for(parse_engine_spec("megatron:tp=2,etp=2"), TINY, "trainer")
    with pytest.raises(ValueError, match="tp given twice"):
        parse_engine_spec("vllm:tp=2,tp=4")
    names = [lay.instance for lay in layouts_for(parse_engine_spec("vllm:tp=1,instances=12"), TINY, "inference")]
    assert names[0] == "vllm-00" and names[-1] == "vllm-11"


def test_vllm_holds_glm_45_routers_in_float32_and_other_models_as_given():
    """vLLM builds GLM-4.5's router (GateLinear) with float32 parameters: its engine layout says so (a bf16
    trainer's router then widens exactly); DeepSeek-V3's router stays in the model's dtype (its score bias is
    float32 in every engine)."""
    from awex.meta.layouts.vllm import vllm_engine_layout, vllm_tensors

    glm = load_config(MODELS / "glm4-moe-tiny.json")
    dtypes = {t.name: t.spec.dtype for t in vllm_tensors(glm, "bfloat16")}
    assert dtypes["model.layers.1.mlp.gate.weight"] == "float32"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == "bfloat16"
    assert sum(d == "float32" for d in dtypes.values()) == 2  # one MoE layer: its router and score bias
    layout = vllm_engine_layout(glm, "bfloat16", VllmParallel(tp=2))
    assert layout.tensor("model.layers.1.mlp.gate.weight").spec.dtype == "float32"
    deepseek = load_config(MODELS / "deepseek-v3-tiny.json")
    assert {t.name: t.spec.dtype for t in vllm_tensors(deepseek, "bfloat16")} == {
        t.name: t.spec.dtype for t in canonical_tensors(deepseek, dtype="bfloat16")
    }
