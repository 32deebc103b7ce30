"""vLLM's own parameters (dense decoder models: Llama, Mistral, Qwen2, Qwen3) as canonical boxes.

For the in-place path on engines whose parameters are plain tensors (GPU vLLM): maps each box the vLLM layout
(:func:`awex.meta.layouts.vllm_layout`) gives a rank to a view of that rank's native parameter:

================================  ===============================================================
canonical (HF)                    vLLM
================================  ===============================================================
model.embed_tokens.weight         model.embed_tokens.weight: vocabulary padded to 64, equal blocks per rank
lm_head.weight                    lm_head.weight (absent when tied)
layers.L.self_attn.{q,k,v}_proj   model.layers.L.self_attn.qkv_proj.{weight,bias} = [q heads | k | v] of
                                  this rank (KV heads replicated when TP exceeds them)
layers.L.self_attn.o_proj         ...self_attn.o_proj.weight (columns split)
layers.L.mlp.{gate,up}_proj       ...mlp.gate_up_proj.weight = [gate shard; up shard]
layers.L.mlp.down_proj            ...mlp.down_proj.weight (columns split)
norms                             same names, replicated
================================  ===============================================================

:func:`vllm_param_shapes` gives the names and shapes vLLM allocates (checked against vLLM's recorded loading
shapes on CPU), so benchmarks can hold tensors in vLLM's exact layout without the engine.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch

from awex.meta import Box
from awex.meta.layouts import VllmParallel
from awex.meta.layouts.vllm import pp_layer_ranges
from awex.meta.models import ARCHITECTURES, ModelDims

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _kv_local(dims: ModelDims, tp: int) -> int:
    return max(1, dims.kv_heads // tp)


def vllm_param_shapes(dims: ModelDims, parallel: VllmParallel, tp_rank: int = 0, pp_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one vLLM rank's parameters (unquantised dense model)."""
    tp = parallel.tp
    padded = -(-dims.vocab // parallel.vocab_pad) * parallel.vocab_pad
    hd = dims.head_dim
    q_rows = dims.heads // tp * hd
    qkv_rows = q_rows + 2 * _kv_local(dims, tp) * hd
    start, stop = pp_layer_ranges(dims.layers, parallel.pp)[pp_rank]
    shapes: dict[str, tuple[int, ...]] = {}
    if pp_rank == 0:
        shapes["model.embed_tokens.weight"] = (padded // tp, dims.hidden)
    for layer in range(start, stop):
        pre = f"model.layers.{layer}."
        shapes[pre + "self_attn.qkv_proj.weight"] = (qkv_rows, dims.hidden)
        if dims.attention_bias:
            shapes[pre + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        shapes[pre + "self_attn.o_proj.weight"] = (dims.hidden, q_rows)
        if ARCHITECTURES[dims.architecture].qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (hd,)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        shapes[pre + "mlp.gate_up_proj.weight"] = (2 * dims.intermediate // tp, dims.hidden)
        shapes[pre + "mlp.down_proj.weight"] = (dims.hidden, dims.intermediate // tp)
        shapes[pre + "input_layernorm.weight"] = (dims.hidden,)
        shapes[pre + "post_attention_layernorm.weight"] = (dims.hidden,)
    if pp_rank == parallel.pp - 1:
        shapes["model.norm.weight"] = (dims.hidden,)
        if not dims.tie_embeddings:
            shapes["lm_head.weight"] = (padded // tp, dims.hidden)
    return shapes


def vllm_views(params: Mapping[str, torch.Tensor], dims: ModelDims, parallel: VllmParallel) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` over one vLLM rank's parameters (``dict(model.named_parameters())``)."""
    tp = parallel.tp
    hd = dims.head_dim
    q_rows = dims.heads // tp * hd
    kv_rows = _kv_local(dims, tp) * hd

    def find(name: str) -> torch.Tensor:
        t = params.get(name)
        if t is None:
            raise KeyError(f"no vLLM parameter {name}")
        return t.data if isinstance(t, torch.nn.Parameter) else t

    def view_of(name: str, box: Box) -> torch.Tensor:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            native = find("model.embed_tokens.weight" if name == "lm_head.weight" and dims.tie_embeddings else name)
            return native[: box.sizes[0]]  # real rows first, padding after
        if name == "model.norm.weight":
            return find(name)
        m = _LAYER.match(name)
        if not m:
            raise KeyError(name)
        rest = m.group(2)
        pre = f"model.layers.{m.group(1)}."
        if rest.startswith("self_attn.") and rest[10:11] in "qkv" and rest[11:17] == "_proj.":
            qkv = find(pre + "self_attn.qkv_proj." + rest[17:])
            start = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[rest[10]]
            return qkv[start:start + box.sizes[0]]
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            gate_up = find(pre + "mlp.gate_up_proj.weight")
            half = gate_up.shape[0] // 2
            return gate_up[:half] if rest.startswith("mlp.gate") else gate_up[half:]
        return find(name)

    return view_of
