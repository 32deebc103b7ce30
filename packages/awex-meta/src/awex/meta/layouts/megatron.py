"""Megatron-core's layout: which rank of a Megatron job holds which box of each canonical tensor.

Ranks follow Megatron's default order ``tp-cp-ep-dp-pp`` (tensor parallel fastest): the dense grid is the mesh
``(pp, dp, cp, tp)``; the expert grid over the same ranks is ``(pp, edp, ep, etp)`` with
``edp = tp * cp * dp / (etp * ep)``.

- Fused ``linear_qkv`` is split by query groups, so each TP rank holds a contiguous run of query heads and of
  KV heads: canonical q/k/v are each split evenly along dim 0 (KV heads must divide by TP).
- ``linear_fc1`` holds ``[gate_shard; up_shard]``: canonical gate/up are split along dim 0; row-parallel
  ``linear_proj``/``linear_fc2`` along dim 1.
- The vocabulary is padded to a multiple of ``vocab_pad * tp`` (``--make-vocab-size-divisible-by``, default
  128) and split in equal blocks; rows past the real vocabulary are padding, not canonical data.
- Pipeline stages: layer ``L`` belongs to chunk ``L // (layers / (pp * vpp))`` and that chunk to stage
  ``chunk % pp``; uneven pipelines give the first and last stage ``first``/``last`` layers
  (``--decoder-first/last-pipeline-num-layers``) and split the rest evenly; the embedding is on the first stage, final
  norm and output layer on the last. With tied
  embeddings the last stage keeps a copy of the embedding as its output layer.
- Experts: expert ``e`` lives on EP rank ``e // (experts / ep)``, split over expert-TP (``etp``) like a dense MLP.
- Multi-head latent attention (DeepSeek-V3, Kimi-K2) as Megatron-core's Transformer Engine spec builds it: the
  down-projections (``linear_q_down_proj``, ``linear_kv_down_proj``) and their norms duplicated on every TP rank,
  the up-projections (``linear_q_up_proj``, ``linear_kv_up_proj``) split by heads, ``linear_proj`` by rows.
  Shared experts are one TP-split MLP; the router's score bias (``expert_bias``) is held whole by every rank.
  The local (non-TE) spec splits the down-projections over TP instead (ColumnParallelLinear, an even row split):
  ``latent_down_split``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from awex.meta.errors import AwexValueError
from awex.meta.layout import Layout, Mesh, MeshSharding, Pin, Shard, TensorLayout
from awex.meta.layouts.common import check_divides, pad_to
from awex.meta.models import CanonicalTensor
from awex.meta.spec import Role


@dataclass(frozen=True)
class MegatronParallel:
    """A Megatron job's parallel sizes. ``etp`` is expert-tensor parallelism (RL MoE setups use 1)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    vocab_pad: int = 128
    first: int = 0  # layers on the first stage of an uneven pipeline (0: even split)
    last: int = 0  # layers on the last stage of an uneven pipeline (0: even split)
    latent_down_split: bool = False  # MLA down-projections split over TP (local spec), not duplicated (TE spec)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)


