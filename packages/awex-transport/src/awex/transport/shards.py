"""A rank's own memory, addressed by canonical tensor boxes.

A :class:`LocalShards` maps each canonical tensor a rank holds to ``(box, view)`` pairs, where ``view`` is a
tensor of the box's shape that aliases the engine's native memory (a slice of a fused QKV parameter, a TP
shard, a whole HF parameter). Transports read from and write into these views, so a receiver updates its
parameters in place. Shapes and dtypes are checked against the layout before any byte moves.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch

from awex.meta import Box, Layout


class ShardMismatchError(ValueError):
    """A rank's views do not match its layout (missing or extra tensors, wrong shape or dtype)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name as awex.meta spells it."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


class LocalShards:
    """Views of one rank's memory for each (canonical tensor, box) it holds."""

    def __init__(self, shards: Mapping[str, Sequence[tuple[Box, torch.Tensor]]]):
        self._shards = {name: tuple(pairs) for name, pairs in shards.items()}
        for name, pairs in self._shards.items():
            for box, view in pairs:
                if tuple(view.shape) != box.sizes:
                    raise ShardMismatchError(f"{name}: view of shape {tuple(view.shape)} for box {box} of shape {box.sizes}")
        devices = {view.device for pairs in self._shards.values() for _, view in pairs}
        if len(devices) > 1:
            raise ShardMismatchError(f"a rank's views must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")

    @classmethod
    def from_layout(
        cls, layout: Layout, local_rank: int, view_of: Callable[[str, Box], torch.Tensor]
    ) -> LocalShards:
        """Ask ``view_of(name, box)`` for every box the layout gives ``local_rank`` and check each answer."""
        problems = []
        shards: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        for name, boxes in layout.rank_boxes(local_rank).items():
            spec = layout.tensor(name).spec
            for box in boxes:
                try:
                    view = view_of(name, box)
                except KeyError as e:
                    problems.append(f"{name} {box}: no native tensor ({e})")
                    continue
                if tuple(view.shape) != box.sizes:
                    problems.append(f"{name} {box}: native view has shape {tuple(view.shape)}, expected {box.sizes}")
                elif view.dtype != torch_dtype(spec.dtype):
                    problems.append(f"{name} {box}: native dtype {view.dtype}, layout says {spec.dtype}")
                else:
                    shards.setdefault(name, []).append((box, view))
        if problems:
            shown = "\n  ".join(problems[:30])
            raise ShardMismatchError(
                f"{layout.instance} rank {local_rank}: {len(problems)} shard(s) do not match the layout:\n  {shown}")
        return cls(shards)

    def names(self) -> Iterable[str]:
        return self._shards.keys()

    def pairs(self, name: str) -> tuple[tuple[Box, torch.Tensor], ...]:
        return self._shards.get(name, ())

    def view(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The view of region ``offsets``/``sizes`` (canonical coordinates) inside the box that holds it."""
        for box, tensor in self._shards.get(name, ()):
            if all(bo <= o and o + s <= bo + bs for o, s, bo, bs in zip(offsets, sizes, box.offsets, box.sizes)):
                index = tuple(slice(o - bo, o - bo + s) for o, s, bo in zip(offsets, sizes, box.offsets))
                return tensor[index] if index else tensor
        raise ShardMismatchError(f"{name}: this rank holds no box containing {Box(offsets, sizes)}")
