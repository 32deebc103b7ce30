"""HF models: canonical names are the model's own parameter names; a box is a plain slice."""

from __future__ import annotations

import re
from typing import Callable

import torch

from awex.convert.live import LiveTensors
from awex.meta import Box

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_views(model: torch.nn.Module) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` for an HF model: an alias of the parameter's box, not a copy.

    MoE experts are canonical per expert (``mlp.experts.E.gate_proj.weight``, as checkpoints store them);
    transformers 5 holds them fused per layer (``mlp.experts.gate_up_proj`` of shape [E, 2I, H], gate rows
    first, and ``mlp.experts.down_proj`` of shape [E, H, I]): those come as views of the fused parameters.
    Canonical tensors that HF holds as buffers (DeepSeek-V3's ``mlp.gate.e_score_correction_bias``) are views of
    those buffers.
    """
    params = LiveTensors(model)  # where each parameter is at the call (it may have moved since)

    def view_of(name: str, box: Box) -> torch.Tensor:
        p = params.get(name)
        if p is None:
            m = _EXPERT.match(name)
            if m is None:
                raise KeyError(name)
            base, expert, part = m.group(1), int(m.group(2)), m.group(3)
            if part == "down":
                p = params[f"{base}.down_proj"][expert]
            else:
                fused = params[f"{base}.gate_up_proj"][expert]
                half = fused.shape[0] // 2
                p = fused[:half] if part == "gate" else fused[half:]
        return p[box.slices()]

    return view_of
