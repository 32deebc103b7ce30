"""Layouts: how one engine instance holds the canonical tensors, described compactly.

A layout names the instance, its role and world size, one or more *meshes* over its ranks (named parallel
dimensions, outermost first, local rank = row-major index, like a PyTorch ``DeviceMesh``), and per canonical
tensor a *sharding*: for each mesh dimension, whether the tensor is split along one of its dimensions
(:class:`Shard`), exists only at some coordinates (:class:`Pin`, e.g. a pipeline stage or an expert-parallel
rank) or is replicated (the default). Irregular cases list boxes per rank (:class:`ExplicitSharding`).

The size of a layout grows with the number of tensors, not tensors x ranks: expanding it into
``(rank, tensor, box)`` is the pure function :meth:`Layout.holdings`, which every rank can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Union

from awex.meta.box import Box
from awex.meta.errors import AwexValueError
from awex.meta.spec import Role, TensorSpec


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every coordinate along this mesh dimension holds the same data (the default for unlisted dimensions)."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dimension ``dim`` along this mesh dimension.

    The dimension is cut into ``parts`` chunks (default: the mesh dimension's size) of ``block`` elements each
    (default: ``ceil(extent / parts)``; the last chunk may be shorter or empty, as with ``torch.chunk`` or a
    padded vocabulary). When ``parts`` is smaller than the mesh dimension, consecutive coordinates share a chunk
    (``chunk = coord // (size // parts)``): this is how vLLM replicates KV heads when TP exceeds their count.
    """

    dim: int
    parts: int | None = None
    block: int | None = None

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise AwexValueError(f"Shard.dim must be non-negative, got {self.dim}")
        if self.parts is not None and self.parts < 1:
            raise AwexValueError(f"Shard.parts must be positive, got {self.parts}")
        if self.block is not None and self.block < 1:
            raise AwexValueError(f"Shard.block must be positive, got {self.block}")


@dataclass(frozen=True, slots=True)
class Pin:
    """The tensor exists only at these coordinates of this mesh dimension (pipeline stage, expert rank)."""

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(sorted(set(int(i) for i in self.indices))))
        if not self.indices or self.indices[0] < 0:
            raise AwexValueError(f"Pin needs non-negative indices, got {self.indices}")


Placement = Union[Replicate, Shard, Pin]


@dataclass(frozen=True, slots=True)
class Mesh:
    """Named parallel dimensions over an instance's ranks, outermost first; local rank = row-major index."""

    name: str
    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        dims = tuple((str(n), int(s)) for n, s in self.dims)
        object.__setattr__(self, "dims", dims)
        names = [n for n, _ in dims]
        if len(set(names)) != len(names):
            raise AwexValueError(f"mesh {self.name!r} repeats a dimension name: {names}")
        if any(s < 1 for _, s in dims):
            raise AwexValueError(f"mesh {self.name!r} has a dimension of size < 1: {dims}")

    @property
    def size(self) -> int:
        return prod(s for _, s in self.dims)

    def dim_index(self, name: str) -> int:
        for i, (n, _) in enumerate(self.dims):
            if n == name:
                return i
        raise KeyError(f"mesh {self.name!r} has no dimension {name!r} (has {[n for n, _ in self.dims]})")

    def coords(self, local_rank: int) -> tuple[int, ...]:
        """Coordinates of a local rank (row-major, last dimension fastest)."""
        out = []
        for _, size in reversed(self.dims):
            out.append(local_rank % size)
            local_rank //= size
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        rank = 0
        for (_, size), c in zip(self.dims, coords):
            rank = rank * size + c
        return rank


@dataclass(frozen=True, slots=True)
class MeshSharding:
    """How a tensor is placed over a mesh: ``placements`` maps mesh dimension names to placements.

    Unlisted dimensions are replicated. Placements apply in mesh order (outermost first), so two dimensions that
    shard the same tensor dimension nest, the inner one splitting the outer one's chunk.
    """

    mesh: str
    placements: tuple[tuple[str, Placement], ...] = ()
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cleaned = tuple((str(n), p) for n, p in self.placements if not isinstance(p, Replicate))
        names = [n for n, _ in cleaned]
        if len(set(names)) != len(names):
            raise AwexValueError(f"sharding over mesh {self.mesh!r} lists a dimension twice: {names}")
        object.__setattr__(self, "placements", cleaned)
        object.__setattr__(self, "_hash", hash((self.mesh, cleaned)))

    def __hash__(self) -> int:  # cached: the planner hashes shardings once per tensor and instance
        return self._hash


