"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and other DTensor-sharded HF models as trainer sources.

Each rank holds, for every parameter, the local shard of a DTensor: its placements over the device mesh say
which box of the canonical tensor that is (``Shard(d)`` cuts dimension ``d`` in ``torch.chunk`` blocks, as
FSDP2 does; ``Replicate`` keeps it whole). The layout is built from those placements, and each box's view is
the rank's local shard itself, so a sync reads what the rank already holds: no all-gather, no copy of the
model. Parameter names are the HF model's own (FSDP2 keeps them).

Not supported (an error before any byte moves): ``Partial`` placements (pending reductions), two mesh
dimensions sharding the same tensor dimension (FSDP2 + TP's strided sharding), and parameters on different
meshes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from awex.meta import Box, Layout, canonical_tensors
from awex.meta.layout import Mesh, MeshSharding, Shard, TensorLayout
from awex.meta.spec import Role


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def dtensor_local_rank(model: torch.nn.Module) -> int:
    """This rank's index in the layout: its row-major coordinate on the parameters' device mesh."""
    mesh = _mesh_of(_params(model))
    if mesh is None:
        return 0
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the parameters' device mesh")
    index = 0
    for c, size in zip(coord, mesh.shape):
        index = index * size + c
    return index


def _mesh_of(params: dict[str, torch.Tensor]):
    meshes = {id(p.device_mesh): p.device_mesh for p in params.values() if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise ValueError(f"parameters live on {len(meshes)} different device meshes; one is supported")
    return next(iter(meshes.values()), None)


def dtensor_model_layout(model: torch.nn.Module, instance: str, dtype: str | None = None) -> Layout:
    """The trainer layout of an HF model whose parameters are DTensors (e.g. after ``fully_shard``)."""
    params = _params(model)
    first = next(iter(params.values()))
    local_dtype = (first.to_local() if isinstance(first, DTensor) else first).dtype
    tensors = canonical_tensors(model.config.to_dict(), dtype=dtype or str(local_dtype).removeprefix("torch."))
    mesh = _mesh_of(params)
    dims = tuple(mesh.mesh_dim_names or [f"d{i}" for i in range(mesh.ndim)]) if mesh is not None else ("world",)
    shape = tuple(mesh.shape) if mesh is not None else (1,)
    problems = []
    layouts = []
    for t in tensors:
        p = params.get(t.name)
        if p is None:
            problems.append(f"{t.name}: not a parameter of {type(model).__name__}")
            continue
        if tuple(p.shape) != tuple(t.spec.shape):
            problems.append(f"{t.name}: global shape {tuple(p.shape)}, the config says {tuple(t.spec.shape)}")
            continue
        placements = []
        if isinstance(p, DTensor):
            seen_dims = set()
            for dim_name, pl in zip(dims, p.placements):
                if isinstance(pl, Replicate):
                    continue
                if type(pl) is DShard:
                    if pl.dim in seen_dims:
                        problems.append(f"{t.name}: two mesh dimensions shard tensor dimension {pl.dim}")
                    seen_dims.add(pl.dim)
                    placements.append((dim_name, Shard(pl.dim)))
                else:
                    problems.append(f"{t.name}: placement {pl} is not supported (only Shard and Replicate)")
        layouts.append(TensorLayout(t.spec, MeshSharding("dtensor", tuple(placements))))
    if problems:
        raise ValueError(f"{instance}: cannot describe this model's DTensor parameters:\n  " + "\n  ".join(problems))
    world = 1
    for n in shape:
        world *= n
    return Layout(instance, Role.TRAINER, world, (Mesh("dtensor", tuple(zip(dims, shape))),), tuple(layouts))


def dtensor_views(model: torch.nn.Module) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)``: the rank's local shard of the parameter (it is exactly that box), not a copy."""
    params = _params(model)

    def view_of(name: str, box: Box) -> torch.Tensor:
        p = params[name]
        if isinstance(p, DTensor):
            return p.to_local().detach()  # shares the shard's storage; writes through it land in the model
        return p.detach()[box.slices()]

    return view_of


__all__ = ["dtensor_local_rank", "dtensor_model_layout", "dtensor_views"]
