"""HF models: canonical names are the model's own parameter names; a box is a plain slice."""

from __future__ import annotations

import re
from typing import Callable

import torch

from awex.convert.live import LiveTensors, fingerprinted
from awex.meta import Box

_EXPERT = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


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

    return fingerprinted(view_of, params)


def hf_checkpoint_tensors(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The canonical tensors of an HF model without a table, as ``(name, shape, dtype)``: what its checkpoint
    holds (``state_dict``: parameters and persistent buffers; global shapes for DTensors), a tensor held under two
    names (a tied ``lm_head``) once, under its first name. Experts that transformers 5 holds fused per layer
    (``experts.gate_up_proj`` [E, 2I, H], gate rows first, and ``experts.down_proj`` [E, H, I]) are named per
    expert as checkpoints store them (``experts.E.gate_proj.weight``, as :func:`hf_views` reads them). Works on a
    model built on the ``meta`` device."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        shape = tuple(t.shape)
        m = _FUSED_EXPERTS.match(name)
        if m is None or len(shape) != 3:
            out.append((name, shape, t.dtype))
            continue
        for e in range(shape[0]):
            if m.group(2) == "down_proj":
                out.append((f"{m.group(1)}.{e}.down_proj.weight", shape[1:], t.dtype))
            else:
                half = (shape[1] // 2, shape[2])
                out += [(f"{m.group(1)}.{e}.{part}_proj.weight", half, t.dtype) for part in ("gate", "up")]
    return out


_FUSED_EXPERTS = re.compile(r"^((?:.*\.)?experts)\.(gate_up_proj|down_proj)$")
