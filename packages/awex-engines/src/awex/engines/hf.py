"""HF ``PreTrainedModel`` as a trainer source or a receiver: canonical names are the model's own names."""

from __future__ import annotations

import torch

from awex.convert.hf import hf_views
from awex.meta import Box, Layout, canonical_tensors
from awex.meta.layouts import hf_layout
from awex.meta.spec import Role


def hf_model_layout(model: torch.nn.Module, role: Role | str, instance: str, dtype: str | None = None) -> Layout:
    """The single-rank layout of an HF model, from its config; checks the model has exactly those tensors."""
    config = model.config.to_dict()
    tensors = canonical_tensors(config, dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."))
    view_of = hf_views(model)
    missing = []
    for t in tensors:
        try:
            view = view_of(t.name, Box(tuple(0 for _ in t.spec.shape), tuple(t.spec.shape)))
            if tuple(view.shape) != tuple(t.spec.shape):
                missing.append(f"{t.name} (shape {tuple(view.shape)}, expected {tuple(t.spec.shape)})")
        except KeyError:
            missing.append(t.name)
    if missing:
        raise ValueError(f"{type(model).__name__} lacks canonical tensors {missing[:10]}")
    return hf_layout(tensors, role, instance)


__all__ = ["hf_model_layout", "hf_views"]