def megatron_layout(
    tensors: Sequence[CanonicalTensor], parallel: MegatronParallel, instance: str = "trainer"
) -> Layout:
    """The layout of a Megatron-core GPT model trained with ``parallel``."""
    p = parallel
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "vocab_pad"):
        if getattr(p, name) < 1:
            raise AwexValueError(f"megatron: {name} must be positive")
    check_divides("megatron: tp*cp*dp must be divisible by etp*ep", p.etp * p.ep, p.tp * p.cp * p.dp)
    layers = 1 + max((t.layer for t in tensors if t.layer is not None), default=-1)
    stage = pipeline_stages(layers, p)
    tied = not any(t.name == "lm_head.weight" for t in tensors)
    experts = 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)
    if experts:
        check_divides("megatron: experts must divide by ep", p.ep, experts)
    dense = Mesh("dense", (("pp", p.pp), ("dp", p.dp), ("cp", p.cp), ("tp", p.tp)))
    expert = Mesh("expert", (("pp", p.pp), ("edp", p.edp), ("ep", p.ep), ("etp", p.etp)))

    out = []
    interned: dict[MeshSharding, MeshSharding] = {}
    for t in tensors:
        pl: list = []
        mesh = "dense"
        if t.layer is not None:
            pl.append(("pp", Pin((stage(t.layer),))))
        if t.kind == "vocab":
            vocab = t.spec.shape[0]
            block = pad_to(vocab, p.vocab_pad * p.tp) // p.tp
            pl.append(("tp", Shard(0, block=block)))
            if t.name == "lm_head.weight":
                pl.append(("pp", Pin((p.pp - 1,))))
            else:
                pl.append(("pp", Pin((0, p.pp - 1) if tied else (0,))))
        elif p.latent_down_split and t.name.endswith(_LATENT_DOWN):
            pl.append(("tp", Shard(0)))
        elif t.kind in ("q", "kv"):
            if t.heads is not None:
                check_divides(f"megatron: {t.name}: heads must divide by tp", p.tp, t.heads)
            pl.append(("tp", Shard(0)))
        elif t.kind == "column":
            pl.append(("tp", Shard(0)))
        elif t.kind == "row":
            pl.append(("tp", Shard(1)))
        elif t.kind in ("expert_column", "expert_row"):
            mesh = "expert"
            pl.append(("ep", Pin((t.expert // (experts // p.ep),))))
            pl.append(("etp", Shard(0 if t.kind == "expert_column" else 1)))
        elif t.kind in ("replicated", "router"):
            if t.layer is None and t.name == "model.norm.weight":
                pl.append(("pp", Pin((p.pp - 1,))))
        else:
            raise AwexValueError(f"megatron: no placement for kind {t.kind!r} ({t.name})")
        sharding = MeshSharding(mesh, tuple(_merge_pins(pl)))
        out.append(TensorLayout(t.spec, interned.setdefault(sharding, sharding)))
    return Layout(instance, Role.TRAINER, p.world_size, (dense, expert), tuple(out))


_LATENT_DOWN = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")


def pipeline_stages(layers: int, p: MegatronParallel):
    """A function from decoder layer to pipeline stage, following Megatron's rules."""
    if p.first or p.last:
        if p.vpp != 1:
            raise AwexValueError("megatron: first=/last= (uneven pipeline) with vpp>1 is not supported")
        if p.pp < 2:
            raise AwexValueError("megatron: first=/last= need pp >= 2")
        middle_stages = p.pp - (1 if p.first else 0) - (1 if p.last else 0)
        rest = layers - p.first - p.last
        if rest < 0 or (middle_stages and rest % middle_stages) or (not middle_stages and rest):
            raise AwexValueError(
                f"megatron: {layers} layers do not split as first={p.first}, last={p.last} "
                f"and {middle_stages} even middle stage(s)"
            )
        counts = ([p.first] if p.first else []) + [rest // middle_stages if middle_stages else 0] * middle_stages
        counts += [p.last] if p.last else []
        starts = []
        acc = 0
        for c in counts:
            starts.append(acc)
            acc += c
        return lambda layer: max(i for i, s in enumerate(starts) if s <= layer)
    chunks = p.pp * p.vpp
    if layers % chunks:
        raise AwexValueError(
            f"megatron: {layers} layers do not divide into pp*vpp={chunks} equal chunks; "
            f"give an uneven pipeline, e.g. first={_suggest(layers, p.pp)}"
        )
    per_chunk = layers // chunks
    return lambda layer: (layer // per_chunk) % p.pp


def _suggest(layers: int, pp: int) -> str:
    for middle in range(layers // pp + 1, 0, -1):
        rest = layers - middle * (pp - 2)
        if rest > 0 and rest % 2 == 0:
            return f"{rest // 2},last={rest // 2}"
    return "N,last=M"


def _merge_pins(placements: list) -> list:
    """Keep one placement per mesh dimension (a later pin for the same dimension wins)."""
    seen: dict[str, object] = {}
    for name, pl in placements:
        seen[name] = pl
    return list(seen.items())
