"""Boxes: rectangular pieces of an n-dimensional tensor.

Intersection is the only geometry weight synchronisation needs: a destination rank needs a box of a canonical
tensor, each source rank holds boxes of it, and every transfer moves the intersection of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from awex.meta.errors import AwexValueError


@dataclass(frozen=True, slots=True)
class Box:
    """An n-dimensional box: ``offsets[d] <= index[d] < offsets[d] + sizes[d]`` in every dimension ``d``.

    A box of a 0-dimensional (scalar) tensor has empty ``offsets`` and ``sizes`` and one element.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise AwexValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise AwexValueError(f"box offsets and sizes must be non-negative, got {self.offsets} / {self.sizes}")

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or ``None`` when they do not overlap."""
        return intersect(self.offsets, self.sizes, other.offsets, other.sizes)

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies entirely inside this box."""
        return all(
            so <= oo and oo + os <= so + ss
            for so, ss, oo, os in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it): the local view a rank slices."""
        if not outer.contains(self):
            raise AwexValueError(f"{self} does not lie inside {outer}")
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Python slices selecting this box (for numpy/torch indexing)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def to_list(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    def __str__(self) -> str:
        if not self.sizes:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def intersect(
    a_offsets: tuple[int, ...], a_sizes: tuple[int, ...], b_offsets: tuple[int, ...], b_sizes: tuple[int, ...]
) -> Box | None:
    """Intersection of two boxes given as offset/size tuples (the planner's hot path)."""
    offsets = []
    sizes = []
    for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes):
        lo = ao if ao > bo else bo
        ae = ao + as_
        be = bo + bs
        hi = ae if ae < be else be
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def split_box(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Split ``box`` into contiguous pieces of at most ``max_bytes`` each, cutting the outermost dimension first.

    A piece that is one slab thick along a dimension and still too large is cut along the next dimension.
    Pieces are returned in row-major order and together cover ``box`` exactly once.
    """
    if max_bytes <= 0:
        raise AwexValueError("max_bytes must be positive")
    if box.numel * itemsize <= max_bytes or box.ndim == 0:
        return [box]
    dim = next((d for d, s in enumerate(box.sizes) if s > 1), None)
    if dim is None:
        return [box]
    slab = box.numel // box.sizes[dim] * itemsize  # bytes of one index along `dim`
    if slab > max_bytes:
        out: list[Box] = []
        for i in range(box.sizes[dim]):
            offsets = list(box.offsets)
            sizes = list(box.sizes)
            offsets[dim] += i
            sizes[dim] = 1
            out.extend(
                split_box(Box(tuple(offsets), tuple(sizes)), itemsize, max_bytes)
                if dim + 1 < box.ndim
                else [Box(tuple(offsets), tuple(sizes))]
            )
        return out
    per = max(1, max_bytes // slab)
    out = []
    for start in range(0, box.sizes[dim], per):
        offsets = list(box.offsets)
        sizes = list(box.sizes)
        offsets[dim] += start
        sizes[dim] = min(per, box.sizes[dim] - start)
        out.append(Box(tuple(offsets), tuple(sizes)))
    return out
