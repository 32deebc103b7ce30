"""Strided regions of a contiguous tensor as boxes: which box of a base tensor a view covers, in which dim order.

A view of a contiguous tensor of shape ``base_shape`` is ``(offset, sizes, strides)`` in elements. When it covers
exactly a box of the base (narrowed, sliced, transposed, split or merged dims, but no steps and no element
twice), :func:`region_box` returns that box and, for each base dim, which pair of view dims maps onto it, so a
second region that received the view's elements one for one (a ``copy_`` destination) can be re-viewed in the
box's own order. Pure integer arithmetic: no tensor is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from awex.meta import Box
from awex.meta.errors import AwexValueError


@dataclass(frozen=True)
class BoxedRegion:
    """A region that is ``box`` of its base: ``strides[d]`` is the stride, in the other region's storage, that
    walks base dim ``d`` (0 where the box is one element wide there)."""

    box: Box
    strides: tuple[int, ...]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(prod(shape[d + 1 :]) for d in range(len(shape)))


def region_box(
    base_shape: tuple[int, ...],
    offset: int,
    sizes: tuple[int, ...],
    strides: tuple[int, ...],
    other_strides: tuple[int, ...] | None = None,
) -> BoxedRegion | None:
    """The box of a contiguous ``base_shape`` tensor that the view ``(offset, sizes, strides)`` covers, element for
    element, with the strides ``other_strides`` (one per view dim; default ``strides``) regrouped per base dim;
    ``None`` when the view is no box (steps, repeated elements, a dim spanning a partial row)."""
    if len(sizes) != len(strides) or (other_strides is not None and len(other_strides) != len(sizes)):
        raise AwexValueError("region_box: sizes and strides differ in length")
    other = strides if other_strides is None else other_strides
    base = contiguous_strides(base_shape)
    # (size, stride in the base, stride in the other region) per view dim, size-1 dims dropped
    items = [(n, s, o) for n, s, o in zip(sizes, strides, other) if n != 1]
    if any(n == 0 for n in sizes):
        return None
    by_dim: dict[int, tuple[int, int]] = {}  # base dim -> (size, other stride)
    while items:
        n, s, o = items.pop()
        d = next((d for d in range(len(base_shape)) if base[d] == s and base_shape[d] > 1), None)
        if d is None:
            return None  # a step, or a stride that walks no base dim
        if n > base_shape[d]:  # a merged dim: the inner part walks d, the rest walks the dims outside it
            if n % base_shape[d]:
                return None
            items.append((n // base_shape[d], s * base_shape[d], o * base_shape[d]))
            n = base_shape[d]
        if d in by_dim:
            return None  # two view dims walk one base dim: elements repeat or interleave
        by_dim[d] = (n, o)
    coords = []
    rest = offset
    for d in range(len(base_shape)):
        c, rest = divmod(rest, base[d]) if base[d] else (0, rest)
        coords.append(c)
    if rest or any(c < 0 for c in coords):
        return None
    sizes_out = tuple(by_dim.get(d, (1, 0))[0] for d in range(len(base_shape)))
    if any(c + n > e for c, n, e in zip(coords, sizes_out, base_shape)):
        return None
    return BoxedRegion(Box(tuple(coords), sizes_out), tuple(by_dim.get(d, (1, 0))[1] for d in range(len(base_shape))))
