"""The fused parameters vLLM and SGLang share: how a canonical (HF) name reads inside a decoder layer.

Both engines fuse ``q/k/v_proj`` into ``qkv_proj`` ([q heads | k | v] of the rank), ``gate/up_proj`` into
``gate_up_proj`` ([gate shard; up shard]) and each layer's experts into ``w13_weight`` / ``w2_weight``; they differ
in where the experts live and how ranks are split, which their own modules (:mod:`awex.convert.vllm`,
:mod:`awex.convert.sglang`) say.
"""

from __future__ import annotations

import re

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight(?:_scale_inv)?$")
GATE_UP = re.compile(r"^(mlp|mlp\.shared_experts?)\.(gate|up)_proj\.(.+)$")  # dense MLP or a shared expert MLP
QKV_A = re.compile(r"^self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")  # DeepSeek's fused_qkv_a_proj
QKV = re.compile(r"^self_attn\.([qkv])_proj\.(.+)$")


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one attention TP rank holds (one, replicated, when TP exceeds them)."""
    return max(1, kv_heads // tp)
