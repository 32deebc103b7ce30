"""The fused parameters vLLM and SGLang share: how a canonical (HF) name reads inside a decoder layer.

Both engines fuse ``q/k/v_proj`` into ``qkv_proj`` ([q heads | k | v] of the rank), ``gate/up_proj`` into
``gate_up_proj`` ([gate shard; up shard]) and each layer's experts into ``w13_weight`` / ``w2_weight``; they differ
in where the experts live and how ranks are split, which their own modules (:mod:`awex.convert.vllm`,
:mod:`awex.convert.sglang`) say.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight(?:_scale_inv)?$")
GATE_UP = re.compile(r"^(mlp|mlp\.shared_experts?)\.(gate|up)_proj\.(.+)$")  # dense MLP or a shared expert MLP
QKV_A = re.compile(r"^self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")  # DeepSeek's fused_qkv_a_proj
QKV = re.compile(r"^self_attn\.([qkv])_proj\.(.+)$")


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one attention TP rank holds (one, replicated, when TP exceeds them)."""
    return max(1, kv_heads // tp)


def param_finder(params: Mapping[str, torch.Tensor], what: str, where: str = "") -> Callable[[str], torch.Tensor]:
    """``find(name)``: the storage of one of an engine rank's live parameters (``KeyError`` "no ``what`` name
    ``where``", e.g. "no vLLM parameter X", when it has none of that name)."""

    def find(name: str) -> torch.Tensor:
        t = params.get(name)
        if t is None:
            raise KeyError(f"no {what} {name}{where}")
        return t.data if isinstance(t, torch.nn.Parameter) else t

    return find


def qkv_part(native: torch.Tensor, part: str, q_rows: int, kv_rows: int, rows: int) -> torch.Tensor:
    """``rows`` rows of ``q``, ``k`` or ``v`` in a fused ``qkv_proj`` = [q rows | k rows | v rows] of the rank (rows of
    the weight, or of its FP8 scale tiles when ``q_rows`` / ``kv_rows`` count tiles)."""
    start = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[part]
    return native[start : start + rows]


def gate_or_up(native: torch.Tensor, gate: bool) -> torch.Tensor:
    """The gate (first) or up (second) half of a fused ``[gate; up]`` parameter (``gate_up_proj``, ``w13``)."""
    half = native.shape[0] // 2
    return native[:half] if gate else native[half:]


def fused_mlp_view(native: torch.Tensor, rest: str, first_expert: int) -> torch.Tensor | None:
    """A layer's MLP part ``rest`` (the canonical name after ``model.layers.L.``) in its fused native parameter:
    expert ``E``'s slice of ``w13`` / ``w2`` (``first_expert``: the rank's first local expert) or the gate / up half
    of ``gate_up_proj``; ``None`` for names that are neither."""
    if e := EXPERT.match(rest):
        native = native[int(e.group(1)) - first_expert]
        return native if e.group(2) == "down" else gate_or_up(native, e.group(2) == "gate")
    if g := GATE_UP.match(rest):
        return gate_or_up(native, g.group(2) == "gate")
    return None
