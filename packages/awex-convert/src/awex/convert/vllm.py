"""vLLM's own parameters (Llama, Mistral, Qwen2/3 and their MoE, DeepSeek-V3, GLM-4.5) as canonical boxes.

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
layers.L.mlp.gate (MoE router)    ...mlp.gate.weight, replicated
layers.L.mlp.experts.E.{gate,up}  ...mlp.experts.routed_experts.w13_weight[e] = [gate shard; up shard] of
                                  local expert e
layers.L.mlp.experts.E.down_proj  ...mlp.experts.routed_experts.w2_weight[e] (columns split); with expert
                                  parallelism each rank holds its own experts whole (linear placement)
layers.L.mlp.shared_expert.*      ...mlp.shared_expert.gate_up_proj / down_proj (Qwen2-MoE), split like a
                                  dense MLP; ...mlp.shared_expert_gate.weight replicated
layers.L.self_attn.q_a_proj,      ...self_attn.fused_qkv_a_proj.weight = [q_a_proj; kv_a_proj_with_mqa],
  kv_a_proj_with_mqa              replicated (DeepSeek-V3 multi-head latent attention)
layers.L.self_attn.{q_b,kv_b,o}   same names: q_b_proj / kv_b_proj rows split by heads, o_proj columns
layers.L.mlp.shared_experts.*     ...mlp.shared_experts.gate_up_proj / down_proj (DeepSeek), like a dense MLP
layers.L.mlp.gate.e_score_...     same name, float32, replicated
layers.L.mlp.gate.weight (GLM)    same name, float32 whatever the model's dtype (vLLM's GateLinear)
================================  ===============================================================

:func:`vllm_param_name` says which native parameter holds a canonical tensor.

:func:`vllm_param_shapes` gives the names and shapes vLLM allocates (checked against vLLM's recorded loading
shapes on CPU), so benchmarks can hold tensors in vLLM's exact layout without the engine.

FP8 block-quantised engines (``quant``): each quantised linear also holds ``weight_scale_inv``, one float32 per
tile, fused the same way as its weight (``qkv_proj.weight_scale_inv`` = [q tiles | k tiles | v tiles] of this
rank; vLLM requires every partition to be whole tiles).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from awex.convert.fused import EXPERT as _EXPERT
from awex.convert.fused import GATE_UP as _GATE_UP
from awex.convert.fused import LAYER as _LAYER
from awex.convert.fused import QKV as _QKV
from awex.convert.fused import QKV_A as _QKV_A
from awex.convert.fused import fused_mlp_view, kv_heads_per_rank, param_finder, qkv_part
from awex.convert.live import fingerprinted
from awex.convert.unsupported import refuse_unconverted
from awex.meta import Box
from awex.meta.errors import AwexValueError
from awex.meta.layouts import VllmParallel
from awex.meta.layouts.vllm import FP32_ROUTERS, expert_owner, pp_layer_ranges
from awex.meta.models import ARCHITECTURES, ModelDims
from awex.meta.quant import SCALE_SUFFIX, Fp8BlockQuant

MAPPED = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")  # architectures with latent attention / DeepSeek MoE mapped


def vllm_param_name(name: str, tie_embeddings: bool = False, latent_q: bool = True) -> str:
    """The vLLM parameter that holds canonical tensor ``name`` (or part of it): ``q_proj`` / ``k_proj`` /
    ``v_proj`` live in ``qkv_proj``, ``gate_proj`` / ``up_proj`` in ``gate_up_proj``, expert ``E``'s
    projections in ``experts.routed_experts.w13_weight`` / ``w2_weight`` (vLLM 0.32's names), a tied ``lm_head`` in
    ``embed_tokens``, DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` in ``fused_qkv_a_proj`` (``latent_q``: the
    model has a low-rank query projection; without one ``kv_a_proj_with_mqa`` keeps its name);
    FP8 scales follow their weights. Every other name is the same in vLLM."""
    if name == "lm_head.weight" and tie_embeddings:
        return "model.embed_tokens.weight"
    m = _LAYER.match(name)
    if not m:
        return name
    pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
    suffix = SCALE_SUFFIX if rest.endswith(SCALE_SUFFIX) else ""
    if q := _QKV.match(rest):
        return pre + "self_attn.qkv_proj." + q.group(2)
    if _QKV_A.match(rest) and latent_q:
        return pre + "self_attn.fused_qkv_a_proj.weight"
    if e := _EXPERT.match(rest):
        return pre + "mlp.experts.routed_experts." + ("w2_weight" if e.group(2) == "down" else "w13_weight") + suffix
    if g := _GATE_UP.match(rest):
        return pre + g.group(1) + ".gate_up_proj." + g.group(3)
    return name


def _kv_local(dims: ModelDims, tp: int) -> int:
    return kv_heads_per_rank(dims.kv_heads, tp)


def _local_experts(dims: ModelDims, parallel: VllmParallel, tp_rank: int, dp_rank: int) -> range:
    """The experts one rank holds (all of them, each TP-sliced, without expert parallelism)."""
    if not parallel.ep:
        return range(dims.num_experts)
    ep_rank = dp_rank * parallel.tp + tp_rank
    mine = [
        e for e in range(dims.num_experts) if expert_owner(e, dims.num_experts, parallel.dp * parallel.tp) == ep_rank
    ]
    return range(mine[0], mine[-1] + 1) if mine else range(0)


def vllm_param_shapes(
    dims: ModelDims,
    parallel: VllmParallel,
    tp_rank: int = 0,
    pp_rank: int = 0,
    quant: Fp8BlockQuant | None = None,
    dp_rank: int = 0,
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one vLLM rank's parameters (with ``quant``, FP8 weights' scales too)."""
    refuse_unconverted(dims, "vllm", MAPPED)
    arch = ARCHITECTURES[dims.architecture]
    if quant is not None and arch.attention == "mla":
        raise AwexValueError("vllm: FP8 engines of multi-head latent attention models are not mapped yet")
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
        if arch.attention == "mla":
            shapes.update(_latent_attention_shapes(pre, dims, tp))
        else:
            shapes[pre + "self_attn.qkv_proj.weight"] = (qkv_rows, dims.hidden)
            shapes[pre + "self_attn.o_proj.weight"] = (dims.hidden, q_rows)
        if dims.attention_bias:
            shapes[pre + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if dims.qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (hd,)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        if layer in dims.sparse_layers:
            local = len(_local_experts(dims, parallel, tp_rank, dp_rank))
            inter = dims.moe_intermediate if parallel.ep else dims.moe_intermediate // tp
            shapes[pre + "mlp.gate.weight"] = (dims.num_experts, dims.hidden)
            if arch.moe == "deepseek":
                shapes[pre + "mlp.gate.e_score_correction_bias"] = (dims.num_experts,)
            shapes[pre + "mlp.experts.routed_experts.w13_weight"] = (local, 2 * inter, dims.hidden)
            shapes[pre + "mlp.experts.routed_experts.w2_weight"] = (local, dims.hidden, inter)
            if dims.shared_expert_intermediate and arch.moe == "deepseek":
                shared = dims.shared_expert_intermediate // tp
                shapes[pre + "mlp.shared_experts.gate_up_proj.weight"] = (2 * shared, dims.hidden)
                shapes[pre + "mlp.shared_experts.down_proj.weight"] = (dims.hidden, shared)
            elif dims.shared_expert_intermediate:
                shared = dims.shared_expert_intermediate // tp
                shapes[pre + "mlp.shared_expert.gate_up_proj.weight"] = (2 * shared, dims.hidden)
                shapes[pre + "mlp.shared_expert.down_proj.weight"] = (dims.hidden, shared)
                shapes[pre + "mlp.shared_expert_gate.weight"] = (1, dims.hidden)
        else:
            shapes[pre + "mlp.gate_up_proj.weight"] = (2 * dims.intermediate // tp, dims.hidden)
            shapes[pre + "mlp.down_proj.weight"] = (dims.hidden, dims.intermediate // tp)
        shapes[pre + "input_layernorm.weight"] = (dims.hidden,)
        shapes[pre + "post_attention_layernorm.weight"] = (dims.hidden,)
    if pp_rank == parallel.pp - 1:
        shapes["model.norm.weight"] = (dims.hidden,)
        if not dims.tie_embeddings:
            shapes["lm_head.weight"] = (padded // tp, dims.hidden)
    if quant is not None:
        for name, shape in list(shapes.items()):
            if name.endswith(_FUSED_LINEARS) and quant.quantises(_canonical_probe(name), shape):
                shapes[name + SCALE_SUFFIX] = _fused_scale_shape(name, shape, dims, tp, quant)
            elif name.endswith(_EXPERT_WEIGHTS) and quant.quantises(_canonical_probe(name), shape[1:]):
                e, rows, cols = shape
                tiles = (
                    2 * -(-(rows // 2) // quant.block[0]) if name.endswith("w13_weight") else -(-rows // quant.block[0])
                )
                shapes[name + SCALE_SUFFIX] = (e, tiles, -(-cols // quant.block[1]))
    return shapes


def _latent_attention_shapes(pre: str, dims: ModelDims, tp: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's attention on one TP rank (``DeepseekV2MLAAttention``)."""
    heads = dims.heads // tp
    a = pre + "self_attn."
    kv_a = dims.kv_lora_rank + dims.qk_rope_dim
    out: dict[str, tuple[int, ...]] = {}
    if dims.q_lora_rank:
        out[a + "fused_qkv_a_proj.weight"] = (dims.q_lora_rank + kv_a, dims.hidden)
        out[a + "q_a_layernorm.weight"] = (dims.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (heads * (dims.qk_nope_dim + dims.qk_rope_dim), dims.q_lora_rank)
    else:
        out[a + "q_proj.weight"] = (heads * (dims.qk_nope_dim + dims.qk_rope_dim), dims.hidden)
        out[a + "kv_a_proj_with_mqa.weight"] = (kv_a, dims.hidden)
    out[a + "kv_a_layernorm.weight"] = (dims.kv_lora_rank,)
    out[a + "kv_b_proj.weight"] = (heads * (dims.qk_nope_dim + dims.v_head_dim), dims.kv_lora_rank)
    out[a + "o_proj.weight"] = (dims.hidden, heads * dims.v_head_dim)
    return out


def vllm_param_dtypes(
    shapes: Mapping[str, tuple[int, ...]], dtype: str, quant: Fp8BlockQuant | None = None, architecture: str = ""
) -> dict[str, torch.dtype]:
    """The dtype of each parameter :func:`vllm_param_shapes` names: the quantised dtype for weights that have a
    scale; float32 for the scales, DeepSeek's router score bias and the router weight where ``architecture`` is
    one of :data:`~awex.meta.layouts.vllm.FP32_ROUTERS` (GLM-4.5); ``dtype`` (the model's, e.g. ``"bfloat16"``)
    for everything else."""
    plain = getattr(torch, dtype)
    fp8 = getattr(torch, quant.dtype) if quant is not None else None
    fp32 = FP32_SUFFIXES + (("mlp.gate.weight",) if architecture in FP32_ROUTERS else ())
    out = {}
    for name in shapes:
        if name.endswith(SCALE_SUFFIX) or name.endswith(fp32):
            out[name] = torch.float32
        elif fp8 is not None and name + SCALE_SUFFIX in shapes:
            out[name] = fp8
        else:
            out[name] = plain
    return out


_EXPERT_WEIGHTS = ("experts.w13_weight", "experts.w2_weight")
FP32_SUFFIXES = ("e_score_correction_bias",)  # held in float32 whatever the model's dtype


_FUSED_LINEARS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def _canonical_probe(native: str) -> str:
    """A canonical name of one of the projections a native fused linear holds (for quant.quantises)."""
    return (
        native.replace("qkv_proj", "q_proj")
        .replace("gate_up_proj", "gate_proj")
        .replace("experts.w13_weight", "experts.0.gate_proj.weight")
        .replace("experts.w2_weight", "experts.0.down_proj.weight")
    )


def _fused_scale_shape(
    name: str, shape: tuple[int, ...], dims: ModelDims, tp: int, quant: Fp8BlockQuant
) -> tuple[int, int]:
    """Tiles of each fused partition, stacked (vLLM's per-partition scale rows)."""
    br, bc = quant.block
    cols = -(-shape[1] // bc)
    if name.endswith("qkv_proj.weight"):
        q_rows = dims.heads // tp * dims.head_dim
        kv_rows = _kv_local(dims, tp) * dims.head_dim
        return (-(-q_rows // br) + 2 * -(-kv_rows // br), cols)
    if name.endswith("gate_up_proj.weight"):
        return (2 * -(-(shape[0] // 2) // br), cols)
    return (-(-shape[0] // br), cols)


def vllm_views(
    params: Mapping[str, torch.Tensor],
    dims: ModelDims,
    parallel: VllmParallel,
    fp8_block: tuple[int, int] = (128, 128),
    tp_rank: int = 0,
    dp_rank: int = 0,
) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` over one vLLM rank's parameters (``dict(model.named_parameters())``).

    FP8 scales (``X.weight_scale_inv``) are found in the fused ``weight_scale_inv`` parameters, in
    ``fp8_block`` tiles. With expert parallelism, ``tp_rank`` and ``dp_rank`` say which experts are local.
    """
    refuse_unconverted(dims, "vllm", MAPPED)
    latent_q = bool(dims.q_lora_rank)
    first_expert = _local_experts(dims, parallel, tp_rank, dp_rank).start if dims.num_experts else 0
    tp = parallel.tp
    hd = dims.head_dim
    q_rows = dims.heads // tp * hd
    kv_rows = _kv_local(dims, tp) * hd

    find = param_finder(params, "vLLM parameter")

    def view_of(name: str, box: Box) -> torch.Tensor:
        native = find(vllm_param_name(name, dims.tie_embeddings, latent_q))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return native[: box.sizes[0]]  # real rows first, padding after
        m = _LAYER.match(name)
        if not m:
            return native
        rest = m.group(2)
        scale = rest.endswith(SCALE_SUFFIX)
        if q := _QKV.match(rest):
            if scale:  # tiles of each partition
                return qkv_part(
                    native, q.group(1), -(-q_rows // fp8_block[0]), -(-kv_rows // fp8_block[0]), box.sizes[0]
                )
            return qkv_part(native, q.group(1), q_rows, kv_rows, box.sizes[0])
        if (a := _QKV_A.match(rest)) and latent_q:  # fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]
            return native[: dims.q_lora_rank] if a.group(1) == "q_a_proj" else native[dims.q_lora_rank :]
        mlp = fused_mlp_view(native, rest, first_expert)
        return native if mlp is None else mlp

    return fingerprinted(view_of, params)
