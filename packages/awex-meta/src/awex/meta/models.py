"""Canonical tensors of a model from its HF ``config.json``, per architecture, as small tables.

Each canonical tensor carries a *kind* that engine layouts map to placements (how Megatron or vLLM split it),
its decoder layer (for pipeline stages) and, for experts, its expert index. Adding an architecture means adding
an :class:`Architecture` row to :data:`ARCHITECTURES`, not writing a module.

DeepSeek-V3 (also R1 and Kimi-K2, which share its architecture) and GLM-4.5: multi-head latent attention
(DeepSeek: low-rank ``q_a``/``kv_a`` projections and their norms, per-head ``q_b``/``kv_b`` up-projections), the
first ``first_k_dense_replace`` layers dense, then routed experts beside ``n_shared_experts`` shared ones, a router
whose ``e_score_correction_bias`` stays FP32 whatever the model's dtype. Their multi-token-prediction layers
(``num_nextn_predict_layers``, stored as ``model.layers.<num_hidden_layers + i>``) are not synced: RL trains the
main model, and an engine that drafts with them keeps the ones it loaded (:func:`unsynced_layers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike
from typing import Any, Callable, Mapping

from awex.meta.dtypes import normalize_dtype
from awex.meta.errors import AwexValueError
from awex.meta.spec import TensorSpec

KINDS = (
    "vocab",  # embedding / lm_head rows are the vocabulary (padded and split by engines)
    "q",  # rows per attention head along dim 0 (`heads` of them): query projections, MLA's up-projections
    "kv",  # key or value projection weight or bias: `heads` (KV) heads along dim 0
    "column",  # column-parallel linear: dim 0 split under tensor parallelism
    "row",  # row-parallel linear: dim 1 split under tensor parallelism
    "replicated",  # norms, QK-norms: every tensor-parallel rank holds all of it
    "router",  # MoE router / gate: replicated, precision-sensitive
    "expert_column",  # one expert's gate or up projection
    "expert_row",  # one expert's down projection
)


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    """A canonical tensor with what layouts need to place it."""

    spec: TensorSpec
    kind: str
    layer: int | None = None
    expert: int | None = None
    heads: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AwexValueError(f"{self.spec.name}: unknown tensor kind {self.kind!r} (one of {', '.join(KINDS)})")

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a decoder-only transformer that decide its tensors' shapes."""

    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    num_experts: int = 0
    moe_intermediate: int = 0
    sparse_layers: frozenset[int] = frozenset()
    shared_expert_intermediate: int = 0
    dtype: str = "bfloat16"
    # multi-head latent attention (DeepSeek-V3): low ranks of the query and key/value projections, per-head dims
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers after the main ones: not synced
    qk_norm: bool = False  # per-head RMS norms of queries and keys


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one decoder-only family from another, as data.

    ``attention_bias``: "always", "never" or "config" (read ``attention_bias`` from the config).
    ``qk_norm``: True, False or "config" (read ``use_qk_norm``).
    ``moe``: "" for dense, "qwen3" (experts only), "qwen2" (experts plus a gated shared expert), "deepseek"
    (dense first layers, routed experts plus ``n_shared_experts`` shared ones, a router with an FP32 score bias).
    ``attention``: "gqa" (q/k/v/o projections) or "mla" (multi-head latent attention).
    """

    attention_bias: str = "config"
    qk_norm: bool | str = False
    moe: str = ""
    attention: str = "gqa"


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(attention_bias="config"),
    "MistralForCausalLM": Architecture(attention_bias="never"),
    "Qwen2ForCausalLM": Architecture(attention_bias="always"),
    "Qwen3ForCausalLM": Architecture(attention_bias="config", qk_norm=True),
    "Qwen2MoeForCausalLM": Architecture(attention_bias="always", moe="qwen2"),
    "Qwen3MoeForCausalLM": Architecture(attention_bias="config", qk_norm=True, moe="qwen3"),
    "DeepseekV3ForCausalLM": Architecture(attention_bias="never", moe="deepseek", attention="mla"),
    "Glm4MoeForCausalLM": Architecture(attention_bias="config", qk_norm="config", moe="deepseek"),
}


# configs made in code may lack ``architectures``: their ``model_type`` names the family
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


class UnknownModelError(AwexValueError):
    """The config names an architecture Awex has no table for."""


def load_config(path: str | PathLike[str]) -> dict[str, Any]:
    """Read an HF ``config.json`` (or a model directory containing one)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no model config at {p}") from None
    except ValueError as e:
        raise AwexValueError(f"{p} is not valid JSON: {e}") from None


