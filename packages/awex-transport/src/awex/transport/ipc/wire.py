"""CUDA IPC exports as plain data: the handles of a rank's storages and the views over them, checked on arrival
(never pickled)."""

from __future__ import annotations

import base64
import binascii
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from awex.meta import Box
from awex.meta.dtypes import ITEMSIZE
from awex.meta.errors import AwexValueError
from awex.transport.shards import LocalShards

log = logging.getLogger("awex.transport")


@dataclass(frozen=True)
class ExportedView:
    """One view of a trainer rank's memory: ``box`` of canonical tensor ``name`` lives at ``storage`` with
    this element offset, sizes and strides."""

    name: str
    box: Box
    storage: int
    offset: int
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IpcExport:
    """What a trainer rank publishes once: its storages' IPC handles and its views over them."""

    storages: tuple[tuple, ...]  # the fields of UntypedStorage._share_cuda_() (handles are bytes)
    pointers: tuple[int, ...]  # the storages' device addresses when exported (to notice that they moved)
    views: tuple[ExportedView, ...]

    def to_wire(self) -> dict:
        def enc(x):
            return {"b64": base64.b64encode(x).decode()} if isinstance(x, bytes) else x

        return {
            "storages": [[enc(x) for x in s] for s in self.storages],
            "pointers": list(self.pointers),
            "views": self.wire_views,
        }

    @functools.cached_property
    def wire_views(self) -> list:
        """The views as the wire carries them (as they arrived, for an export read from the wire)."""
        return [
            [v.name, list(v.box.offsets), list(v.box.sizes), v.storage, v.offset, list(v.strides), v.dtype]
            for v in self.views
        ]

    @functools.cached_property
    def reach(self) -> dict[int, int]:
        """Per storage index, the bytes its views need it to hold (one past the furthest byte of any)."""
        out: dict[int, int] = {}
        for v in self.views:
            n = _reach(v.offset, v.box.sizes, v.strides, ITEMSIZE[v.dtype])
            if n > out.get(v.storage, 0):
                out[v.storage] = n
        return out

    @functools.cached_property
    def keys(self) -> list[tuple]:
        """Each view as a plain tuple, to tell a new export's views from these cheaply (:func:`export_shards`)."""
        return [(v.name, v.box.offsets, v.box.sizes, v.storage, v.offset, v.strides, v.dtype) for v in self.views]

    def moved(self, storages: tuple[tuple, ...], pointers: tuple[int, ...]) -> IpcExport:
        """This export's views over other storages (what it worked out about them kept)."""
        out = IpcExport(storages, pointers, self.views)
        for known in ("wire_views", "reach", "keys"):  # cached_property's slots (the dataclass is frozen)
            if known in self.__dict__:
                out.__dict__[known] = self.__dict__[known]
        return out

    @classmethod
    def from_wire(cls, doc: dict, last: IpcExport | None = None) -> IpcExport:
        """Parse an export published by another process, checking every field against bounds before anything is
        opened: storage fields of the expected kinds, views inside their storage, known dtypes. ``last``: the
        export read before from the same rank; where this one's views are equal to those on the wire then (its
        storages moved, its views did not: a trainer offloaded and loaded back), they are ``last``'s, checked
        then, and only their bounds are checked against the new storages."""
        try:
            return cls._from_wire(doc, last)
        except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as e:
            raise AwexValueError(f"malformed IPC export: {e}") from None

    @classmethod
    def _from_wire(cls, doc: dict, last: IpcExport | None) -> IpcExport:
        def dec(x):
            if isinstance(x, dict):
                raw = base64.b64decode(_checked(x["b64"], str, "handle"), validate=True)
                if len(raw) > _MAX_HANDLE_BYTES:
                    raise AwexValueError(f"a handle of {len(raw)} bytes")
                return raw
            if x is None or isinstance(x, bool):
                return x
            return _count(x, "storage field")

        if not isinstance(doc, dict):
            raise TypeError("an export is a JSON object")
        raw_storages, raw_views, raw_pointers = doc["storages"], doc["views"], doc["pointers"]
        for what, items, limit in (
            ("storages", raw_storages, _MAX_STORAGES),
            ("views", raw_views, _MAX_VIEWS),
            ("pointers", raw_pointers, _MAX_STORAGES),
        ):
            if not isinstance(items, list) or len(items) > limit:
                raise AwexValueError(f"{what}: a list of at most {limit}")
        storages = []
        for s in raw_storages:
            if not isinstance(s, list) or len(s) != len(_STORAGE_FIELDS):
                raise AwexValueError(
                    f"a storage is a list of {len(_STORAGE_FIELDS)} fields: {', '.join(_STORAGE_FIELDS)}"
                )
            fields_ = tuple(dec(x) for x in s)
            for what, value, kind in zip(_STORAGE_FIELDS, fields_, _STORAGE_KINDS):
                if type(value) is not kind:  # bool is not an int here: device True is refused
                    raise AwexValueError(
                        f"storage field {what}: {type(value).__name__} where a {kind.__name__} belongs"
                    )
            device, _, size, offset, _, ref_offset, _, _ = fields_
            if device >= _MAX_DEVICES or max(size, offset, ref_offset) >= _MAX_BYTES:
                raise AwexValueError(
                    f"storage fields out of range: device {device} (< {_MAX_DEVICES}), size, offset and "
                    f"reference-counter offset {size}, {offset}, {ref_offset} (< 2**{_MAX_BYTES.bit_length() - 1})"
                )
            storages.append(fields_)
        pointers = tuple(_count(p, "pointer") for p in raw_pointers)
        if len(pointers) != len(storages):
            raise AwexValueError(f"{len(pointers)} pointers for {len(storages)} storages")
        if last is not None and raw_views == last.wire_views:  # equal values: last's parse holds for them
            for storage, reach in last.reach.items():
                if storage >= len(storages) or reach > storages[storage][2]:
                    raise AwexValueError(f"a view reaches beyond storage {storage} of {len(storages)}")
            export = last.moved(tuple(storages), pointers)
        else:
            export = cls(tuple(storages), pointers, _views_from_wire(raw_views, storages))
        export.__dict__["wire_views"] = raw_views
        return export

    def matches(self, shards: LocalShards) -> bool:
        """Whether ``shards`` still live where this export says (same storages, same views)."""
        return self.pointers == _storage_pointers(shards)[0]


