"""Hypothesis strategies for random meshes, shardings and layouts (shared by the property tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from awex.meta import Box, ExplicitSharding, Layout, Mesh, MeshSharding, Pin, Role, Shard, TensorLayout, TensorSpec

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int64"]


@st.composite
def meshes(draw, name="m", max_dims=3, max_size=4):
    ndims = draw(st.integers(1, max_dims))
    dims = tuple((f"d{i}", draw(st.integers(1, max_size))) for i in range(ndims))
    return Mesh(name, dims)


@st.composite
def mesh_shardings(draw, mesh: Mesh, shape: tuple[int, ...]):
    placements = []
    for dim_name, size in mesh.dims:
        kind = draw(st.sampled_from(["replicate", "shard", "pin"] if shape else ["replicate", "pin"]))
        if kind == "shard":
            divisors = [p for p in range(1, size + 1) if size % p == 0]
            parts = draw(st.sampled_from(divisors))
            dim = draw(st.integers(0, len(shape) - 1))
            block = draw(st.one_of(st.none(), st.integers(1, max(1, shape[dim]))))
            placements.append((dim_name, Shard(dim, parts if parts != size else None, block)))
        elif kind == "pin":
            idx = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size, unique=True))
            placements.append((dim_name, Pin(tuple(idx))))
    return MeshSharding(mesh.name, tuple(placements))


@st.composite
def explicit_shardings(draw, world: int, shape: tuple[int, ...]):
    """A random partition of the tensor along dim 0 in row blocks, dealt to ranks (several boxes per rank)."""
    rows = shape[0]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, rows - 1)), max_size=4)))) if rows > 1 else []
    edges = [0, *cuts, rows]
    boxes = [Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]) for lo, hi in zip(edges, edges[1:])]
    per_rank: dict[int, list[Box]] = {}
    for b in boxes:
        holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        for r in holders:
            per_rank.setdefault(r, []).append(b)
    return ExplicitSharding(tuple((r, tuple(bs)) for r, bs in sorted(per_rank.items())))


@st.composite
def tensor_specs(draw, count: int):
    specs = []
    for i in range(count):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
        specs.append(TensorSpec(f"t{i}", shape, draw(st.sampled_from(DTYPES))))
    return specs


@st.composite
def layouts(draw, specs: list[TensorSpec], role: Role, instance: str, full_coverage: bool = True, subset: bool = False):
    """A layout over ``specs``. With ``full_coverage`` every element of every tensor is held by some rank."""
    mesh = draw(meshes())
    chosen = specs if not subset else [s for s in specs if draw(st.booleans())] or specs[:1]
    tensors = []
    for spec in chosen:
        for _ in range(20):
            if spec.shape and draw(st.integers(0, 4)) == 0:
                sharding = draw(explicit_shardings(mesh.size, spec.shape))
            else:
                sharding = draw(mesh_shardings(mesh, spec.shape))
            t = TensorLayout(spec, sharding)
            probe = Layout(instance, role, mesh.size, (mesh,), (t,))
            if not full_coverage or _covers(probe, spec):
                break
        else:
            t = TensorLayout(spec, MeshSharding(mesh.name))
        tensors.append(t)
    return Layout(instance, role, mesh.size, (mesh,), tuple(tensors))


def _covers(layout: Layout, spec: TensorSpec) -> bool:
    return sum(b.numel for b, _ in layout.holdings(spec.name)) == spec.numel and _disjoint(
        [b for b, _ in layout.holdings(spec.name)]
    )


def _disjoint(boxes):
    return all(a.intersect(b) is None for i, a in enumerate(boxes) for b in boxes[:i])
