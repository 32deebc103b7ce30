import json

import pytest
from conftest import MODELS

from awex.meta import UnknownModelError, canonical_tensors, load_config
from awex.meta.models import model_dims


def test_qwen3_8b_matches_the_hf_state_dict_size():
    # 399 tensors and 16,381,470,720 bytes: measured from a Qwen3-8B-shaped HF state dict on the GPU machines
    tensors = canonical_tensors(load_config(MODELS / "qwen3-8b.json"))
    assert len(tensors) == 399
    assert sum(t.spec.nbytes for t in tensors) == 16_381_470_720
    names = {t.name for t in tensors}
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert "model.layers.0.self_attn.q_proj.bias" not in names


def test_qwen2_has_qkv_bias_and_tied_embeddings_drop_lm_head():
    cfg = load_config(MODELS / "qwen2-tiny.json")
    tensors = {t.name: t for t in canonical_tensors(cfg)}
    assert len(tensors) == 27  # 3 + 2 layers x 12
    assert tensors["model.layers.1.self_attn.k_proj.bias"].spec.shape == (64,)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].kind == "kv"
    assert tensors["lm_head.weight"].spec.dtype == "float32"
    tied = canonical_tensors({**cfg, "tie_word_embeddings": True})
    assert "lm_head.weight" not in {t.name for t in tied}


def test_qwen3_moe_experts_and_router():
    tensors = canonical_tensors(load_config(MODELS / "qwen3-235b-a22b.json"))
    by = {t.name: t for t in tensors}
    assert len(tensors) == 3 + 94 * (4 + 2 + 2 + 1 + 128 * 3)
    e = by["model.layers.93.mlp.experts.127.down_proj.weight"]
    assert (e.kind, e.layer, e.expert, e.spec.shape) == ("expert_row", 93, 127, (4096, 1536))
    assert by["model.layers.0.mlp.gate.weight"].kind == "router"
    assert "model.layers.0.mlp.gate_proj.weight" not in by


def test_mlp_only_layers_and_sparse_step():
    cfg = load_config(MODELS / "qwen3-235b-a22b.json")
    cfg.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=2)
    names = {t.name for t in canonical_tensors(cfg)}
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names  # (0+1) % 2 != 0: dense
    assert "model.layers.3.mlp.up_proj.weight" in names  # listed in mlp_only_layers