# what PyTorch's UntypedStorage._share_cuda_() returns, in order, and what ``_new_shared_cuda`` takes back
_STORAGE_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event_handle", "event_sync")
_STORAGE_KINDS = (int, bytes, int, int, bytes, int, bytes, bool)
_MAX_DEVICES = 1 << 10
_MAX_BYTES = 1 << 48  # no GPU's memory reaches 256 TiB
_MAX_STORAGES = 1 << 16
_MAX_VIEWS = 1 << 22
_MAX_DIMS = 8
_MAX_HANDLE_BYTES = 4096
_MAX_COUNT = 1 << 62


def _checked(value, kind: type, what: str):
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{what}: {type(value).__name__} where a {kind.__name__} belongs")
    return value


def _count(value, what: str) -> int:
    """A non-negative integer below 2**62 (JSON numbers from another process)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_COUNT:
        raise AwexValueError(f"{what} {str(value)[:40]!r} is not a count")
    return value


def _reach(offset: int, sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """One past the furthest byte of a view's storage it covers (an empty view: its offset)."""
    if not all(sizes):
        return offset * itemsize
    return (offset + sum((size - 1) * stride for size, stride in zip(sizes, strides)) + 1) * itemsize


def _views_from_wire(raw_views: list, storages: list[tuple]) -> tuple[ExportedView, ...]:
    views = []
    for v in raw_views:
        if not isinstance(v, list) or len(v) != 7:
            raise AwexValueError("a view is [name, offsets, sizes, storage, offset, strides, dtype]")
        name, offsets, sizes, storage, offset, strides, dtype = v
        name = _checked(name, str, "name")
        if not 0 < len(name) <= 1024:
            raise AwexValueError("a view's name has 1 to 1024 characters")
        offsets, sizes, strides = (
            tuple(_count(x, what) for x in _checked(xs, list, what))
            for xs, what in ((offsets, "offset"), (sizes, "size"), (strides, "stride"))
        )
        if not len(offsets) == len(sizes) == len(strides) <= _MAX_DIMS:
            raise AwexValueError(f"view {name!r}: offsets, sizes and strides of different lengths")
        storage, offset = _count(storage, "storage index"), _count(offset, "element offset")
        if storage >= len(storages):
            raise AwexValueError(f"view {name!r} names storage {storage} of {len(storages)}")
        dtype = _checked(dtype, str, "dtype")
        if dtype not in ITEMSIZE:
            raise AwexValueError(f"view {name!r}: unknown dtype {dtype!r}")
        if _reach(offset, sizes, strides, ITEMSIZE[dtype]) > storages[storage][2]:
            raise AwexValueError(f"view {name!r} reaches beyond its storage ({storages[storage][2]} bytes)")
        views.append(ExportedView(name, Box(offsets, sizes), storage, offset, strides, dtype))
    return tuple(views)


def _storage_pointers(shards: LocalShards) -> tuple[tuple[int, ...], list[torch.UntypedStorage]]:
    seen: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    for name in sorted(shards.names()):
        for _, view in shards.pairs(name):
            st = view.untyped_storage()
            if st.data_ptr() not in seen:
                seen[st.data_ptr()] = len(storages)
                storages.append(st)
    return tuple(s.data_ptr() for s in storages), storages


def export_shards(shards: LocalShards, last: IpcExport | None = None) -> IpcExport:
    """Export a trainer rank's CUDA views for receivers on this host (call once; re-export when they move).
    ``last``: this rank's export before; where the views lie in the new storages as they lay in its (memory that
    moved whole), the new export keeps its views (receivers then check only the new storages' bounds)."""
    if shards.device.type != "cuda":
        raise AwexValueError(f"CUDA IPC needs CUDA views, these are on {shards.device}")
    pointers, storages = _storage_pointers(shards)
    index = {p: i for i, p in enumerate(pointers)}
    handles = tuple(tuple(st._share_cuda_()) for st in storages)
    pairs = [(name, box, view) for name in sorted(shards.names()) for box, view in shards.pairs(name)]
    keys = [
        (
            name,
            box.offsets,
            box.sizes,
            index[view.untyped_storage().data_ptr()],
            view.storage_offset(),
            tuple(view.stride()),
            str(view.dtype).removeprefix("torch."),
        )
        for name, box, view in pairs
    ]
    if last is not None and keys == last.keys:
        return last.moved(handles, pointers)
    views = tuple(ExportedView(k[0], box, *k[3:]) for k, (_, box, _) in zip(keys, pairs))
    return IpcExport(handles, pointers, views)
