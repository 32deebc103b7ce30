"""A rank's own memory, addressed by canonical tensor boxes.

A :class:`LocalShards` maps each canonical tensor a rank holds to ``(box, view)`` pairs, where ``view`` is a
tensor of the box's shape that aliases the engine's native memory (a slice of a fused QKV parameter, a TP
shard, a whole HF parameter). Transports read from and write into these views, so a receiver updates its
parameters in place. Shapes and dtypes are checked against the layout before any byte moves.
"""

from __future__ import annotations

import logging
from math import prod
from typing import Callable, Iterable, Mapping, Sequence

import torch

from awex.meta import Box, Layout
from awex.meta.box import intersect
from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.transport")


class ShardMismatchError(AwexValueError):
    """A rank's views do not match its layout (missing or extra tensors, wrong shape or dtype)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name as awex.meta spells it."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise AwexValueError(f"torch has no dtype {name!r}")
    return dtype


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The address range ``t``'s elements span (first byte, one past the last)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def backed(view: torch.Tensor) -> bool:
    """Whether ``view``'s storage holds every element it addresses: not a storage freed in place
    (``untyped_storage().resize_(0)``, the usual offload trick) or shrunk since the view was taken (reading such a
    view crashes the process). Meta tensors are refused by the device checks (:func:`rebound`, one device a rank)."""
    if view.device.type == "meta" or view.numel() == 0:
        return True
    storage = view.untyped_storage()
    return extent(view)[1] - storage.data_ptr() <= storage.nbytes()


class LocalShards:
    """Views of one rank's memory for the canonical boxes it holds.

    Each tensor maps to ``(box, view)`` pieces: ``view`` has the box's shape and aliases native memory. Pieces
    may be finer than the layout's boxes (Megatron's fused QKV interleaves query groups, so a rank's box of
    ``q_proj`` is one piece per local group); they must not overlap.
    """

    def __init__(self, shards: Mapping[str, Sequence[tuple[Box, torch.Tensor]]], device: torch.device | None = None):
        """``device``: the GPU this rank's transport works on where its views are all in pinned host memory
        (``on_host``: a receiver staging a version on the host; the copies land there from that GPU); by default
        the views' own device."""
        self._shards = {name: tuple(pairs) for name, pairs in shards.items()}
        for name, pairs in self._shards.items():
            for box, view in pairs:
                if tuple(view.shape) != box.sizes:
                    raise ShardMismatchError(
                        f"{name}: view of shape {tuple(view.shape)} for box {box} of shape {box.sizes}"
                    )
        devices: dict[torch.device, str] = {}  # each device, and a tensor there
        for name, pairs in self._shards.items():
            for _, view in pairs:
                devices.setdefault(view.device, name)
        if len(devices) > 1:
            where = ", ".join(f"{d} ({name}...)" for d, name in sorted(devices.items(), key=lambda x: str(x[0])))
            raise ShardMismatchError(
                f"a rank's views must be on one device, got {where}: weights offloaded must be loaded back before "
                "they are sent"
            )
        self.device = next(iter(devices), torch.device("cpu"))
        self.on_host = False  # views in pinned host memory, the rank's transport on the GPU ``device``
        given = None if device is None else torch.device(device)
        if given is not None and not (given.type == self.device.type and given.index in (None, self.device.index)):
            self._put_on(given)  # ("cuda" for views on cuda:0 is their own device)
        self.fingerprint: tuple | None = None  # where the tensors the views come from were (see rebound)
        self.sources_at: tuple[int, ...] | None = None  # their addresses then, where view_of names them (sources())
        self.recipe = None  # where the views lie in those tensors (awex.transport.moved_views), once asked
        self.unconfirmed = False  # kept by rebound(quick=True) on their addresses alone: see confirm_bound

    def _put_on(self, device: torch.device) -> None:
        if device.type == "cpu" or self.device.type != "cpu":
            raise ShardMismatchError(
                f"views on {self.device} for a rank on {device}: a rank's views are on its device, or all in pinned "
                "host memory for a rank on a GPU"
            )
        unpinned = next((n for n, pairs in self._shards.items() for _, v in pairs if not v.is_pinned()), None)
        if unpinned is not None:
            raise ShardMismatchError(
                f"{unpinned}: its view is in host memory that is not pinned; a rank on {device} takes views in "
                "pinned host memory only (torch.empty(..., pin_memory=True)): its GPU copies into them"
            )
        self.device, self.on_host = device, True

    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        local_rank: int,
        view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
        device: torch.device | None = None,
    ) -> LocalShards:
        """Ask ``view_of(name, box)`` for every box the layout gives ``local_rank``, and check each answer
        (``device``: as in the constructor).

        ``view_of`` returns one view of the box's shape, or ``(sub_box, view)`` pieces that tile the box.
        Every problem (missing tensor, wrong shape, wrong dtype, pieces that do not tile) is collected and
        raised together as :class:`ShardMismatchError` before any byte moves.
        """
        problems = []
        shards: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        for name, boxes in layout.rank_boxes(local_rank).items():
            want = torch_dtype(layout.tensor(name).spec.dtype)
            for box in boxes:
                try:
                    answer = view_of(name, box)
                except KeyError as e:
                    problems.append(f"{name} {box}: no native tensor ({e})")
                    continue
                pieces = [(box, answer)] if isinstance(answer, torch.Tensor) else list(answer)
                before = len(problems)
                covered = 0
                for sub, view in pieces:
                    if not box.contains(sub):
                        problems.append(f"{name} {box}: piece {sub} lies outside the box")
                    elif tuple(view.shape) != sub.sizes:
                        problems.append(
                            f"{name} {sub}: native view has shape {tuple(view.shape)}, expected {sub.sizes}"
                        )
                    elif view.dtype != want:
                        problems.append(
                            f"{name} {sub}: native dtype {view.dtype}, layout says {layout.tensor(name).spec.dtype}"
                        )
                    elif not backed(view):
                        held = view.untyped_storage().nbytes()
                        problems.append(
                            f"{name} {sub}: its memory is not there (its storage holds {held} bytes): weights "
                            "offloaded or freed must be loaded back before they are sent"
                        )
                    else:
                        covered += sub.numel
                        shards.setdefault(name, []).append((sub, view))
                if len(problems) == before and covered != box.numel:
                    problems.append(f"{name} {box}: pieces cover {covered} of {box.numel} elements")
        for name, pairs in shards.items():
            for i, (a, _) in enumerate(pairs):
                if any(a.intersect(b) is not None for b, _ in pairs[:i]):
                    problems.append(f"{name}: pieces overlap at {a}")
                    break
        if problems:
            shown = "\n  ".join(problems[:30])
            raise ShardMismatchError(
                f"{layout.instance} rank {local_rank}: {len(problems)} shard(s) do not match the layout:\n  {shown}"
            )
        return cls(shards, device)

    def names(self) -> Iterable[str]:
        return self._shards.keys()

    def pairs(self, name: str) -> tuple[tuple[Box, torch.Tensor], ...]:
        return self._shards.get(name, ())

    def pieces(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        """``(index into the region, native view)`` for every piece of the region; raises unless all are held."""
        out = []
        covered = 0
        for box, view in self._shards.get(name, ()):
            inter = intersect(offsets, sizes, box.offsets, box.sizes)
            if inter is None:
                continue
            here = tuple(slice(o - r, o - r + s) for o, s, r in zip(inter.offsets, inter.sizes, offsets))
            there = tuple(slice(o - b, o - b + s) for o, s, b in zip(inter.offsets, inter.sizes, box.offsets))
            out.append((here, view[there] if there else view))
            covered += inter.numel
        if covered != prod(sizes):
            raise ShardMismatchError(f"{name}: this rank does not hold all of {Box(offsets, sizes)}")
        return out

    def copy_out(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], out: torch.Tensor) -> None:
        """Copy region ``offsets``/``sizes`` (canonical coordinates) of ``name`` into ``out`` (region-shaped)."""
        for here, piece in self.pieces(name, offsets, sizes):
            (out[here] if here else out).copy_(piece)

    def copy_in(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], src: torch.Tensor) -> None:
        """Write ``src`` (region-shaped) into this rank's memory for region ``offsets``/``sizes`` of ``name``."""
        for here, piece in self.pieces(name, offsets, sizes):
            piece.copy_(src[here] if here else src)

    def moved(self, before: LocalShards) -> list[str]:
        """Tensors whose views here do not alias what ``before``'s did (address, shape, strides, dtype, device):
        the trainer offloaded and reloaded them, replaced ``param.data``, or resharded."""

        def where(pairs) -> list[tuple]:
            return [(b, v.data_ptr(), tuple(v.stride()), v.dtype, v.device) for b, v in pairs]

        names = set(self._shards) | set(before._shards)
        return sorted(n for n in names if where(self.pairs(n)) != where(before.pairs(n)))
