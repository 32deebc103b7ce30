import pytest
from hypothesis import given
from hypothesis import strategies as st

from awex.meta import Box
from awex.meta.box import split_box


def boxes(ndim):
    return st.tuples(st.tuples(*[st.integers(0, 6)] * ndim), st.tuples(*[st.integers(1, 6)] * ndim)).map(
        lambda t: Box(*t)
    )


def cells(box):
    import itertools

    return set(itertools.product(*[range(o, o + s) for o, s in zip(box.offsets, box.sizes)]))


@given(st.integers(0, 3).flatmap(lambda n: st.tuples(boxes(n), boxes(n))))
def test_intersection_is_the_common_set_of_elements(pair):
    a, b = pair
    inter = a.intersect(b)
    common = cells(a) & cells(b)
    if inter is None:
        assert not common
    else:
        assert cells(inter) == common
        assert a.contains(inter) and b.contains(inter)


@given(st.integers(1, 3).flatmap(boxes), st.sampled_from([1, 2, 4]), st.integers(1, 400))
def test_split_box_covers_exactly_and_respects_the_limit(box, itemsize, max_bytes):
    pieces = split_box(box, itemsize, max_bytes)
    seen = []
    for p in pieces:
        assert box.contains(p)
        if p.numel > 1:
            assert p.numel * itemsize <= max_bytes
        seen.extend(cells(p))
    assert sorted(seen) == sorted(cells(box))  # every element exactly once


def test_relative_to_and_errors():
    outer = Box((10, 0), (10, 4))
    assert Box((12, 1), (2, 2)).relative_to(outer) == Box((2, 1), (2, 2))
    with pytest.raises(ValueError):
        Box((0, 0), (2, 2)).relative_to(outer)
    with pytest.raises(ValueError):
        Box((0,), (1, 2))
    with pytest.raises(ValueError):
        Box((-1,), (2,))
    assert str(Box((1, 0), (2, 3))) == "[1:3, 0:3]"
    assert Box((), ()).numel == 1
