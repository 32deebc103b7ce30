"""awex.meta.layouts.sglang: SGLang's rank numbering, pipeline split, expert placement and refusals.

Where each element lands is checked against SGLang's own model classes and loaders by the ``sglang_layout`` nox
session (``integration/awex_integration/checks/sglang_layout_check.py``); these tests pin the arithmetic and the
errors."""

from __future__ import annotations

import pytest

from awex.meta import canonical_tensors
from awex.meta.layouts import SglangParallel, layouts_for, parse_engine_spec, sglang_layout
from awex.meta.layouts.sglang import expert_owner, pp_layer_ranges
from awex.meta.models import model_dims

QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    tie_word_embeddings=False,
)
LLAMA = dict(QWEN3_MOE, architectures=["LlamaForCausalLM"], model_type="llama")
for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok"):
    LLAMA.pop(key)


def test_ranks_follow_sglangs_spawn_order():
    p = SglangParallel(tp=8, pp=2, ep=2, attn_dp=2, moe_dp=2)
    # rank = tp * pp_rank + tp_rank; attention TP and MoE TP fastest (sglang derive_spawn_ranks)
    assert p.ranks(13) == {"pp": 1, "tp": 5, "attn_dp": 1, "attn_tp": 1, "moe_dp": 1, "moe_ep": 0, "moe_tp": 1}
    assert p.attn_tp == 4 and p.moe_tp == 2 and p.world_size == 16
    with pytest.raises(ValueError, match="outside"):
        p.ranks(16)


def test_extra_layers_go_to_the_last_stages_unlike_vllm():
    assert pp_layer_ranges(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert [b - a for a, b in pp_layer_ranges(8, 3)] == [2, 3, 3]
    assert pp_layer_ranges(5, 2, partition=(1, 4)) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="pp_layers"):
        pp_layer_ranges(5, 2, partition=(1, 3))


def test_experts_live_in_contiguous_blocks():
    assert [expert_owner(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="experts must divide by ep"):
        expert_owner(0, 6, 4)


def test_moe_layout_with_dp_attention_places_every_tensor_once_per_replica():
    tensors = canonical_tensors(QWEN3_MOE)
    p = SglangParallel(tp=4, ep=2, attn_dp=2)
    layout = sglang_layout(tensors, p, "Qwen3MoeForCausalLM")
    # attention split over the 2 attention-TP ranks, replicated over the 2 attention-DP groups
    boxes = {rank: layout.rank_boxes(rank)["model.layers.0.self_attn.q_proj.weight"] for rank in range(4)}
    assert boxes[0] == boxes[2] and boxes[1] == boxes[3] and boxes[0] != boxes[1]
    # expert 5 on EP rank 1 (ranks 2, 3), split over MoE TP
    holders = [r for r in range(4) if "model.layers.1.mlp.experts.5.down_proj.weight" in layout.rank_boxes(r)]
    assert holders == [2, 3]


def test_refusals_name_what_is_not_mapped():
    with pytest.raises(ValueError, match="DP attention .* not mapped for LlamaForCausalLM"):
        sglang_layout(canonical_tensors(LLAMA), SglangParallel(tp=4, attn_dp=2), "LlamaForCausalLM")
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM is not mapped for SGLang"):
        sglang_layout(canonical_tensors(LLAMA), SglangParallel(tp=2), "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="dp_lm_head needs DP attention"):
        SglangParallel(tp=2, dp_lm_head=True)
    with pytest.raises(ValueError, match="tp must divide by ep"):
        SglangParallel(tp=4, ep=3)


def test_engine_spec_strings():
    spec = parse_engine_spec("sglang:tp=4,ep=2,attn_dp=2,dp_lm_head=1,instances=2")
    layouts = layouts_for(
        spec, canonical_tensors(QWEN3_MOE), "inference", architecture=model_dims(QWEN3_MOE).architecture
    )
    assert [x.instance for x in layouts] == ["sglang-0", "sglang-1"] and layouts[0].world_size == 4
    with pytest.raises(ValueError, match="unknown option"):
        parse_engine_spec("sglang:dp=2")
