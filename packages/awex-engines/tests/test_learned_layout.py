"""Layouts learned from an engine's loaders, assembled over ranks (pure parts; the vLLM side runs in the
integration tests): every element of every tensor held by some rank, ranks agreeing on each tensor, and HF
trainers of models without a table naming what their checkpoint holds."""

from __future__ import annotations

import pytest
import torch

from awex.engines.hf import hf_model_layout, model_tensors
from awex.engines.vllm_learned import UnlearnableLayoutError, assemble, canonical_specs, dtype_keyword, uncovered
from awex.meta import Box, TensorSpec

SPECS = [TensorSpec("w", (4, 6), "float32"), TensorSpec("n", (6,), "float32"), TensorSpec("unused", (2,), "float32")]


def _part(boxes: dict[str, list[Box]], dtype: str = "float32", shape=None) -> dict:
    shapes = {s.name: s.shape for s in SPECS}
    return {
        n: {"shape": list(shape or shapes[n]), "dtype": dtype, "boxes": [b.to_list() for b in bs]}
        for n, bs in boxes.items()
    }


def test_two_tp_ranks_assemble_into_one_layout_with_each_rank_holding_what_its_loaders_filled():
    parts = {
        0: _part({"w": [Box((0, 0), (2, 6))], "n": [Box((0,), (6,))]}),
        1: _part({"w": [Box((2, 0), (2, 6))], "n": [Box((0,), (6,))]}),
    }
    layout = assemble("vllm-0", 2, SPECS, parts)
    assert layout.names == ["n", "w"]  # a tensor no loader took is not part of it
    assert layout.rank_boxes(1) == {"w": (Box((2, 0), (2, 6)),), "n": (Box((0,), (6,)),)}
    assert layout.holdings("n") == ((Box((0,), (6,)), (0, 1)),)


def test_elements_no_rank_holds_are_an_error_naming_the_tensor():
    parts = {0: _part({"w": [Box((0, 0), (2, 6))]}), 1: _part({"w": [Box((2, 0), (1, 6))]})}
    with pytest.raises(UnlearnableLayoutError, match=r"elements \[3:4, 0:6\] of w \(4, 6\) land on no rank"):
        assemble("vllm-0", 2, SPECS, parts)


def test_ranks_that_describe_a_tensor_differently_are_an_error():
    parts = {0: _part({"n": [Box((0,), (6,))]}), 1: _part({"n": [Box((0,), (6,))]}, dtype="bfloat16")}
    with pytest.raises(UnlearnableLayoutError, match="ranks describe n differently"):
        assemble("vllm-0", 2, SPECS, parts)


@pytest.mark.parametrize(
    "boxes,left",
    [
        ([Box((0, 0), (4, 6))], 0),
        ([Box((0, 0), (2, 6)), Box((2, 0), (2, 3)), Box((2, 3), (2, 3))], 0),
        ([Box((1, 1), (2, 2))], 4 * 6 - 4),
        ([Box((0, 0), (4, 3)), Box((0, 0), (4, 3))], 12),
    ],
)
def test_uncovered_is_what_no_box_covers(boxes, left):
    assert sum(b.numel for b in uncovered(Box((0, 0), (4, 6)), boxes)) == left


class _Tiny(torch.nn.Module):
    """An HF-like model of an architecture Awex has no table for, with a tied head and fused experts."""

    class config:  # noqa: N801 - what HF models carry
        @staticmethod
        def to_dict():
            return {"architectures": ["TinyForCausalLM"], "model_type": "tiny"}

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = torch.nn.Parameter(torch.randn(2, 6, 4))
        self.experts.down_proj = torch.nn.Parameter(torch.randn(2, 4, 3))
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def test_a_model_without_a_table_names_what_its_checkpoint_holds():
    tensors = {t.name: t.spec for t in model_tensors(_Tiny(), "float32")}
    assert set(tensors) == {
        "embed.weight",  # the tied head once, under its first name
        "experts.0.gate_proj.weight",
        "experts.0.up_proj.weight",
        "experts.0.down_proj.weight",
        "experts.1.gate_proj.weight",
        "experts.1.up_proj.weight",
        "experts.1.down_proj.weight",
        "scale",  # a persistent buffer; the non-persistent one is not in a checkpoint
    }
    assert tensors["experts.1.up_proj.weight"].shape == (3, 4)
    layout = hf_model_layout(_Tiny(), "trainer", "hf")
    assert layout.rank_boxes(0)["experts.1.down_proj.weight"] == (Box((0, 0), (4, 3)),)


def test_a_megatron_trainer_of_a_model_without_a_table_is_refused_saying_why():
    from awex.engines.source import TrainerSource
    from awex.meta.models import UnknownModelError

    with pytest.raises(UnknownModelError, match="Megatron-core trainer needs Awex's table.*HF and FSDP2 trainers"):
        TrainerSource.megatron(torch.nn.Linear(2, 2), {"architectures": ["OPTForCausalLM"], "model_type": "opt"})


def test_learned_views_refuse_a_parameter_that_changed_since_the_layout_was_learned():
    from awex.convert.recorded import record_loads
    from awex.engines.vllm_learned import LearnedLayout, learned_views

    params = {"p": torch.zeros(4, 3)}
    rec = record_loads(lambda n, w: params["p"][1:3].copy_(w), [TensorSpec("w", (2, 3), "float32")], params)
    learned = LearnedLayout(assemble("v", 1, [TensorSpec("w", (2, 3), "float32")], {0: {}}), rec.landings, {}, {}, 0)
    view_of = learned_views(params, learned)
    view_of("w", Box((0, 0), (2, 3))).fill_(7)
    assert params["p"][1:3].eq(7).all() and params["p"][0].eq(0).all()  # landed where the loader would write
    held = view_of.fingerprint()  # a steady version re-derives the views only when this changes
    assert view_of.fingerprint() == held and view_of.addresses() == held[0]
    params["p"] = torch.zeros(2, 3)  # re-allocated smaller
    assert view_of.fingerprint() != held and view_of.addresses() != held[0]
    with pytest.raises(ValueError, match="p changed since its layout was learned"):
        view_of("w", Box((0, 0), (2, 3)))
    with pytest.raises(KeyError, match="not a box this rank's loaders fill"):
        view_of("w", Box((0, 0), (1, 3)))


@pytest.mark.parametrize(
    "version, keyword",
    [
        ("4.51.0", "torch_dtype"),
        ("4.55.4", "torch_dtype"),
        ("4.56.0", "dtype"),
        ("5.19.0", "dtype"),
        ("5.0.0rc1", "dtype"),
    ],
)
def test_the_dtype_keyword_follows_the_transformers_version(version, keyword):
    assert dtype_keyword(version) == keyword


def test_canonical_specs_build_the_model_on_meta_with_the_installed_transformers():
    """What names an untabled model's checkpoint tensors builds it with the installed transformers (the floors
    session runs 4.51, which knows no ``dtype`` keyword), floating tensors in the dtype asked for."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    specs = {s.name: s for s in canonical_specs(config, "bfloat16")}
    assert specs["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert specs["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert {s.dtype for s in specs.values()} == {"bfloat16"}
