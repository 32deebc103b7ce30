"""SGLang's own parameters (Llama, Mistral, Qwen2/3 and their MoE) as canonical boxes.

Maps each box the SGLang layout (:func:`awex.meta.layouts.sglang.sglang_layout`) gives a rank to a view of that
rank's live parameter, so a receiver writes in place:

================================  ===============================================================
canonical (HF)                    SGLang
================================  ===============================================================
model.embed_tokens.weight         model.embed_tokens.weight: vocabulary padded to 64, equal blocks per rank
                                  (over the attention TP with DP attention); tied and ``pp > 1``: the last
                                  stage's ``lm_head.weight`` too
lm_head.weight                    lm_head.weight (absent when tied on one stage)
layers.L.self_attn.{q,k,v}_proj   model.layers.L.self_attn.qkv_proj.{weight,bias} = [q heads | k | v] of this
                                  attention-TP rank (KV heads replicated when the attention TP exceeds them)
layers.L.self_attn.o_proj         ...self_attn.o_proj.weight (columns split over the attention TP)
layers.L.mlp.{gate,up}_proj       ...mlp.gate_up_proj.weight = [gate shard; up shard]
layers.L.mlp.down_proj            ...mlp.down_proj.weight (columns split)
norms, q/k norms, router          same names, replicated
layers.L.mlp.experts.E.{gate,up}  ...mlp.experts.w13_weight[E - first local] = [gate shard; up shard] (MoE TP)
layers.L.mlp.experts.E.down_proj  ...mlp.experts.w2_weight[E - first local] (columns split over the MoE TP)
layers.L.mlp.shared_expert.*      ...mlp.shared_expert.gate_up_proj / down_proj (Qwen2-MoE), split like a dense
                                  MLP; ...mlp.shared_expert_gate.weight replicated
================================  ===============================================================

:func:`sglang_param_shapes` gives the names, shapes and dtypes SGLang allocates; both are checked against
SGLang's own model classes and weight loaders (``integration/awex_integration/checks/sglang_layout_check.py``).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from awex.convert.fused import EXPERT, GATE_UP, LAYER, QKV, fused_mlp_view, kv_heads_per_rank, param_finder, qkv_part
from awex.convert.live import fingerprinted
from awex.meta import Box
from awex.meta.layouts.sglang import SglangParallel, check_mapped, pp_layer_ranges
from awex.meta.models import ModelDims


def sglang_param_name(name: str, tie_embeddings: bool = False, last_stage_only: bool = False) -> str:
    """The SGLang parameter that holds canonical tensor ``name`` (or part of it). ``last_stage_only``: this rank
    is a last pipeline stage that is not the first, where a tied embedding lives in ``lm_head``."""
    if name == "model.embed_tokens.weight" and tie_embeddings and last_stage_only:
        return "lm_head.weight"
    if name == "lm_head.weight" and tie_embeddings:
        return "model.embed_tokens.weight"
    m = LAYER.match(name)
    if not m:
        return name
    pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if q := QKV.match(rest):
        return pre + "self_attn.qkv_proj." + q.group(2)
    if e := EXPERT.match(rest):
        return pre + "mlp.experts." + ("w2_weight" if e.group(2) == "down" else "w13_weight")
    if g := GATE_UP.match(rest):
        return pre + g.group(1) + ".gate_up_proj." + g.group(3)
    return name


def _local_experts(dims: ModelDims, parallel: SglangParallel, rank: int) -> range:
    per = dims.num_experts // parallel.ep
    ep_rank = parallel.ranks(rank)["moe_ep"]
    return range(ep_rank * per, (ep_rank + 1) * per)


def sglang_param_shapes(dims: ModelDims, parallel: SglangParallel, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one SGLang rank's parameters (``rank`` as SGLang numbers it: ``tp * pp_rank +
    tp_rank``)."""
    check_mapped(dims.architecture, parallel)
    p = parallel
    r = p.ranks(rank)
    attn_tp = p.attn_tp
    vocab_tp = attn_tp if p.attn_dp > 1 else p.tp
    head_tp = attn_tp if p.attn_dp > 1 and (dims.tie_embeddings or p.dp_lm_head) else p.tp
    padded = -(-dims.vocab // p.vocab_pad) * p.vocab_pad
    hd = dims.head_dim
    q_rows = dims.heads // attn_tp * hd
    qkv_rows = q_rows + 2 * kv_heads_per_rank(dims.kv_heads, attn_tp) * hd
    start, stop = pp_layer_ranges(dims.layers, p.pp, p.pp_layers)[r["pp"]]
    first, last = r["pp"] == 0, r["pp"] == p.pp - 1
    shapes: dict[str, tuple[int, ...]] = {}
    if first:
        shapes["model.embed_tokens.weight"] = (padded // vocab_tp, dims.hidden)
    for layer in range(start, stop):
        pre = f"model.layers.{layer}."
        shapes[pre + "self_attn.qkv_proj.weight"] = (qkv_rows, dims.hidden)
        if dims.attention_bias:
            shapes[pre + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        shapes[pre + "self_attn.o_proj.weight"] = (dims.hidden, q_rows)
        if dims.qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (hd,)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        if layer in dims.sparse_layers:
            inter = dims.moe_intermediate // p.moe_tp
            local = dims.num_experts // p.ep
            shapes[pre + "mlp.gate.weight"] = (dims.num_experts, dims.hidden)
            shapes[pre + "mlp.experts.w13_weight"] = (local, 2 * inter, dims.hidden)
            shapes[pre + "mlp.experts.w2_weight"] = (local, dims.hidden, inter)
            if dims.shared_expert_intermediate:
                shared = dims.shared_expert_intermediate // p.tp
                shapes[pre + "mlp.shared_expert.gate_up_proj.weight"] = (2 * shared, dims.hidden)
                shapes[pre + "mlp.shared_expert.down_proj.weight"] = (dims.hidden, shared)
                shapes[pre + "mlp.shared_expert_gate.weight"] = (1, dims.hidden)
        else:
            shapes[pre + "mlp.gate_up_proj.weight"] = (2 * dims.intermediate // p.tp, dims.hidden)
            shapes[pre + "mlp.down_proj.weight"] = (dims.hidden, dims.intermediate // p.tp)
        shapes[pre + "input_layernorm.weight"] = (dims.hidden,)
        shapes[pre + "post_attention_layernorm.weight"] = (dims.hidden,)
    if last:
        shapes["model.norm.weight"] = (dims.hidden,)
        if not dims.tie_embeddings or p.pp > 1:
            shapes["lm_head.weight"] = (padded // head_tp, dims.hidden)
    return shapes


def sglang_param_dtypes(shapes: Mapping[str, tuple[int, ...]], dtype: str) -> dict[str, torch.dtype]:
    """The dtype of each parameter :func:`sglang_param_shapes` names: the model's for all of them."""
    return {name: getattr(torch, dtype) for name in shapes}


def sglang_views(
    params: Mapping[str, torch.Tensor], dims: ModelDims, parallel: SglangParallel, rank: int = 0
) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` over one SGLang rank's parameters (``dict(model.named_parameters())``), with a
    fingerprint of them (``awex.convert.live.fingerprinted``): a steady version checks where each parameter is
    instead of deriving every view again, and views of parameters whose memory moved are re-pointed."""
    check_mapped(dims.architecture, parallel)
    p = parallel
    r = p.ranks(rank)
    last_stage_only = r["pp"] == p.pp - 1 and r["pp"] > 0
    first_expert = _local_experts(dims, p, rank).start if dims.num_experts else 0
    hd = dims.head_dim
    q_rows = dims.heads // p.attn_tp * hd
    kv_rows = kv_heads_per_rank(dims.kv_heads, p.attn_tp) * hd

    find = param_finder(params, "SGLang parameter", f" on rank {rank}")

    def view_of(name: str, box: Box) -> torch.Tensor:
        native = find(sglang_param_name(name, dims.tie_embeddings, last_stage_only))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return native[: box.sizes[0]]  # real rows first, padding after
        m = LAYER.match(name)
        if not m:
            return native
        rest = m.group(2)
        if q := QKV.match(rest):
            return qkv_part(native, q.group(1), q_rows, kv_rows, box.sizes[0])
        mlp = fused_mlp_view(native, rest, first_expert)
        return native if mlp is None else mlp

    return fingerprinted(view_of, params)
