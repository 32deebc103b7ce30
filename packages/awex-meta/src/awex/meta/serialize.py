"""Wire format for metadata: JSON (always) or msgpack (when installed), with a schema version. Never pickle.

Every document is a mapping ``{"schema": SCHEMA_VERSION, "kind": ..., ...}``. Decoding validates structure and
types and raises :class:`SchemaError` on anything unexpected; it never evaluates or imports what it reads.
Encoding is canonical (sorted keys, no whitespace), so equal objects give equal bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from awex.meta.box import Box
from awex.meta.errors import AwexValueError
from awex.meta.layout import (
    ExplicitSharding,
    Layout,
    Mesh,
    MeshSharding,
    Pin,
    Placement,
    Shard,
    Sharding,
    TensorLayout,
)
from awex.meta.spec import RankDescriptor, Role, TensorSpec

SCHEMA_VERSION = 1
KNOWN_LAYOUTS = 16  # distinct layouts a reader keeps by content (layout_from_wire's ``known``)


class SchemaError(AwexValueError):
    """A metadata document that does not parse, has the wrong schema version or the wrong structure."""


# -- helpers --------------------------------------------------------------------------------------------------
def _req(d: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise SchemaError(f"{where}: missing field {key!r}")
    v = d[key]
    if typ is int and isinstance(v, bool) or not isinstance(v, typ):
        raise SchemaError(f"{where}.{key}: expected {getattr(typ, '__name__', typ)}, got {type(v).__name__}")
    return v


def _ints(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise SchemaError(f"{where}: expected a list of integers")
    return tuple(v)


def _box(v: Any, where: str) -> Box:
    if not isinstance(v, list) or len(v) != 2:
        raise SchemaError(f"{where}: a box is [offsets, sizes]")
    try:
        return Box(_ints(v[0], where), _ints(v[1], where))
    except ValueError as e:
        raise SchemaError(f"{where}: {e}") from None


# -- tensor specs and ranks -----------------------------------------------------------------------------------
def spec_to_wire(s: TensorSpec) -> list:
    return [s.name, list(s.shape), s.dtype]


def spec_from_wire(v: Any, where: str = "tensor") -> TensorSpec:
    if not isinstance(v, list) or len(v) != 3 or not isinstance(v[0], str) or not isinstance(v[2], str):
        raise SchemaError(f"{where}: a tensor is [name, shape, dtype]")
    try:
        return TensorSpec(v[0], _ints(v[1], f"{where}.shape"), v[2])
    except ValueError as e:
        raise SchemaError(f"{where}: {e}") from None


def rank_to_wire(r: RankDescriptor) -> dict:
    return {
        "rank": r.rank,
        "instance": r.instance,
        "role": r.role.value,
        "local_rank": r.local_rank,
        "host": r.host,
        "device": r.device,
    }


def rank_from_wire(d: Any, where: str = "rank") -> RankDescriptor:
    try:
        role = Role(_req(d, "role", str, where))
    except ValueError:
        raise SchemaError(f"{where}.role: must be 'trainer' or 'inference'") from None
    return RankDescriptor(
        rank=_req(d, "rank", int, where),
        instance=_req(d, "instance", str, where),
        role=role,
        local_rank=_req(d, "local_rank", int, where),
        host=d.get("host", "") if isinstance(d.get("host", ""), str) else "",
        device=d.get("device", "") if isinstance(d.get("device", ""), str) else "",
    )


# -- layouts --------------------------------------------------------------------------------------------------
def _placement_to_wire(p: Placement) -> dict:
    if isinstance(p, Shard):
        out: dict[str, Any] = {"shard": p.dim}
        if p.parts is not None:
            out["parts"] = p.parts
        if p.block is not None:
            out["block"] = p.block
        return out
    if isinstance(p, Pin):
        return {"pin": list(p.indices)}
    raise TypeError(f"cannot encode placement {p!r}")


def _placement_from_wire(v: Any, where: str) -> Placement:
    if not isinstance(v, dict):
        raise SchemaError(f"{where}: a placement is an object")
    try:
        if "shard" in v:
            extra = set(v) - {"shard", "parts", "block"}
            if extra:
                raise SchemaError(f"{where}: unknown fields {sorted(extra)}")
            parts = v.get("parts")
            block = v.get("block")
            for k, x in (("parts", parts), ("block", block)):
                if x is not None and (not isinstance(x, int) or isinstance(x, bool)):
                    raise SchemaError(f"{where}.{k}: expected an integer")
            return Shard(_req(v, "shard", int, where), parts, block)
        if "pin" in v and set(v) == {"pin"}:
            return Pin(_ints(v["pin"], f"{where}.pin"))
    except ValueError as e:
        raise SchemaError(f"{where}: {e}") from None
    raise SchemaError(f"{where}: unknown placement {sorted(v)}")


def _sharding_to_wire(s: Sharding) -> dict:
    if isinstance(s, MeshSharding):
        return {"mesh": s.mesh, "place": [[n, _placement_to_wire(p)] for n, p in s.placements]}
    return {"explicit": [[rank, [b.to_list() for b in boxes]] for rank, boxes in s.boxes]}


def _sharding_from_wire(v: Any, where: str) -> Sharding:
    if isinstance(v, dict) and "explicit" in v:
        entries = v["explicit"]
        if not isinstance(entries, list):
            raise SchemaError(f"{where}.explicit: expected a list")
        out = []
        for i, e in enumerate(entries):
            if not isinstance(e, list) or len(e) != 2 or not isinstance(e[0], int) or not isinstance(e[1], list):
                raise SchemaError(f"{where}.explicit[{i}]: expected [rank, [boxes]]")
            out.append((e[0], tuple(_box(b, f"{where}.explicit[{i}]") for b in e[1])))
        return ExplicitSharding(tuple(out))
    mesh = _req(v, "mesh", str, where)
    place = _req(v, "place", list, where)
    placements = []
    for i, item in enumerate(place):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise SchemaError(f"{where}.place[{i}]: expected [mesh_dim, placement]")
        placements.append((item[0], _placement_from_wire(item[1], f"{where}.place[{i}]")))
    try:
        return MeshSharding(mesh, tuple(placements))
    except ValueError as e:
        raise SchemaError(f"{where}: {e}") from None


def layout_to_wire(layout: Layout) -> dict:
    """Encode a layout. Shardings are deduplicated into a table, so each tensor costs one short record."""
    table: dict[Sharding, int] = {}
    tensors = []
    for t in layout.tensors:
        idx = table.setdefault(t.sharding, len(table))
        tensors.append([t.spec.name, list(t.spec.shape), t.spec.dtype, idx])
    return {
        "schema": SCHEMA_VERSION,
        "kind": "layout",
        "instance": layout.instance,
        "role": layout.role.value,
        "world_size": layout.world_size,
        "meshes": [{"name": m.name, "dims": [[n, s] for n, s in m.dims]} for m in layout.meshes],
        "shardings": [_sharding_to_wire(s) for s in table],
        "tensors": tensors,
    }


def layout_from_wire(d: Any, known: dict[bytes, Layout] | None = None) -> Layout:
    """Decode (and validate) a layout document. ``known``: layouts this reader decoded before, by content: a document
    equal to one of them but for its instance name is that layout renamed, sharing its validated tensor table
    (engines alike are read once, not once each: a rank of a job with many engines reads the same table from
    each); the most recent :data:`KNOWN_LAYOUTS` are kept."""
    key = content_key(d) if known is not None else None
    if key is not None and key in known:
        instance = d.get("instance")
        if isinstance(instance, str) and instance:
            return known[key].renamed(instance)
    layout = _layout_from_wire(d)
    if key is not None:  # a miss (a hit returned above, or raised decoding its bad instance name)
        known[key] = layout
        while len(known) > KNOWN_LAYOUTS:
            known.pop(next(iter(known)))
    return layout


def content_key(d: Any) -> bytes | None:
    """A digest of a layout document's content but its instance name (as decoded from JSON or msgpack); ``None``
    for anything that is not plain data (decoding then says what is wrong with it)."""
    if not isinstance(d, dict):
        return None
    try:
        text = json.dumps({k: v for k, v in d.items() if k != "instance"}, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).digest()


def _layout_from_wire(d: Any) -> Layout:
    where = "layout"
    _check_header(d, "layout")
    try:
        role = Role(_req(d, "role", str, where))
    except ValueError:
        raise SchemaError(f"{where}.role: must be 'trainer' or 'inference'") from None
    meshes = []
    for i, m in enumerate(_req(d, "meshes", list, where)):
        dims = _req(m, "dims", list, f"{where}.meshes[{i}]")
        for j, dim in enumerate(dims):
            if (
                not isinstance(dim, list)
                or len(dim) != 2
                or not isinstance(dim[0], str)
                or not isinstance(dim[1], int)
                or isinstance(dim[1], bool)
            ):
                raise SchemaError(f"{where}.meshes[{i}].dims[{j}]: expected [name, size]")
        try:
            meshes.append(Mesh(_req(m, "name", str, f"{where}.meshes[{i}]"), tuple((n, s) for n, s in dims)))
        except ValueError as e:
            raise SchemaError(f"{where}.meshes[{i}]: {e}") from None
    shardings = [
        _sharding_from_wire(s, f"{where}.shardings[{i}]") for i, s in enumerate(_req(d, "shardings", list, where))
    ]
    tensors = []
    for i, t in enumerate(_req(d, "tensors", list, where)):
        if not isinstance(t, list) or len(t) != 4 or not isinstance(t[3], int) or isinstance(t[3], bool):
            raise SchemaError(f"{where}.tensors[{i}]: expected [name, shape, dtype, sharding_index]")
        if not 0 <= t[3] < len(shardings):
            raise SchemaError(f"{where}.tensors[{i}]: sharding index {t[3]} out of range")
        tensors.append(TensorLayout(spec_from_wire(t[:3], f"{where}.tensors[{i}]"), shardings[t[3]]))
    try:
        return Layout(
            instance=_req(d, "instance", str, where),
            role=role,
            world_size=_req(d, "world_size", int, where),
            meshes=tuple(meshes),
            tensors=tuple(tensors),
        )
    except (ValueError, KeyError) as e:
        raise SchemaError(f"{where}: {e}") from None


def _check_header(d: Any, kind: str) -> None:
    if not isinstance(d, dict):
        raise SchemaError(f"expected a {kind} document (an object), got {type(d).__name__}")
    version = d.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{kind}: schema version {version!r} is not supported (this library reads {SCHEMA_VERSION})")
    if d.get("kind") != kind:
        raise SchemaError(f"expected a {kind!r} document, got kind {d.get('kind')!r}")


# -- documents ------------------------------------------------------------------------------------------------
def to_wire(obj: Any) -> dict:
    """Encode a metadata object as plain JSON-compatible data."""
    if isinstance(obj, Layout):
        return layout_to_wire(obj)
    if isinstance(obj, TensorSpec):
        return {"schema": SCHEMA_VERSION, "kind": "tensor", "tensor": spec_to_wire(obj)}
    if isinstance(obj, RankDescriptor):
        return {"schema": SCHEMA_VERSION, "kind": "rank", "rank": rank_to_wire(obj)}
    if isinstance(obj, Box):
        return {"schema": SCHEMA_VERSION, "kind": "box", "box": obj.to_list()}
    raise TypeError(f"no wire encoding for {type(obj).__name__}")


def from_wire(d: Any) -> Any:
    """Decode what :func:`to_wire` produced, validating it."""
    if not isinstance(d, dict):
        raise SchemaError(f"expected a metadata document (an object), got {type(d).__name__}")
    kind = d.get("kind")
    if kind == "layout":
        return layout_from_wire(d)
    if kind == "tensor":
        _check_header(d, "tensor")
        return spec_from_wire(d.get("tensor"))
    if kind == "rank":
        _check_header(d, "rank")
        return rank_from_wire(d.get("rank"))
    if kind == "box":
        _check_header(d, "box")
        return _box(d.get("box"), "box")
    raise SchemaError(f"unknown document kind {kind!r}")


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace)."""
    return json.dumps(to_wire(obj), sort_keys=True, separators=(",", ":")).encode()


def loads_json(data: bytes | str) -> Any:
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SchemaError(f"not valid JSON: {e}") from None
    return from_wire(d)


def dumps_msgpack(obj: Any) -> bytes:
    """msgpack bytes (needs the optional ``msgpack`` package: ``pip install awex-meta[msgpack]``)."""
    import msgpack

    return msgpack.packb(to_wire(obj), use_bin_type=True)


def loads_msgpack(data: bytes) -> Any:
    import msgpack

    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise SchemaError(f"not valid msgpack: {e}") from None
    return from_wire(d)
