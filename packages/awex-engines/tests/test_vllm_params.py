"""Routing a vLLM worker's canonical tensors: in place into live parameters, or through vLLM's loaders for
modules vLLM transformed after loading; parameters that do not match the layout are refused by name.

The modules here are plain torch modules named as vLLM names its parameters (``awex.convert.vllm``); the rules
look only at what vLLM's modules expose (``quant_method``, ``cpu_linear``, the parameters). The real engines
are exercised in the integration matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.convert import vllm_param_dtypes, vllm_param_shapes
from awex.engines.vllm_params import route, transformed_reason
from awex.meta import canonical_tensors
from awex.meta.layouts import VllmParallel
from awex.meta.models import model_dims

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
DIMS = model_dims(CONFIG, "float32")
NAMES = sorted(t.name for t in canonical_tensors(DIMS))
SHAPES = vllm_param_shapes(DIMS, VllmParallel(tp=1))
DTYPES = vllm_param_dtypes(SHAPES, "float32")


class UnquantizedLinearMethod:  # the class name is what the rule reads
    pass


class SomeRepackingMethod:
    pass


def engine(shapes=SHAPES, dtype=torch.float32) -> torch.nn.Module:
    """A module tree holding ``shapes`` under vLLM's parameter names."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
        module.quant_method = UnquantizedLinearMethod()
    return root


def test_plain_parameters_all_receive_in_place():
    dest = route(engine(), NAMES, DIMS.tie_embeddings, SHAPES, DTYPES)
    assert sorted(dest.in_place) == NAMES and not dest.loader and not dest.loader_modules


def test_a_transformed_module_takes_the_loader_path_whole():
    model = engine()
    qkv = model.get_submodule("model.layers.1.self_attn.qkv_proj")
    qkv.cpu_linear = lambda x, w, b: None  # vLLM-CPU computes from a prepacked copy
    model.get_submodule("model.layers.0.mlp.gate_up_proj").quant_method = SomeRepackingMethod()
    dest = route(model, NAMES, DIMS.tie_embeddings, SHAPES, DTYPES)
    pre1, pre0 = "model.layers.1.self_attn.", "model.layers.0.mlp."
    assert sorted(dest.loader) == sorted(
        [pre1 + f"{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")]
        + [pre0 + "gate_proj.weight", pre0 + "up_proj.weight"]
    )
    assert set(dest.in_place) == set(NAMES) - set(dest.loader)
    assert "prepacked" in dest.loader_modules["model.layers.1.self_attn.qkv_proj"]
    assert "SomeRepackingMethod" in dest.loader_modules["model.layers.0.mlp.gate_up_proj"]
    qkv.cpu_linear = torch.nn.functional.linear  # computes from the live weight: in place again
    assert transformed_reason(qkv) is None


def test_staged_receive_sends_everything_through_the_loaders():
    dest = route(engine(), NAMES, DIMS.tie_embeddings, SHAPES, DTYPES, in_place=False)
    assert sorted(dest.loader) == NAMES and not dest.in_place


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda s: {**s, "model.layers.0.self_attn.o_proj.weight": (128, 64)},
            r"model\.layers\.0\.self_attn\.o_proj\.weight: vLLM holds shape \(128, 64\), Awex computes \(128, 128\)",
        ),
        (
            lambda s: {k: v for k, v in s.items() if k != "model.norm.weight"},
            r"model\.norm\.weight \(for model\.norm\.weight\): vLLM has no such parameter",
        ),
    ],
)
def test_parameters_that_do_not_match_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        route(engine(change(SHAPES)), NAMES, DIMS.tie_embeddings, SHAPES, DTYPES)


def test_wrong_dtype_and_strides_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight: vLLM holds torch\.bfloat16, Awex computes torch\.float32"
    ):
        route(engine(dtype=torch.bfloat16), NAMES, DIMS.tie_embeddings, SHAPES, DTYPES)
    model = engine()
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    down.weight = torch.nn.Parameter(
        torch.zeros(SHAPES["model.layers.0.mlp.down_proj.weight"][::-1]).t(), requires_grad=False
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: not contiguous"):
        route(model, NAMES, DIMS.tie_embeddings, SHAPES, DTYPES)