def table_architecture(config: Mapping[str, Any]) -> str | None:
    """The architecture of :data:`ARCHITECTURES` an HF config names (by ``architectures``, else, for a config made
    in code, by ``model_type``), or ``None``: Awex has no table for the model."""
    archs = config.get("architectures") or []
    if archs:
        return next((a for a in archs if a in ARCHITECTURES), None)
    return MODEL_TYPES.get(str(config.get("model_type")))


def model_dims(config: Mapping[str, Any], dtype: str | None = None) -> ModelDims:
    """Read the dimensions of a supported architecture from an HF config mapping."""
    archs = config.get("architectures") or []
    arch_name = table_architecture(config)
    if arch_name is None:
        raise UnknownModelError(
            f"no table for model architecture {archs or config.get('model_type')!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    arch = ARCHITECTURES[arch_name]

    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise AwexValueError(f"{arch_name} config lacks {key!r}")
        return int(config[key])

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    layers = need("num_hidden_layers")
    bias = {"always": True, "never": False}.get(arch.attention_bias, bool(config.get("attention_bias", False)))
    num_experts = 0
    moe_inter = 0
    sparse: frozenset[int] = frozenset()
    shared = 0
    if arch.moe:
        num_experts = int(
            config.get("num_experts") or config.get("num_local_experts") or 0
        )  # transformers v5 renamed it
        moe_inter = int(config.get("moe_intermediate_size") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        only_mlp = set(config.get("mlp_only_layers") or [])
        if num_experts:
            sparse = frozenset(i for i in range(layers) if i not in only_mlp and (i + 1) % step == 0)
        if arch.moe == "qwen2":
            shared = int(config.get("shared_expert_intermediate_size") or 0)
        if arch.moe == "deepseek":
            num_experts = int(config.get("n_routed_experts") or 0)
            first_dense = int(config.get("first_k_dense_replace") or 0)
            freq = int(config.get("moe_layer_freq") or 1)
            sparse = frozenset(i for i in range(layers) if i >= first_dense and (i - first_dense) % freq == 0)
            shared = moe_inter * int(config.get("n_shared_experts") or 0)
    mla = {}
    if arch.attention == "mla":
        mla = dict(
            q_lora_rank=int(config.get("q_lora_rank") or 0),  # 0: a plain q_proj (DeepSeek-V2-Lite)
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_dim=need("qk_nope_head_dim"),
            qk_rope_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        )
        head_dim = mla["qk_nope_dim"] + mla["qk_rope_dim"]
    cfg_dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return ModelDims(
        architecture=arch_name,
        hidden=hidden,
        intermediate=int(config.get("intermediate_size") or 0),
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=need("vocab_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        num_experts=num_experts,
        moe_intermediate=moe_inter,
        sparse_layers=sparse,
        shared_expert_intermediate=shared,
        dtype=normalize_dtype(dtype or str(cfg_dtype)),
        mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
        qk_norm=arch.qk_norm if isinstance(arch.qk_norm, bool) else bool(config.get("use_qk_norm", False)),
        **mla,
    )


Entry = tuple[str, str, Callable[[ModelDims], tuple[int, ...]]]

_ATTENTION: list[Entry] = [
    ("self_attn.q_proj.weight", "q", lambda d: (d.heads * d.head_dim, d.hidden)),
    ("self_attn.k_proj.weight", "kv", lambda d: (d.kv_heads * d.head_dim, d.hidden)),
    ("self_attn.v_proj.weight", "kv", lambda d: (d.kv_heads * d.head_dim, d.hidden)),
    ("self_attn.o_proj.weight", "row", lambda d: (d.hidden, d.heads * d.head_dim)),
]
_ATTENTION_BIAS: list[Entry] = [
    ("self_attn.q_proj.bias", "q", lambda d: (d.heads * d.head_dim,)),
    ("self_attn.k_proj.bias", "kv", lambda d: (d.kv_heads * d.head_dim,)),
    ("self_attn.v_proj.bias", "kv", lambda d: (d.kv_heads * d.head_dim,)),
]
_QK_NORM: list[Entry] = [
    ("self_attn.q_norm.weight", "replicated", lambda d: (d.head_dim,)),
    ("self_attn.k_norm.weight", "replicated", lambda d: (d.head_dim,)),
]
_NORMS: list[Entry] = [
    ("input_layernorm.weight", "replicated", lambda d: (d.hidden,)),
    ("post_attention_layernorm.weight", "replicated", lambda d: (d.hidden,)),
]
_DENSE_MLP: list[Entry] = [
    ("mlp.gate_proj.weight", "column", lambda d: (d.intermediate, d.hidden)),
    ("mlp.up_proj.weight", "column", lambda d: (d.intermediate, d.hidden)),
    ("mlp.down_proj.weight", "row", lambda d: (d.hidden, d.intermediate)),
]
_DENSE_MLP_BIAS: list[Entry] = [
    ("mlp.gate_proj.bias", "column", lambda d: (d.intermediate,)),
    ("mlp.up_proj.bias", "column", lambda d: (d.intermediate,)),
    ("mlp.down_proj.bias", "replicated", lambda d: (d.hidden,)),
]
_EXPERT: list[Entry] = [
    ("gate_proj.weight", "expert_column", lambda d: (d.moe_intermediate, d.hidden)),
    ("up_proj.weight", "expert_column", lambda d: (d.moe_intermediate, d.hidden)),
    ("down_proj.weight", "expert_row", lambda d: (d.hidden, d.moe_intermediate)),
]
_MLA: list[Entry] = [  # DeepSeek-V3's multi-head latent attention (with a low-rank query projection)
    ("self_attn.q_a_proj.weight", "replicated", lambda d: (d.q_lora_rank, d.hidden)),
    ("self_attn.q_a_layernorm.weight", "replicated", lambda d: (d.q_lora_rank,)),
    ("self_attn.q_b_proj.weight", "q", lambda d: (d.heads * (d.qk_nope_dim + d.qk_rope_dim), d.q_lora_rank)),
    ("self_attn.kv_a_proj_with_mqa.weight", "replicated", lambda d: (d.kv_lora_rank + d.qk_rope_dim, d.hidden)),
    ("self_attn.kv_a_layernorm.weight", "replicated", lambda d: (d.kv_lora_rank,)),
    ("self_attn.kv_b_proj.weight", "q", lambda d: (d.heads * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank)),
    ("self_attn.o_proj.weight", "row", lambda d: (d.hidden, d.heads * d.v_head_dim)),
]
_MLA_PLAIN_Q: list[Entry] = [  # no low-rank query projection (q_lora_rank unset, as DeepSeek-V2-Lite)
    ("self_attn.q_proj.weight", "q", lambda d: (d.heads * (d.qk_nope_dim + d.qk_rope_dim), d.hidden)),
]
_DEEPSEEK_SHARED: list[Entry] = [  # n_shared_experts shared experts, held as one MLP of their summed width
    ("mlp.shared_experts.gate_proj.weight", "column", lambda d: (d.shared_expert_intermediate, d.hidden)),
    ("mlp.shared_experts.up_proj.weight", "column", lambda d: (d.shared_expert_intermediate, d.hidden)),
    ("mlp.shared_experts.down_proj.weight", "row", lambda d: (d.hidden, d.shared_expert_intermediate)),
]
_SHARED_EXPERT: list[Entry] = [
    ("mlp.shared_expert.gate_proj.weight", "column", lambda d: (d.shared_expert_intermediate, d.hidden)),
    ("mlp.shared_expert.up_proj.weight", "column", lambda d: (d.shared_expert_intermediate, d.hidden)),
    ("mlp.shared_expert.down_proj.weight", "row", lambda d: (d.hidden, d.shared_expert_intermediate)),
    ("mlp.shared_expert_gate.weight", "replicated", lambda d: (1, d.hidden)),
]


def canonical_tensors(config: Mapping[str, Any] | ModelDims, dtype: str | None = None) -> list[CanonicalTensor]:
    """Every canonical tensor of the model, sorted by name.

    ``dtype`` overrides the config's ``torch_dtype`` for all tensors. Tied embeddings (``tie_word_embeddings``)
    have no ``lm_head.weight``: engines serve it from ``model.embed_tokens.weight``.
    """
    d = config if isinstance(config, ModelDims) else model_dims(config, dtype)
    if dtype is not None and isinstance(config, ModelDims):
        from dataclasses import replace

        d = replace(d, dtype=normalize_dtype(dtype))
    arch = ARCHITECTURES[d.architecture]
    out: list[CanonicalTensor] = []

    def add(
        name: str, kind: str, shape: tuple[int, ...], layer: int | None = None, expert: int | None = None, dtype=None
    ) -> None:
        heads = d.heads if kind == "q" else d.kv_heads if kind == "kv" else None
        out.append(CanonicalTensor(TensorSpec(name, shape, dtype or d.dtype), kind, layer, expert, heads))

    add("model.embed_tokens.weight", "vocab", (d.vocab, d.hidden))
    add("model.norm.weight", "replicated", (d.hidden,))
    if not d.tie_embeddings:
        add("lm_head.weight", "vocab", (d.vocab, d.hidden))
    for layer in range(d.layers):
        prefix = f"model.layers.{layer}."
        if arch.attention == "mla":
            entries = list(_MLA if d.q_lora_rank else [e for e in _MLA if "q_a_" not in e[0] and "q_b_" not in e[0]])
            entries += [] if d.q_lora_rank else _MLA_PLAIN_Q
            entries += _NORMS
        else:
            entries = list(_ATTENTION) + list(_NORMS)
        if d.attention_bias:
            entries += _ATTENTION_BIAS
        if d.qk_norm:
            entries += _QK_NORM
        if layer in d.sparse_layers:
            add(prefix + "mlp.gate.weight", "router", (d.num_experts, d.hidden), layer)
            if arch.moe == "deepseek":  # the router's score bias, kept in FP32 whatever the model's dtype
                add(prefix + "mlp.gate.e_score_correction_bias", "router", (d.num_experts,), layer, dtype="float32")
            for e in range(d.num_experts):
                for suffix, kind, shape in _EXPERT:
                    add(f"{prefix}mlp.experts.{e}.{suffix}", kind, shape(d), layer, e)
            if arch.moe == "qwen2" and d.shared_expert_intermediate:
                entries += _SHARED_EXPERT
            if arch.moe == "deepseek" and d.shared_expert_intermediate:
                entries += _DEEPSEEK_SHARED
        else:
            entries += _DENSE_MLP
            if d.mlp_bias:
                entries += _DENSE_MLP_BIAS
        for suffix, kind, shape in entries:
            add(prefix + suffix, kind, shape(d), layer)
    out.sort(key=lambda t: t.name)
    return out


def unsynced_layers(config: Mapping[str, Any] | ModelDims) -> list[str]:
    """Name prefixes of a model's layers that are not canonical tensors and never synced: the multi-token-prediction
    layers (``model.layers.<num_hidden_layers + i>.``) of DeepSeek-V3 / GLM-4.5 checkpoints."""
    d = config if isinstance(config, ModelDims) else model_dims(config)
    return [f"model.layers.{d.layers + i}." for i in range(d.mtp_layers)]
