"""Megatron-core ``GPTModel`` parameters as canonical boxes.

For a rank of a Megatron job (its :class:`~awex.meta.layouts.MegatronParallel` coordinates), maps each box
the layout gives it to views of its native parameters:

================================  ===============================================================
canonical (HF)                    Megatron-core (local spec | Transformer-Engine spec)
================================  ===============================================================
model.embed_tokens.weight         embedding.word_embeddings.weight (first stage);
                                  output_layer.weight on the last stage when embeddings are tied
lm_head.weight                    output_layer.weight
model.norm.weight                 decoder.final_layernorm.weight
layers.L.self_attn.{q,k,v}_proj   decoder.layers.l.self_attention.linear_qkv.{weight,bias}: per query
                                  group [q heads | k | v]; a rank's q box is one piece per local group
layers.L.self_attn.o_proj         ...self_attention.linear_proj.weight
layers.L.self_attn.{q,k}_norm     ...self_attention.{q,k}_layernorm.weight
layers.L.mlp.{gate,up}_proj       ...mlp.linear_fc1.weight = [gate shard; up shard]
layers.L.mlp.down_proj            ...mlp.linear_fc2.weight
layers.L.mlp.gate (MoE router)    ...mlp.router.weight
layers.L.mlp.experts.E.{gate,up}  ...mlp.experts.local_experts.e.linear_fc1.weight | ...experts.linear_fc1.weight<e>
layers.L.mlp.experts.E.down_proj  ...mlp.experts.local_experts.e.linear_fc2.weight | ...experts.linear_fc2.weight<e>
                                  (``e`` = E minus this EP rank's first expert; SequentialMLP | TEGroupedMLP);
                                  GroupedMLP (Megatron-core 0.12, which MindSpeed patches, ``--moe-grouped-gemm``):
                                  ``experts.weight1`` viewed ``[e, hidden, 2 * ffn]`` (transposed, [gate | up]
                                  columns) and ``experts.weight2`` viewed ``[e, ffn, hidden]`` (transposed)
layers.L.input_layernorm          ...input_layernorm.weight | ...linear_qkv.layer_norm_weight
layers.L.post_attention_layernorm ...pre_mlp_layernorm.weight | ...linear_fc1.layer_norm_weight
layers.L.self_attn.q_a_proj,      ...self_attention.linear_q_down_proj / linear_kv_down_proj: whole on every
  kv_a_proj_with_mqa              TP rank (TE spec) or split by rows over TP (local spec: latent_down_split)
layers.L.self_attn.{q,kv}_b_proj  ...self_attention.linear_q_up_proj / linear_kv_up_proj (split by heads)
layers.L.self_attn.{q,kv}_a_norm  ...self_attention.{q,kv}_layernorm | linear_{q,kv}_up_proj.layer_norm_weight
layers.L.mlp.shared_experts.*     ...mlp.shared_experts.linear_fc1 = [gate; up] / linear_fc2 (DeepSeek)
layers.L.mlp.gate.e_score_...     ...mlp.router.expert_bias (an FP32 buffer)
================================  ===============================================================

``l`` is the layer's index inside its (virtual) pipeline chunk. ``_extra_state`` entries are ignored. Only
torch is needed (the model is addressed through ``named_parameters`` and ``named_buffers``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from awex.convert.fused import gate_or_up
from awex.convert.live import LiveTensors, fingerprinted
from awex.convert.unsupported import refuse_unconverted
from awex.meta import Box
from awex.meta.errors import AwexValueError
from awex.meta.layouts import MegatronParallel
from awex.meta.layouts.megatron import pipeline_stages
from awex.meta.models import ARCHITECTURES, ModelDims

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class MegatronNames:
    """Where this rank sits in the Megatron job (what the converter needs beyond the model)."""

    tp_rank: int
    pp_rank: int
    parallel: MegatronParallel
    ep_rank: int = 0  # expert-parallel rank (MoE): which experts this rank holds
    etp_rank: int = 0  # expert-tensor-parallel rank (MoE)


_SHARED = re.compile(r"^mlp\.shared_experts?\.(gate|up|down)_proj\.weight$")
MAPPED = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")  # architectures with latent attention / DeepSeek MoE mapped

_LATENT = {  # canonical -> Megatron (local spec name, Transformer Engine's fused layer-norm name)
    "self_attn.q_a_proj.weight": ("linear_q_down_proj.weight",),
    "self_attn.q_a_layernorm.weight": ("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"),
    "self_attn.q_b_proj.weight": ("linear_q_up_proj.weight",),
    "self_attn.q_proj.weight": ("linear_q_proj.weight",),  # without a low-rank query projection
    "self_attn.kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight",),
    "self_attn.kv_a_layernorm.weight": ("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"),
    "self_attn.kv_b_proj.weight": ("linear_kv_up_proj.weight",),
}


def _chunk_layers(dims: ModelDims, p: MegatronParallel, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each virtual chunk this pipeline stage holds, in chunk order."""
    stage = pipeline_stages(dims.layers, p)
    mine = [layer for layer in range(dims.layers) if stage(layer) == pp_rank]
    if p.vpp == 1:
        return [mine]
    per = dims.layers // (p.pp * p.vpp)
    return [[layer for layer in mine if layer // per == v * p.pp + pp_rank] for v in range(p.vpp)]


def megatron_views(
    model: torch.nn.Module | Sequence[torch.nn.Module], dims: ModelDims, where: MegatronNames
) -> Callable[[str, Box], torch.Tensor | list[tuple[Box, torch.Tensor]]]:
    """``view_of(name, box)`` for one Megatron rank; ``model`` is the GPTModel or its list of VPP chunks."""
    refuse_unconverted(dims, "megatron", MAPPED)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    p = where.parallel
    params = [LiveTensors(m, buffers=False) for m in chunks]  # where each parameter is at the call
    layer_home: dict[int, tuple[int, int]] = {}
    for v, layers in enumerate(_chunk_layers(dims, p, where.pp_rank)):
        for local, layer in enumerate(layers):
            layer_home[layer] = (v, local)
    if len(chunks) != max(1, p.vpp):
        raise AwexValueError(f"megatron: expected {p.vpp} model chunk(s), got {len(chunks)}")
    groups_local = dims.kv_heads // p.tp
    per_group_q = dims.heads // dims.kv_heads * dims.head_dim
    group_rows = per_group_q + 2 * dims.head_dim

    def find(chunk: int, *candidates: str) -> torch.Tensor:
        for c in candidates:
            if c in params[chunk]:
                return params[chunk][c]
        raise KeyError(f"no Megatron parameter {' or '.join(candidates)}")

    buffers = [LiveTensors(m, parameters=False) for m in chunks]

    def find_buffer(chunk: int, name: str) -> torch.Tensor:
        if name not in buffers[chunk]:
            raise KeyError(f"no Megatron buffer {name}")
        return buffers[chunk][name]

    def rows_from_zero(native: torch.Tensor, box: Box) -> torch.Tensor:
        return native[: box.sizes[0]]  # vocabulary shards: real rows first, padding after

    def qkv_pieces(native: torch.Tensor, box: Box, part: str) -> list[tuple[Box, torch.Tensor]]:
        rows = per_group_q if part == "q" else dims.head_dim
        skip = {"q": 0, "k": per_group_q, "v": per_group_q + dims.head_dim}[part]
        first_group = box.offsets[0] // rows
        pieces = []
        for j in range(groups_local):
            sub = Box((box.offsets[0] + j * rows,) + box.offsets[1:], (rows,) + box.sizes[1:])
            start = j * group_rows + skip
            pieces.append((sub, native[start : start + rows]))
        if box.sizes[0] != groups_local * rows or first_group != where.tp_rank * groups_local:
            raise AwexValueError(f"megatron: {part} box {box} does not match rank {where.tp_rank}'s query groups")
        return pieces

    def view_of(name: str, box: Box):
        if name == "model.embed_tokens.weight":
            if where.pp_rank == 0:
                return rows_from_zero(find(0, "embedding.word_embeddings.weight"), box)
            return rows_from_zero(find(len(chunks) - 1, "output_layer.weight"), box)  # tied copy, last stage
        if name == "lm_head.weight":
            return rows_from_zero(find(len(chunks) - 1, "output_layer.weight"), box)
        if name == "model.norm.weight":
            return find(len(chunks) - 1, "decoder.final_layernorm.weight")
        m = _LAYER.match(name)
        if not m or int(m.group(1)) not in layer_home:
            raise KeyError(name)
        chunk, local = layer_home[int(m.group(1))]
        rest = m.group(2)
        pre = f"decoder.layers.{local}."
        if rest.startswith("self_attn.") and rest[10:11] in "qkv" and rest[11:17] == "_proj.":
            suffix = rest[17:]  # weight | bias
            native = find(chunk, pre + "self_attention.linear_qkv." + suffix)
            return qkv_pieces(native, box, rest[10])
        if rest == "self_attn.o_proj.weight":
            return find(chunk, pre + "self_attention.linear_proj.weight")
        latent = _LATENT.get(rest)  # DeepSeek-V3's latent attention: one native tensor per canonical one
        if latent is not None:
            return find(chunk, *(pre + "self_attention." + n for n in latent))
        if rest == "mlp.gate.e_score_correction_bias":  # the router's score bias: an FP32 buffer
            return find_buffer(chunk, pre + "mlp.router.expert_bias")
        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            return find(chunk, pre + f"self_attention.{rest[10]}_layernorm.weight")
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return gate_or_up(find(chunk, pre + "mlp.linear_fc1.weight"), rest.startswith("mlp.gate"))
        if rest == "mlp.down_proj.weight":
            return find(chunk, pre + "mlp.linear_fc2.weight")
        if shared := _SHARED.match(rest):  # Qwen2-MoE's shared_expert, DeepSeek's shared_experts: one native MLP
            if shared.group(1) == "down":
                return find(chunk, pre + "mlp.shared_experts.linear_fc2.weight")
            return gate_or_up(find(chunk, pre + "mlp.shared_experts.linear_fc1.weight"), shared.group(1) == "gate")
        if rest == "mlp.shared_expert_gate.weight":  # the shared expert's sigmoid gate, replicated
            return find(chunk, pre + "mlp.shared_experts.gate_weight")
        if rest == "mlp.gate.weight":  # the MoE router, replicated
            return find(chunk, pre + "mlp.router.weight")
        e = _EXPERT.match(rest)
        if e:
            local = int(e.group(1)) - where.ep_rank * (dims.num_experts // p.ep)
            if not 0 <= local < dims.num_experts // p.ep:
                raise KeyError(f"{name}: expert not on EP rank {where.ep_rank}")
            base = pre + "mlp.experts."
            if base + "weight1" in params[chunk]:  # GroupedMLP: every local expert in one tensor, used as x @ w
                per_rank = dims.num_experts // p.ep
                if e.group(2) == "down":
                    return find(chunk, base + "weight2").view(per_rank, -1, dims.hidden)[local].t()
                fc1 = find(chunk, base + "weight1").view(per_rank, dims.hidden, -1)[local].t()
                return gate_or_up(fc1, e.group(2) == "gate")
            if e.group(2) == "down":
                return find(chunk, f"{base}local_experts.{local}.linear_fc2.weight", f"{base}linear_fc2.weight{local}")
            fc1 = find(chunk, f"{base}local_experts.{local}.linear_fc1.weight", f"{base}linear_fc1.weight{local}")
            return gate_or_up(fc1, e.group(2) == "gate")
        if rest == "input_layernorm.weight":
            return find(chunk, pre + "input_layernorm.weight", pre + "self_attention.linear_qkv.layer_norm_weight")
        if rest == "post_attention_layernorm.weight":
            return find(chunk, pre + "pre_mlp_layernorm.weight", pre + "mlp.linear_fc1.layer_norm_weight")
        raise KeyError(f"{name}: no Megatron mapping")

    return fingerprinted(view_of, *params, *buffers)


def _latent_shapes(pre: str, dims: ModelDims, p: MegatronParallel) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's latent attention on one TP rank of the local spec (norms as their own modules)."""
    tp = p.tp
    split = tp if p.latent_down_split else 1
    heads = dims.heads // tp
    kv_a = dims.kv_lora_rank + dims.qk_rope_dim
    out = {pre + "linear_proj.weight": (dims.hidden, heads * dims.v_head_dim)}
    if dims.q_lora_rank:
        out[pre + "linear_q_down_proj.weight"] = (dims.q_lora_rank // split, dims.hidden)
        out[pre + "linear_q_up_proj.weight"] = (heads * (dims.qk_nope_dim + dims.qk_rope_dim), dims.q_lora_rank)
    else:
        out[pre + "linear_q_proj.weight"] = (heads * (dims.qk_nope_dim + dims.qk_rope_dim), dims.hidden)
    out[pre + "linear_kv_down_proj.weight"] = (kv_a // split, dims.hidden)
    out[pre + "linear_kv_up_proj.weight"] = (heads * (dims.qk_nope_dim + dims.v_head_dim), dims.kv_lora_rank)
    if dims.q_lora_rank:
        out[pre + "q_layernorm.weight"] = (dims.q_lora_rank,)
    out[pre + "kv_layernorm.weight"] = (dims.kv_lora_rank,)
    return out


def megatron_param_shapes(dims: ModelDims, where: MegatronNames) -> list[dict[str, tuple[int, ...]]]:
    """Names and shapes of a Megatron-core ``GPTModel`` rank's parameters (local layer spec), per VPP chunk.

    What the real model has for dense models (checked against Megatron-core on CPU); lets tools and benchmarks
    hold parameters in Megatron's exact layout without building the model.
    """
    refuse_unconverted(dims, "megatron", MAPPED)
    p = where.parallel
    tp = p.tp
    multiple = p.vocab_pad * tp  # --make-vocab-size-divisible-by times TP, as Megatron pads
    padded = -(-dims.vocab // multiple) * multiple
    qkv_rows = (dims.heads + 2 * dims.kv_heads) * dims.head_dim // tp
    chunks = _chunk_layers(dims, p, where.pp_rank)
    out: list[dict[str, tuple[int, ...]]] = []
    for v, layers in enumerate(chunks):
        shapes: dict[str, tuple[int, ...]] = {}
        if where.pp_rank == 0 and v == 0:
            shapes["embedding.word_embeddings.weight"] = (padded // tp, dims.hidden)
        for local in range(len(layers)):
            pre = f"decoder.layers.{local}."
            shapes[pre + "input_layernorm.weight"] = (dims.hidden,)
            if dims.kv_lora_rank:
                shapes.update(_latent_shapes(pre + "self_attention.", dims, p))
            else:
                shapes[pre + "self_attention.linear_qkv.weight"] = (qkv_rows, dims.hidden)
                shapes[pre + "self_attention.linear_proj.weight"] = (dims.hidden, dims.heads * dims.head_dim // tp)
            if dims.attention_bias:
                shapes[pre + "self_attention.linear_qkv.bias"] = (qkv_rows,)
            if dims.qk_norm:
                shapes[pre + "self_attention.q_layernorm.weight"] = (dims.head_dim,)
                shapes[pre + "self_attention.k_layernorm.weight"] = (dims.head_dim,)
            shapes[pre + "pre_mlp_layernorm.weight"] = (dims.hidden,)
            if layers[local] in dims.sparse_layers:  # MoE: router and this EP rank's experts (SequentialMLP)
                shapes[pre + "mlp.router.weight"] = (dims.num_experts, dims.hidden)
                inter = dims.moe_intermediate // p.etp
                for e in range(dims.num_experts // p.ep):
                    shapes[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * inter, dims.hidden)
                    shapes[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (dims.hidden, inter)
                if dims.shared_expert_intermediate:
                    shared = dims.shared_expert_intermediate // tp
                    shapes[pre + "mlp.shared_experts.linear_fc1.weight"] = (2 * shared, dims.hidden)
                    shapes[pre + "mlp.shared_experts.linear_fc2.weight"] = (dims.hidden, shared)
                    if ARCHITECTURES[dims.architecture].moe == "qwen2":  # Qwen2-MoE's sigmoid gate
                        shapes[pre + "mlp.shared_experts.gate_weight"] = (1, dims.hidden)
            else:
                shapes[pre + "mlp.linear_fc1.weight"] = (2 * dims.intermediate // tp, dims.hidden)
                shapes[pre + "mlp.linear_fc2.weight"] = (dims.hidden, dims.intermediate // tp)
        last = where.pp_rank == p.pp - 1 and v == len(chunks) - 1
        if last:
            shapes["decoder.final_layernorm.weight"] = (dims.hidden,)
            if not dims.tie_embeddings or p.pp > 1:
                shapes["output_layer.weight"] = (padded // tp, dims.hidden)
        out.append(shapes)
    return out