def test_unknown_architecture_and_missing_fields(tmp_path):
    with pytest.raises(UnknownModelError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        canonical_tensors({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        model_dims(
            {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 1, "num_hidden_layers": 1}
        )
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert load_config(tmp_path)["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope")


def test_dtype_override_and_aliases():
    cfg = load_config(MODELS / "qwen2-tiny.json")
    assert {t.spec.dtype for t in canonical_tensors(cfg, dtype="bf16")} == {"bfloat16"}
    assert {t.spec.dtype for t in canonical_tensors({**cfg, "torch_dtype": None, "dtype": "float16"})} == {"float16"}


def test_a_tensor_of_an_unknown_kind_is_refused():
    from awex.meta import TensorSpec
    from awex.meta.models import CanonicalTensor

    with pytest.raises(ValueError, match="unknown tensor kind 'colum'"):  # a typo in a model table
        CanonicalTensor(TensorSpec("w", (4, 4), "float32"), "colum")


def _total(tensors) -> int:
    from math import prod

    return sum(prod(t.spec.shape) for t in tensors)


def test_deepseek_v3_kimi_k2_and_glm_45_tables_add_up_to_their_published_sizes():
    """DeepSeek-V3: 671B parameters in the main model (the published figure; its MTP layer is apart); Kimi-K2 (the
    same architecture, 384 experts): about 1.03T; GLM-4.5: 355B with its MTP layer, about 353B without."""
    ds = canonical_tensors(load_config(MODELS / "deepseek-v3.json"))
    assert abs(_total(ds) - 671.0e9) < 0.002 * 671.0e9, _total(ds)
    kimi = canonical_tensors(load_config(MODELS / "kimi-k2.json"))
    assert 1.00e12 < _total(kimi) < 1.05e12, _total(kimi)
    glm = canonical_tensors(load_config(MODELS / "glm-4.5.json"))
    assert 348e9 < _total(glm) < 356e9, _total(glm)


def test_deepseek_v3_latent_attention_dense_first_layers_experts_and_an_fp32_router_bias():
    from awex.meta.models import unsynced_layers

    config = load_config(MODELS / "deepseek-v3.json")
    tensors = {t.name: t for t in canonical_tensors(config, dtype="bfloat16")}
    layer = "model.layers.3."  # the first MoE layer (first_k_dense_replace = 3)
    q_b = tensors[layer + "self_attn.q_b_proj.weight"]
    assert q_b.spec.shape == (128 * (128 + 64), 1536) and q_b.kind == "q" and q_b.heads == 128
    assert tensors[layer + "self_attn.kv_a_proj_with_mqa.weight"].spec.shape == (512 + 64, 7168)
    assert tensors[layer + "self_attn.kv_b_proj.weight"].spec.shape == (128 * (128 + 128), 512)
    assert tensors[layer + "self_attn.o_proj.weight"].spec.shape == (7168, 128 * 128)
    assert tensors[layer + "self_attn.q_a_layernorm.weight"].kind == "replicated"
    assert not any(n.startswith(layer + "self_attn.") and n.split(".")[-2] in ("q_proj", "k_proj") for n in tensors)
    bias = tensors[layer + "mlp.gate.e_score_correction_bias"]
    assert bias.spec.dtype == "float32" and bias.kind == "router" and bias.spec.shape == (256,)
    assert tensors[layer + "mlp.gate.weight"].spec.dtype == "bfloat16"
    assert tensors[layer + "mlp.experts.255.down_proj.weight"].spec.shape == (7168, 2048)
    assert tensors[layer + "mlp.shared_experts.up_proj.weight"].spec.shape == (2048, 7168)
    assert "model.layers.2.mlp.gate_proj.weight" in tensors and "model.layers.2.mlp.gate.weight" not in tensors
    assert not any(n.startswith("model.layers.61.") for n in tensors)  # the MTP layer: not synced, named
    assert unsynced_layers(config) == ["model.layers.61."]
    assert unsynced_layers(load_config(MODELS / "kimi-k2.json")) == []


def test_glm_45_has_qk_norms_biases_and_deepseek_style_experts():
    tensors = {t.name: t for t in canonical_tensors(load_config(MODELS / "glm-4.5.json"))}
    layer = "model.layers.3."
    assert tensors[layer + "self_attn.k_proj.weight"].spec.shape == (8 * 128, 5120)
    assert tensors[layer + "self_attn.q_proj.bias"].kind == "q" and layer + "self_attn.q_norm.weight" in tensors
    assert tensors[layer + "mlp.gate.e_score_correction_bias"].spec.dtype == "float32"
    assert tensors[layer + "mlp.shared_experts.down_proj.weight"].spec.shape == (5120, 1536)


def test_megatron_and_vllm_layouts_place_latent_attention_and_deepseek_experts():
    """The planner's layouts place DeepSeek-V3's MLA by heads (up-projections), duplicate its down-projections and
    norms, split shared experts like a dense MLP and keep the FP32 score bias whole on every rank."""
    from awex.meta.box import Box
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = canonical_tensors(load_config(MODELS / "deepseek-v3-tiny.json"))
    by_name = {t.name: t for t in tensors}
    layer = next(t.layer for t in tensors if t.name.endswith("e_score_correction_bias"))
    pre = f"model.layers.{layer}."
    for layout in (megatron_layout(tensors, MegatronParallel(tp=2, ep=2)), vllm_layout(tensors, VllmParallel(tp=2))):

        def boxes(name, rank):
            return [box for box, ranks in layout.holdings(name) if rank in ranks]

        up = pre + "self_attn.kv_b_proj.weight"
        rows = by_name[up].spec.shape[0]
        assert boxes(up, 1) == [Box((rows // 2, 0), (rows // 2, by_name[up].spec.shape[1]))]
        for whole in (
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight",
            "mlp.gate.e_score_correction_bias",
        ):
            shape = by_name[pre + whole].spec.shape
            assert boxes(pre + whole, 0) == boxes(pre + whole, 1) == [Box((0,) * len(shape), shape)]
        shared = pre + "mlp.shared_experts.down_proj.weight"
        h, w = by_name[shared].spec.shape
        assert boxes(shared, 1) == [Box((0, w // 2), (h, w // 2))]
    split = megatron_layout(tensors, MegatronParallel(tp=2, ep=2, latent_down_split=True))  # Megatron's local spec
    down = pre + "self_attn.kv_a_proj_with_mqa.weight"
    rows, cols = by_name[down].spec.shape
    assert [b for b, r in split.holdings(down) if 1 in r] == [Box((rows // 2, 0), (rows // 2, cols))]
    heads = by_name[pre + "self_attn.kv_b_proj.weight"].heads
    with pytest.raises(ValueError, match="heads must divide by tp"):
        megatron_layout(tensors, MegatronParallel(tp=heads * 2, dp=1, ep=1))


def test_a_config_without_architectures_is_read_by_its_model_type():
    cfg = load_config(MODELS / "qwen2-tiny.json")
    by_type = {k: v for k, v in cfg.items() if k != "architectures"}
    assert [t.spec for t in canonical_tensors(by_type)] == [t.spec for t in canonical_tensors(cfg)]
    with pytest.raises(UnknownModelError, match="'opt'"):
        canonical_tensors({**by_type, "model_type": "opt"})
    with pytest.raises(UnknownModelError, match="GPT2LMHeadModel"):  # named architectures are not second-guessed
        canonical_tensors({**cfg, "architectures": ["GPT2LMHeadModel"]})
