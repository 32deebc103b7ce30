"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and other DTensor-sharded HF models as trainer sources.

Each rank holds, for every parameter, the local shard of a DTensor: its placements over the device mesh say
which box of the canonical tensor that is (``Shard(d)`` cuts dimension ``d`` in ``torch.chunk`` blocks, as
FSDP2 does; ``Replicate`` keeps it whole). The layout is built from those placements, and each box's view is
the rank's local shard itself, so a sync reads what the rank already holds: no all-gather, no copy of the
model. Parameter names are the HF model's own (FSDP2 keeps them).

MoE models in transformers 5 hold experts fused per layer (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]); the canonical tensors are per expert. When FSDP2 shards such a parameter
along the expert dimension, expert ``e`` lives whole on the rank whose chunk holds it, and its view is a slice of
that rank's local shard.

Not supported (an error before any byte moves): ``Partial`` placements (pending reductions), two mesh
dimensions sharding the same tensor dimension (FSDP2 + TP's strided sharding), fused experts sharded along
another dimension than the experts', and parameters on different meshes.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from awex.engines.hf import model_tensors
from awex.meta import Box, Layout
from awex.meta.errors import AwexValueError
from awex.meta.layout import Mesh, MeshSharding, Pin, Shard, TensorLayout
from awex.meta.spec import Role

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _params(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """The model's parameters (DTensors, as they are) where each is at the call: they may move between versions."""
    from awex.convert.live import LiveTensors

    return LiveTensors(model, buffers=False, data=False)


def _fused_expert(params: dict[str, torch.Tensor], name: str):
    """``(fused parameter, expert, part)`` for a canonical per-expert name held fused (transformers 5), else None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    fused = params.get(f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}")
    return (fused, int(m.group(2)), m.group(3)) if fused is not None else None


def _expert_block(p: DTensor, dims: tuple[str, ...]) -> tuple[str, int] | None:
    """For a fused expert DTensor: (mesh dimension, experts per chunk) if sharded along experts, None if replicated."""
    sharded = [(d, pl) for d, pl in zip(dims, p.placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return None
    if len(sharded) > 1 or type(sharded[0][1]) is not DShard or sharded[0][1].dim != 0:
        raise AwexValueError(
            f"fused experts sharded as {p.placements}: only Shard(0) over one mesh dimension is supported"
        )
    size = p.device_mesh.size(dims.index(sharded[0][0]))
    return sharded[0][0], -(-p.shape[0] // size)


def dtensor_local_rank(model: torch.nn.Module) -> int:
    """This rank's index in the layout: its row-major coordinate on the parameters' device mesh."""
    return mesh_local_rank(_params(model))


def mesh_local_rank(params: Mapping[str, torch.Tensor]) -> int:
    """This rank's row-major coordinate on the device mesh of ``params`` (0 where none is a DTensor)."""
    mesh = _mesh_of(params)
    if mesh is None:
        return 0
    coord = mesh.get_coordinate()
    if coord is None:
        raise AwexValueError("this rank is not part of the parameters' device mesh")
    index = 0
    for c, size in zip(coord, mesh.shape):
        index = index * size + c
    return index


def _mesh_of(params: Mapping[str, torch.Tensor]):
    meshes = {id(p.device_mesh): p.device_mesh for p in params.values() if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise AwexValueError(f"parameters live on {len(meshes)} different device meshes; one is supported")
    return next(iter(meshes.values()), None)


def dtensor_model_layout(model: torch.nn.Module, instance: str, dtype: str | None = None) -> Layout:
    """The trainer layout of an HF model whose parameters are DTensors (e.g. after ``fully_shard``)."""
    params = _params(model)
    first = next(iter(params.values()))
    local_dtype = (first.to_local() if isinstance(first, DTensor) else first).dtype
    tensors = model_tensors(model, dtype or str(local_dtype).removeprefix("torch."))
    dims, shape = mesh_dims(params)
    problems: list[str] = []
    layouts = []
    for t in tensors:
        p = params.get(t.name)
        fused = _fused_expert(params, t.name) if p is None else None
        if fused is not None:
            fp, expert, _ = fused
            placements = []
            if isinstance(fp, DTensor):
                try:
                    block = _expert_block(fp, dims)
                except ValueError as e:
                    problems.append(f"{t.name}: {e}")
                    continue
                if block is not None:
                    placements.append((block[0], Pin((expert // block[1],))))
            layouts.append(TensorLayout(t.spec, MeshSharding("dtensor", tuple(placements))))
            continue
        if p is None:
            problems.append(f"{t.name}: not a parameter of {type(model).__name__}")
            continue
        if tuple(p.shape) != tuple(t.spec.shape):
            problems.append(f"{t.name}: global shape {tuple(p.shape)}, the config says {tuple(t.spec.shape)}")
            continue
        layouts.append(TensorLayout(t.spec, dtensor_sharding(t.name, p, dims, problems)))
    return dtensor_layout(instance, layouts, dims, shape, problems)


def mesh_dims(params: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The names and sizes of the parameters' device mesh (one rank, ``("world",)``, where none is a DTensor)."""
    mesh = _mesh_of(params)
    if mesh is None:
        return ("world",), (1,)
    return tuple(mesh.mesh_dim_names or [f"d{i}" for i in range(mesh.ndim)]), tuple(mesh.shape)


def dtensor_sharding(name: str, p: torch.Tensor, dims: tuple[str, ...], problems: list[str]) -> MeshSharding:
    """How the parameter ``p`` (a DTensor, or a plain tensor: replicated) is placed over the ``dtensor`` mesh; what
    cannot be described is added to ``problems``."""
    placements = []
    if isinstance(p, DTensor):
        seen_dims = set()
        for dim_name, pl in zip(dims, p.placements):
            if isinstance(pl, Replicate):
                continue
            if type(pl) is DShard:
                if pl.dim in seen_dims:
                    problems.append(f"{name}: two mesh dimensions shard tensor dimension {pl.dim}")
                seen_dims.add(pl.dim)
                placements.append((dim_name, Shard(pl.dim)))
            else:
                problems.append(f"{name}: placement {pl} is not supported (only Shard and Replicate)")
    return MeshSharding("dtensor", tuple(placements))


def dtensor_layout(
    instance: str, layouts: list[TensorLayout], dims: tuple[str, ...], shape: tuple[int, ...], problems: list[str]
) -> Layout:
    """The trainer layout of ``layouts`` over the ``dtensor`` mesh, or the ``problems`` found describing them."""
    if problems:
        raise AwexValueError(
            f"{instance}: cannot describe this model's DTensor parameters:\n  " + "\n  ".join(problems)
        )
    world = 1
    for n in shape:
        world *= n
    return Layout(instance, Role.TRAINER, world, (Mesh("dtensor", tuple(zip(dims, shape))),), tuple(layouts))


def dtensor_views(model: torch.nn.Module) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)``: the rank's local shard of the parameter (it is exactly that box), not a copy; with a
    fingerprint of the local shards (``awex.convert.live.fingerprinted``): a steady version checks where each is
    (before any byte moves) instead of deriving every view again, and views of shards that moved are re-pointed."""
    params = _params(model)

    def view_of(name: str, box: Box) -> torch.Tensor:
        p = params.get(name)
        if p is None:
            fused = _fused_expert(params, name)
            if fused is None:
                raise KeyError(name)
            fp, expert, part = fused
            local, first = fp, 0
            if isinstance(fp, DTensor):
                dims = tuple(fp.device_mesh.mesh_dim_names or [f"d{i}" for i in range(fp.device_mesh.ndim)])
                block = _expert_block(fp, dims)
                local = fp.to_local()
                if block is not None:
                    first = (expert // block[1]) * block[1]
            w = local.detach()[expert - first]
            if part != "down":
                half = w.shape[0] // 2
                w = w[:half] if part == "gate" else w[half:]
            return w[box.slices()]
        if isinstance(p, DTensor):
            return p.to_local().detach()  # shares the shard's storage; writes through it land in the model
        return p.detach()[box.slices()]

    from awex.convert.live import LiveTensors, fingerprinted

    return fingerprinted(view_of, LiveTensors(model, buffers=False, data=False, local=True))


__all__ = [
    "dtensor_layout",
    "dtensor_local_rank",
    "dtensor_model_layout",
    "dtensor_sharding",
    "dtensor_views",
    "mesh_dims",
    "mesh_local_rank",
]
