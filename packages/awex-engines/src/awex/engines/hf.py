"""HF ``PreTrainedModel`` as a trainer source or a receiver: canonical names are the model's own names."""

from __future__ import annotations

import torch

from awex.convert.hf import hf_views
from awex.meta import Layout, canonical_tensors
from awex.meta.layouts import hf_layout
from awex.meta.spec import Role


def hf_model_layout(model: torch.nn.Module, role: Role | str, instance: str, dtype: str | None = None) -> Layout:
    """The single-rank layout of an HF model, from its config; checks the model has exactly those tensors."""
    config = model.config.to_dict()
    tensors = canonical_tensors(config, dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."))
    params = dict(model.named_parameters())
    missing = [t.name for t in tensors if t.name not in params]
    if missing:
        raise ValueError(f"{type(model).__name__} lacks canonical tensors {missing[:10]}")
    return hf_layout(tensors, role, instance)


__all__ = ["hf_model_layout", "hf_views"]


