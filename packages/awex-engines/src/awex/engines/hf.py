"""HF ``PreTrainedModel`` as a trainer source or a receiver: canonical names are the model's own names."""

from __future__ import annotations

from dataclasses import replace

import torch

from awex.convert.hf import hf_checkpoint_tensors, hf_views
from awex.meta import Box, Layout, TensorSpec, canonical_tensors
from awex.meta.errors import AwexValueError
from awex.meta.layouts import hf_layout
from awex.meta.models import CanonicalTensor, UnknownModelError
from awex.meta.spec import Role


def hf_model_layout(model: torch.nn.Module, role: Role | str, instance: str, dtype: str | None = None) -> Layout:
    """The single-rank layout of an HF model, from its config; checks the model has exactly those tensors. A tensor
    the model holds in another dtype than the table's (a router's FP32 score bias that an older transformers loads
    in the model's dtype) is described as held: the plan's dtype policy then decides what may move into it."""
    tensors = model_tensors(model, dtype or str(next(model.parameters()).dtype).removeprefix("torch."))
    view_of = hf_views(model)
    missing = []
    held = []
    for t in tensors:
        try:
            view = view_of(t.name, Box(tuple(0 for _ in t.spec.shape), tuple(t.spec.shape)))
            if tuple(view.shape) != tuple(t.spec.shape):
                missing.append(f"{t.name} (shape {tuple(view.shape)}, expected {tuple(t.spec.shape)})")
            native = str(view.dtype).removeprefix("torch.")
            if dtype is None and native != t.spec.dtype and view.is_floating_point():
                t = replace(t, spec=replace(t.spec, dtype=native))
        except KeyError:
            missing.append(t.name)
        held.append(t)
    if missing:
        raise AwexValueError(f"{type(model).__name__} lacks canonical tensors {missing[:10]}")
    return hf_layout(held, role, instance)


def model_tensors(model: torch.nn.Module, dtype: str) -> list[CanonicalTensor]:
    """An HF model's canonical tensors: its architecture's table where Awex has one (the architecture named by the
    config, else by the model's class), else what its checkpoint holds
    (``awex.convert.hf.hf_checkpoint_tensors``; floating tensors in ``dtype``), each a whole tensor, which is what
    a receiver that learns its layout from its engine's loaders names too."""
    config = model.config.to_dict()
    if not config.get("architectures"):  # a config made in code: the model's class names it (FSDP2 prefixes it)
        config["architectures"] = [type(model).__name__.removeprefix("FSDP")]
    try:
        return canonical_tensors(config, dtype=dtype)
    except UnknownModelError:
        pass
    specs = sorted(checkpoint_specs(model, dtype), key=lambda spec: spec.name)
    return [CanonicalTensor(spec, "replicated") for spec in specs]


def checkpoint_specs(model: torch.nn.Module, dtype: str) -> list[TensorSpec]:
    """What an HF model's checkpoint holds (``awex.convert.hf.hf_checkpoint_tensors``) as specs, floating tensors
    in ``dtype`` (the model's, or an engine's), the others in their own dtype."""
    return [
        TensorSpec(name, shape, dtype if t.is_floating_point else str(t).removeprefix("torch."))
        for name, shape, t in hf_checkpoint_tensors(model)
    ]


__all__ = ["checkpoint_specs", "hf_model_layout", "hf_views", "model_tensors"]
