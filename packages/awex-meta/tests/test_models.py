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
    with pytest.raises(UnknownModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
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
