"""vLLM's layout: which rank of a vLLM engine holds which box of each canonical tensor.

Ranks of one engine are ordered ``(dp, pp, tp)`` (tensor parallel fastest), as vLLM's weight-transfer
backends number them (``dp_rank * tp * pp + rank``).

- ``qkv_proj``: each TP rank holds its query heads; KV heads are split when TP <= KV heads and replicated
  (rank ``r`` holds KV head ``r // (tp / kv_heads)``) when TP exceeds them.
- ``gate_up_proj``: gate and up split along dim 0; ``o_proj``/``down_proj`` along dim 1.
- Vocabulary: padded to a multiple of 64 and split in equal blocks per TP rank; ``lm_head`` tied to the
  embedding when ``tie_word_embeddings`` (the last PP stage then holds the embedding too).
- Pipeline stages: vLLM's ``get_pp_indices`` (extra layers go to the stages before the last).
- Experts: without expert parallelism every TP rank holds a TP slice of every expert; with it
  (``enable_expert_parallel``) expert ``e`` lives whole on one of the ``dp * tp`` EP ranks (linear placement;
  the first ``experts % ep`` ranks take one extra).
- Multi-head latent attention (``DeepseekV2Attention``/MLA): ``q_a_proj`` and ``kv_a_proj_with_mqa`` (fused as
  ``fused_qkv_a_proj``) and their norms replicated, ``q_b_proj``/``kv_b_proj`` split by heads, ``o_proj`` by rows;
  DeepSeek's shared experts are a TP-split MLP, ``e_score_correction_bias`` replicated in FP32.
- GLM-4.5 (``Glm4MoeForCausalLM``): vLLM builds its router (``GateLinear``) with float32 parameters, so the
  engine's ``mlp.gate.weight`` is float32 whatever the model's dtype (a bf16 trainer's router widens exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from awex.meta.errors import AwexValueError
from awex.meta.layout import Layout, Mesh, MeshSharding, Pin, Shard, TensorLayout
from awex.meta.layouts.common import check_divides, kv_head_shard, pad_to
from awex.meta.models import CanonicalTensor, canonical_tensors
from awex.meta.quant import Fp8BlockQuant, quantize_layout
from awex.meta.spec import Role

VOCAB_PADDING = 64
FP32_ROUTERS = ("Glm4MoeForCausalLM",)  # architectures whose router weight vLLM holds in float32


@dataclass(frozen=True)
class VllmParallel:
    """One vLLM engine's parallel sizes; ``ep`` enables expert parallelism over all ``dp * tp`` ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    vocab_pad: int = VOCAB_PADDING

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp


def pp_layer_ranges(layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's default split of decoder layers over pipeline stages: ``[(start, end), ...]`` per stage."""
    per = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        per[-i] += 1
    out = []
    start = 0
    for n in per:
        out.append((start, start + n))
        start += n
    return out


def expert_owner(expert: int, experts: int, ep: int) -> int:
    """The EP rank holding ``expert`` under vLLM's linear expert placement."""
    base, extra = divmod(experts, ep)
    boundary = extra * (base + 1)
    if expert < boundary:
        return expert // (base + 1)
    return extra + (expert - boundary) // base


def vllm_layout(tensors: Sequence[CanonicalTensor], parallel: VllmParallel, instance: str = "vllm") -> Layout:
    """The layout of one vLLM engine serving the model with ``parallel``."""
    p = parallel
    for name in ("tp", "pp", "dp", "vocab_pad"):
        if getattr(p, name) < 1:
            raise AwexValueError(f"vllm: {name} must be positive")
    layers = 1 + max((t.layer for t in tensors if t.layer is not None), default=-1)
    if layers and p.pp > layers:
        raise AwexValueError(f"vllm: pp={p.pp} exceeds the model's {layers} layers")
    stage_of = {}
    for s, (a, b) in enumerate(pp_layer_ranges(layers, p.pp) if layers else []):
        for layer in range(a, b):
            stage_of[layer] = s
    tied = not any(t.name == "lm_head.weight" for t in tensors)
    experts = 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)
    mesh = Mesh("dense", (("dp", p.dp), ("pp", p.pp), ("tp", p.tp)))
    out = []
    interned: dict[MeshSharding, MeshSharding] = {}
    for t in tensors:
        pl: dict[str, object] = {}
        if t.layer is not None:
            pl["pp"] = Pin((stage_of[t.layer],))
        if t.kind == "vocab":
            padded = pad_to(t.spec.shape[0], p.vocab_pad)
            check_divides(f"vllm: {t.name}: padded vocabulary must divide by tp", p.tp, padded)
            pl["tp"] = Shard(0, block=padded // p.tp)
            if t.name == "lm_head.weight":
                pl["pp"] = Pin((p.pp - 1,))
            else:
                pl["pp"] = Pin((0, p.pp - 1) if tied else (0,))
        elif t.kind == "q":
            check_divides(f"vllm: {t.name}: attention heads must divide by tp", p.tp, t.heads or p.tp)
            pl["tp"] = Shard(0)
        elif t.kind == "kv":
            pl["tp"] = kv_head_shard(f"vllm: {t.name}", t.heads or p.tp, p.tp)
        elif t.kind == "column":
            pl["tp"] = Shard(0)
        elif t.kind == "row":
            pl["tp"] = Shard(1)
        elif t.kind in ("expert_column", "expert_row"):
            if p.ep:
                owner = expert_owner(t.expert, experts, p.dp * p.tp)
                pl["dp"] = Pin((owner // p.tp,))
                pl["tp"] = Pin((owner % p.tp,))
            else:
                pl["tp"] = Shard(0 if t.kind == "expert_column" else 1)
        elif t.kind in ("replicated", "router"):
            if t.layer is None and t.name == "model.norm.weight":
                pl["pp"] = Pin((p.pp - 1,))
        else:
            raise AwexValueError(f"vllm: no placement for kind {t.kind!r} ({t.name})")
        sharding = MeshSharding("dense", tuple(pl.items()))
        out.append(TensorLayout(t.spec, interned.setdefault(sharding, sharding)))
    return Layout(instance, Role.INFERENCE, p.world_size, (mesh,), tuple(out))


def vllm_engine_layout(
    hf_config: Mapping[str, Any], dtype: str, parallel: VllmParallel, instance: str = "vllm"
) -> Layout:
    """The layout of a vLLM engine from its HF config: canonical tensors in ``dtype`` placed by
    :func:`vllm_layout`, in their FP8 form (weights + ``weight_scale_inv``) when the config declares FP8 block
    quantisation. Other quantisation methods raise ``ValueError`` (Awex does not move them)."""
    layout = vllm_layout(vllm_tensors(hf_config, dtype), parallel, instance=instance)
    quant = Fp8BlockQuant.from_hf_config(hf_config)
    return quantize_layout(layout, quant, sender=False) if quant else layout


def vllm_tensors(hf_config: Mapping[str, Any], dtype: str | None = None) -> list[CanonicalTensor]:
    """The canonical tensors of a model in the dtypes a vLLM engine holds them: those of
    :func:`~awex.meta.models.canonical_tensors`, with the router weights of :data:`FP32_ROUTERS` in float32."""
    tensors = canonical_tensors(hf_config, dtype=dtype)
    if not set(hf_config.get("architectures") or ()) & set(FP32_ROUTERS):
        return tensors
    return [
        replace(t, spec=replace(t.spec, dtype="float32"))
        if t.kind == "router" and t.name.endswith(".gate.weight")
        else t
        for t in tensors
    ]
