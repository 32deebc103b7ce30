"""HF models: canonical names are the model's own parameter names; a box is a plain slice."""

from __future__ import annotations

from typing import Callable

import torch

from awex.meta import Box


def hf_views(model: torch.nn.Module) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` for an HF model: an alias of the parameter's box, not a copy."""
    params = {name: p.data for name, p in model.named_parameters()}

    def view_of(name: str, box: Box) -> torch.Tensor:
        return params[name][box.slices()]

    return view_of
