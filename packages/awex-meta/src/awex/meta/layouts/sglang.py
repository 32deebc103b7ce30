"""SGLang's layout: which rank of an SGLang engine holds which box of each canonical tensor.

An SGLang engine of ``tp * pp`` ranks numbers them as SGLang's launcher does (``rank = tp * pp_rank + tp_rank``).
Its TP group of ``tp`` ranks is cut three ways, each tensor following the group its layer is built on:

- **tp** (``tp``): dense MLPs (``gate_up_proj`` rows, ``down_proj`` columns) and, without DP attention or with it
  but without ``dp_lm_head``, ``lm_head``.
- **attention** (``attn_dp`` x ``tp / attn_dp``, attention TP fastest): ``qkv_proj`` (query heads split, KV heads
  split or replicated when the attention TP exceeds them), ``o_proj`` columns, and with DP attention the embedding
  (and ``lm_head`` with ``dp_lm_head``); each attention-DP group holds a whole copy.
- **MoE** (``moe_dp`` x ``ep`` x ``tp / ep / moe_dp``, MoE TP fastest): expert ``e`` lives on EP rank
  ``e // (experts / ep)`` (contiguous blocks: ``experts`` must divide by ``ep``), its ``w13`` rows and ``w2``
  columns split over the MoE TP ranks; replicated over ``moe_dp``.

Vocabularies are padded to a multiple of 64 and split in equal blocks. Pipeline stages follow SGLang's
``get_pp_indices``: extra layers go to the *last* stages (vLLM gives them to the stages before the last);
``SGLANG_PP_LAYER_PARTITION`` is the engine's own override: pass the same list as ``pp_layers``. With tied
embeddings and ``pp > 1`` the last stage holds a copy of the embedding as ``lm_head``.

Mapped: Llama, Mistral, Qwen2, Qwen3 (dense) and Qwen2-MoE / Qwen3-MoE. DP attention (``attn_dp > 1``) is mapped
for the model classes that build their attention on the attention-TP group (Qwen3, Qwen3-MoE, Qwen2-MoE); SGLang's
Llama and Qwen2 classes keep attention on the whole TP group and only some of their embeddings on the attention
group, so DP attention is refused for them. Latent-attention models (DeepSeek, GLM-4.5) and FP8 engines are not
mapped for SGLang yet (refused). Each of these rules is checked against SGLang's own classes
(``integration/awex_integration/checks/sglang_layout_check.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from awex.meta.errors import AwexValueError
from awex.meta.layout import Layout, Mesh, MeshSharding, Pin, Shard, TensorLayout
from awex.meta.layouts.common import check_divides, kv_head_shard, pad_to
from awex.meta.models import CanonicalTensor, canonical_tensors
from awex.meta.quant import Fp8BlockQuant
from awex.meta.spec import Role

VOCAB_PADDING = 64
MAPPED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
DP_ATTENTION_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class SglangParallel:
    """One SGLang engine's parallel sizes, as its server arguments name them (``--tp-size``, ``--pp-size``,
    ``--ep-size``, ``--dp-size`` with ``--enable-dp-attention`` as ``attn_dp``, ``--moe-dp-size``,
    ``--enable-dp-lm-head``). ``pp_layers``: layers per stage when ``SGLANG_PP_LAYER_PARTITION`` is set."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    attn_dp: int = 1
    moe_dp: int = 1
    dp_lm_head: bool = False
    vocab_pad: int = VOCAB_PADDING
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "attn_dp", "moe_dp", "vocab_pad"):
            if getattr(self, name) < 1:
                raise AwexValueError(f"sglang: {name} must be positive, got {getattr(self, name)}")
        check_divides("sglang: tp must divide by attn_dp", self.attn_dp, self.tp)
        check_divides("sglang: tp must divide by ep * moe_dp", self.ep * self.moe_dp, self.tp)
        if self.dp_lm_head and self.attn_dp == 1:
            raise AwexValueError("sglang: dp_lm_head needs DP attention (attn_dp > 1)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.attn_dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep // self.moe_dp

    def ranks(self, rank: int) -> dict[str, int]:
        """A rank's coordinates in SGLang's groups (``derive_spawn_ranks``): pp, tp, attention DP/TP, MoE
        DP/EP/TP."""
        if not 0 <= rank < self.world_size:
            raise AwexValueError(f"sglang: rank {rank} outside the engine's {self.world_size} ranks")
        tp_rank = rank % self.tp
        per_moe_dp = self.tp // self.moe_dp
        return {
            "pp": rank // self.tp,
            "tp": tp_rank,
            "attn_dp": tp_rank // self.attn_tp,
            "attn_tp": tp_rank % self.attn_tp,
            "moe_dp": tp_rank // per_moe_dp,
            "moe_ep": tp_rank % per_moe_dp // self.moe_tp,
            "moe_tp": tp_rank % self.moe_tp,
        }


def pp_layer_ranges(layers: int, pp: int, partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """SGLang's split of decoder layers over pipeline stages (``get_pp_indices``): ``[(start, end), ...]``."""
    if partition is not None:
        if len(partition) != pp or sum(partition) != layers:
            raise AwexValueError(f"sglang: pp_layers {list(partition)} must be {pp} counts summing to {layers}")
        per = list(partition)
    else:
        base, extra = divmod(layers, pp)
        per = [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    out, start = [], 0
    for n in per:
        out.append((start, start + n))
        start += n
    return out


def expert_owner(expert: int, experts: int, ep: int) -> int:
    """The EP rank holding ``expert`` (contiguous blocks of ``experts / ep``)."""
    check_divides("sglang: the number of experts must divide by ep", ep, experts)
    return expert // (experts // ep)


def check_mapped(architecture: str, parallel: SglangParallel) -> None:
    """Raise ``ValueError`` for what this module does not map (before any byte moves)."""
    if architecture not in MAPPED_ARCHITECTURES:
        raise AwexValueError(
            f"sglang: {architecture or 'a model without an architecture'} is not mapped for SGLang "
            f"(mapped: {', '.join(MAPPED_ARCHITECTURES)})"
        )
    if parallel.attn_dp > 1 and architecture not in DP_ATTENTION_ARCHITECTURES:
        raise AwexValueError(
            f"sglang: DP attention (attn_dp={parallel.attn_dp}) is not mapped for {architecture}: SGLang builds its "
            f"attention on the whole TP group (mapped with DP attention: {', '.join(DP_ATTENTION_ARCHITECTURES)})"
        )


def sglang_layout(
    tensors: Sequence[CanonicalTensor], parallel: SglangParallel, architecture: str, instance: str = "sglang"
) -> Layout:
    """The layout of one SGLang engine serving the model (``architecture``, as its HF config names it) with
    ``parallel``."""
    p = parallel
    check_mapped(architecture, p)
    layers = 1 + max((t.layer for t in tensors if t.layer is not None), default=-1)
    if layers and p.pp > layers:
        raise AwexValueError(f"sglang: pp={p.pp} exceeds the model's {layers} layers")
    stage_of = {}
    for s, (a, b) in enumerate(pp_layer_ranges(layers, p.pp, p.pp_layers) if layers else []):
        for layer in range(a, b):
            stage_of[layer] = s
    tied = not any(t.name == "lm_head.weight" for t in tensors)
    experts = 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)
    tp_mesh = Mesh("tp", (("pp", p.pp), ("tp", p.tp)))
    attn = Mesh("attention", (("pp", p.pp), ("adp", p.attn_dp), ("atp", p.attn_tp)))
    moe = Mesh("moe", (("pp", p.pp), ("mdp", p.moe_dp), ("mep", p.ep), ("mtp", p.moe_tp)))
    out = []
    interned: dict[MeshSharding, MeshSharding] = {}
    for t in tensors:
        mesh, split = tp_mesh.name, "tp"
        pl: dict[str, object] = {}
        if t.layer is not None:
            pl["pp"] = Pin((stage_of[t.layer],))
        if t.kind == "vocab":
            on_attention = p.attn_dp > 1 and (t.name == "model.embed_tokens.weight" or tied or p.dp_lm_head)
            mesh, split = (attn.name, "atp") if on_attention else (tp_mesh.name, "tp")
            parts = p.attn_tp if on_attention else p.tp
            padded = pad_to(t.spec.shape[0], p.vocab_pad)
            check_divides(f"sglang: {t.name}: padded vocabulary must divide by its TP", parts, padded)
            pl[split] = Shard(0, block=padded // parts)
            if t.name == "lm_head.weight":
                pl["pp"] = Pin((p.pp - 1,))
            else:
                pl["pp"] = Pin((0, p.pp - 1) if tied else (0,))
        elif t.kind in ("q", "kv") or (t.kind == "row" and ".self_attn." in t.name):
            mesh, split = attn.name, "atp"
            if t.kind == "q":
                check_divides(f"sglang: {t.name}: attention heads must divide by the attention TP", p.attn_tp, t.heads)
                pl[split] = Shard(0)
            elif t.kind == "kv":
                pl[split] = kv_head_shard(f"sglang: {t.name}", t.heads or p.attn_tp, p.attn_tp, "the attention TP")
            else:
                pl[split] = Shard(1)
        elif t.kind == "column":
            pl["tp"] = Shard(0)
        elif t.kind == "row":
            pl["tp"] = Shard(1)
        elif t.kind in ("expert_column", "expert_row"):
            mesh = moe.name
            pl["mep"] = Pin((expert_owner(t.expert, experts, p.ep),))
            pl["mtp"] = Shard(0 if t.kind == "expert_column" else 1)
        elif t.kind in ("replicated", "router"):
            if t.layer is None and t.name == "model.norm.weight":
                pl["pp"] = Pin((p.pp - 1,))
        else:
            raise AwexValueError(f"sglang: no placement for kind {t.kind!r} ({t.name})")
        sharding = MeshSharding(mesh, tuple(pl.items()))
        out.append(TensorLayout(t.spec, interned.setdefault(sharding, sharding)))
    return Layout(instance, Role.INFERENCE, p.world_size, (tp_mesh, attn, moe), tuple(out))


def sglang_engine_layout(
    hf_config: Mapping[str, Any], dtype: str, parallel: SglangParallel, instance: str = "sglang"
) -> Layout:
    """The layout of an SGLang engine from its HF config (canonical tensors in ``dtype``). FP8 and other
    quantised checkpoints raise ``ValueError``: SGLang's quantised parameters are not mapped yet."""
    if Fp8BlockQuant.from_hf_config(hf_config) or hf_config.get("quantization_config"):
        raise AwexValueError("sglang: quantised engines are not mapped for SGLang yet (bf16/fp16/fp32 only)")
    architecture = (hf_config.get("architectures") or [""])[0]
    return sglang_layout(canonical_tensors(hf_config, dtype=dtype), parallel, architecture, instance)