@dataclass(frozen=True, slots=True)
class ExplicitSharding:
    """Boxes listed per local rank, for layouts no mesh describes (several boxes per rank are allowed)."""

    boxes: tuple[tuple[int, tuple[Box, ...]], ...]

    def __post_init__(self) -> None:
        merged: dict[int, tuple[Box, ...]] = {}
        for rank, boxes in self.boxes:
            merged[int(rank)] = merged.get(int(rank), ()) + tuple(boxes)
        object.__setattr__(self, "boxes", tuple(sorted(merged.items())))


Sharding = Union[MeshSharding, ExplicitSharding]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One canonical tensor and how the instance holds it."""

    spec: TensorSpec
    sharding: Sharding


Holdings = tuple[tuple[Box, tuple[int, ...]], ...]
"""Distinct boxes of one tensor, each with the sorted local ranks that hold it."""


@dataclass(frozen=True)
class Layout:
    """How one engine instance (all its ranks) holds the canonical tensors.

    ``instance`` names the engine instance uniquely within a job; ``role`` says whether it sends (trainer) or
    receives (inference). Tensors are kept sorted by name.
    """

    instance: str
    role: Role
    world_size: int
    meshes: tuple[Mesh, ...]
    tensors: tuple[TensorLayout, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.instance:
            raise AwexValueError("layout needs a non-empty instance name")
        object.__setattr__(self, "role", Role(self.role))
        if self.world_size < 1:
            raise AwexValueError(f"{self.instance}: world_size must be positive")
        mesh_names = [m.name for m in self.meshes]
        if len(set(mesh_names)) != len(mesh_names):
            raise AwexValueError(f"{self.instance}: duplicate mesh names {mesh_names}")
        meshes = {m.name: m for m in self.meshes}
        for m in self.meshes:
            if m.size != self.world_size:
                raise AwexValueError(
                    f"{self.instance}: mesh {m.name!r} has {m.size} ranks but the instance has {self.world_size}"
                )
        tensors = self.tensors if isinstance(self.tensors, tuple) else tuple(self.tensors)
        if any(a.spec.name > b.spec.name for a, b in zip(tensors, tensors[1:])):
            tensors = tuple(sorted(tensors, key=lambda t: t.spec.name))
        object.__setattr__(self, "tensors", tensors)
        index: dict[str, int] = {}
        checked: set[tuple] = set()
        for i, t in enumerate(tensors):
            if t.spec.name in index:
                raise AwexValueError(f"{self.instance}: tensor {t.spec.name!r} listed twice")
            index[t.spec.name] = i
            key = (t.sharding, t.spec.shape)
            if key not in checked:
                _validate_sharding(self.instance, t, meshes, self.world_size)
                checked.add(key)
        object.__setattr__(self, "_index", index)

    def renamed(self, instance: str) -> Layout:
        """The same layout for another instance (shares the validated tensor table; no re-validation)."""
        if not instance:
            raise AwexValueError("layout needs a non-empty instance name")
        clone = object.__new__(Layout)
        for f in ("role", "world_size", "meshes", "tensors", "_index"):
            object.__setattr__(clone, f, getattr(self, f))
        object.__setattr__(clone, "instance", instance)
        return clone

    # -- lookups -------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [t.spec.name for t in self.tensors]

    def mesh(self, name: str) -> Mesh:
        for m in self.meshes:
            if m.name == name:
                return m
        raise KeyError(f"{self.instance}: no mesh {name!r}")

    def tensor(self, name: str) -> TensorLayout:
        try:
            return self.tensors[self._index[name]]
        except KeyError:
            raise KeyError(f"{self.instance}: no tensor {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    # -- expansion (pure) ----------------------------------------------------------------------------------
    def holdings(self, name: str) -> Holdings:
        """Distinct boxes of tensor ``name`` and the local ranks holding each (replicas share a box)."""
        t = self.tensor(name)
        if isinstance(t.sharding, ExplicitSharding):
            return _expand_explicit(t.sharding)
        return expand_mesh_sharding(self.mesh(t.sharding.mesh), t.sharding, t.spec.shape)

    def rank_boxes(self, local_rank: int) -> dict[str, tuple[Box, ...]]:
        """What one rank holds: canonical tensor name -> its boxes (what a rank needs to bind native memory)."""
        if not 0 <= local_rank < self.world_size:
            raise AwexValueError(f"{self.instance}: local rank {local_rank} outside [0, {self.world_size})")
        out: dict[str, tuple[Box, ...]] = {}
        for t in self.tensors:
            boxes = tuple(box for box, ranks in self.holdings(t.spec.name) if local_rank in ranks)
            if boxes:
                out[t.spec.name] = boxes
        return out

    def sharding_key(self, name: str) -> tuple:
        """A hashable key equal for tensors whose holdings are equal (same mesh, placements and shape)."""
        t = self.tensor(name)
        return (self.instance, t.sharding, t.spec.shape)


def _validate_sharding(instance: str, t: TensorLayout, meshes: dict[str, Mesh], world: int) -> None:
    s = t.sharding
    name = t.spec.name
    if isinstance(s, ExplicitSharding):
        for rank, boxes in s.boxes:
            if not 0 <= rank < world:
                raise AwexValueError(f"{instance}: {name}: explicit box for rank {rank} outside [0, {world})")
            full = Box.full(t.spec.shape)
            for i, b in enumerate(boxes):
                if b.ndim != len(t.spec.shape) or not full.contains(b):
                    raise AwexValueError(f"{instance}: {name}: box {b} does not fit shape {t.spec.shape}")
                for other in boxes[:i]:
                    if b.intersect(other) is not None:
                        raise AwexValueError(f"{instance}: {name}: rank {rank} lists overlapping boxes {other} and {b}")
        return
    if s.mesh not in meshes:
        raise AwexValueError(f"{instance}: {name}: unknown mesh {s.mesh!r}")
    mesh = meshes[s.mesh]
    for dim_name, p in s.placements:
        size = mesh.dims[mesh.dim_index(dim_name)][1]
        if isinstance(p, Shard):
            if p.dim >= len(t.spec.shape):
                raise AwexValueError(f"{instance}: {name}: Shard(dim={p.dim}) but the tensor has shape {t.spec.shape}")
            parts = p.parts or size
            if size % parts:
                raise AwexValueError(
                    f"{instance}: {name}: {parts} parts cannot be spread over mesh dimension {dim_name!r} "
                    f"of size {size}"
                )
        elif isinstance(p, Pin):
            if p.indices[-1] >= size:
                raise AwexValueError(
                    f"{instance}: {name}: Pin{p.indices} outside mesh dimension {dim_name!r} of size {size}"
                )
        else:
            raise TypeError(f"{instance}: {name}: unknown placement {p!r}")


@lru_cache(maxsize=65536)
def expand_mesh_sharding(mesh: Mesh, sharding: MeshSharding, shape: tuple[int, ...]) -> Holdings:
    """Expand a mesh sharding into distinct boxes with their holders (cached: layouts repeat shardings)."""
    order = sorted(((mesh.dim_index(n), n, p) for n, p in sharding.placements), key=lambda x: x[0])
    sizes = [s for _, s in mesh.dims]
    boxes: dict[Box, list[int]] = {}
    for local in range(mesh.size):
        coords = mesh.coords(local)
        offsets = [0] * len(shape)
        extents = list(shape)
        holds = True
        for idx, _name, p in order:
            c = coords[idx]
            if isinstance(p, Pin):
                if c not in p.indices:
                    holds = False
                    break
                continue
            n = sizes[idx]
            parts = p.parts or n
            chunk = c // (n // parts)
            extent = extents[p.dim]
            block = p.block or -(-extent // parts)
            lo = min(chunk * block, extent)
            hi = min(lo + block, extent)
            offsets[p.dim] += lo
            extents[p.dim] = hi - lo
        if not holds or any(e == 0 for e in extents):
            continue
        boxes.setdefault(Box(tuple(offsets), tuple(extents)), []).append(local)
    return tuple((b, tuple(r)) for b, r in sorted(boxes.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes)))


@lru_cache(maxsize=4096)
def _expand_explicit(sharding: ExplicitSharding) -> Holdings:
    boxes: dict[Box, list[int]] = {}
    for rank, bs in sharding.boxes:
        for b in bs:
            if not b.is_empty():
                boxes.setdefault(b, []).append(rank)
    return tuple(
        (b, tuple(sorted(set(r)))) for b, r in sorted(boxes.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes))
    )
