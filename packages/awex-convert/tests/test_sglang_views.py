"""awex.convert.sglang: SGLang's parameters as canonical boxes, consistent with the SGLang layout.

Element by element against SGLang's own classes and loaders: the ``sglang_layout`` nox session. Here, without
SGLang: every box the layout gives a rank has a view of its shape, and the views together fill every element of
the rank's parameters except vocabulary padding."""

from __future__ import annotations

import pytest
import torch

from awex.convert.sglang import sglang_param_dtypes, sglang_param_shapes, sglang_views
from awex.meta.layouts import SglangParallel, sglang_engine_layout
from awex.meta.models import model_dims

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000)
CONFIGS = {
    "qwen3": dict(SMALL, architectures=["Qwen3ForCausalLM"], intermediate_size=96, num_hidden_layers=3),
    "qwen2-tied": dict(
        SMALL,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        intermediate_size=96,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
    "qwen3-moe": dict(
        SMALL,
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
}
CASES = [
    ("qwen3", SglangParallel(tp=4)),
    ("qwen3", SglangParallel(tp=2, pp=2)),
    ("qwen3", SglangParallel(tp=4, attn_dp=2)),
    ("qwen2-tied", SglangParallel(tp=1, pp=2)),
    ("qwen3-moe", SglangParallel(tp=4, ep=2, attn_dp=2, dp_lm_head=True)),
]


@pytest.mark.parametrize(("model", "parallel"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_views_fill_each_ranks_parameters(model, parallel):
    config = CONFIGS[model]
    dims = model_dims(config, "float32")
    layout = sglang_engine_layout(config, "float32", parallel)
    for rank in range(parallel.world_size):
        shapes = sglang_param_shapes(dims, parallel, rank)
        assert set(sglang_param_dtypes(shapes, "float32").values()) == {torch.float32}
        params = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
        view_of = sglang_views(params, dims, parallel, rank)
        for name, boxes in layout.rank_boxes(rank).items():
            for box in boxes:
                view = view_of(name, box)
                assert tuple(view.shape) == box.sizes, (rank, name, box)
                view.fill_(1.0)
        for name, t in params.items():
            unwritten = torch.isnan(t).reshape(t.shape[0], -1).any(dim=1)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary padding: trailing rows only
                first = int(unwritten.int().argmax()) if unwritten.any() else t.shape[0]
                assert not unwritten[:first].any() and unwritten[first:].all() and t.shape[0] - first < 64
            else:
                assert not unwritten.any(), (rank, name)


def test_unmapped_models_are_refused_before_any_view():
    dims = model_dims(dict(CONFIGS["qwen3"], architectures=["LlamaForCausalLM"]), "float32")
    with pytest.raises(ValueError, match="DP attention"):
        sglang_param_shapes(dims, SglangParallel(tp=4, attn_dp=2))
