import pytest

from awex.meta import Box, ExplicitSharding, Layout, Mesh, MeshSharding, Pin, Role, Shard, TensorLayout, TensorSpec


def layout(mesh, *tensors):
    return Layout("x", Role.TRAINER, mesh.size, (mesh,), tuple(tensors))


def test_mesh_coordinates_are_row_major():
    m = Mesh("m", (("pp", 2), ("dp", 3), ("tp", 2)))
    assert m.size == 12
    assert m.coords(0) == (0, 0, 0)
    assert m.coords(1) == (0, 0, 1)
    assert m.coords(2) == (0, 1, 0)
    assert m.coords(7) == (1, 0, 1)
    assert all(m.rank_of(m.coords(r)) == r for r in range(12))


def test_even_shard_and_replication():
    m = Mesh("m", (("dp", 2), ("tp", 2)))
    spec = TensorSpec("w", (8, 4), "float32")
    lay = layout(m, TensorLayout(spec, MeshSharding("m", (("tp", Shard(0)),))))
    assert lay.holdings("w") == ((Box((0, 0), (4, 4)), (0, 2)), (Box((4, 0), (4, 4)), (1, 3)))
    assert lay.rank_boxes(3) == {"w": (Box((4, 0), (4, 4)),)}


def test_ceil_chunks_blocks_and_empty_chunks():
    m = Mesh("m", (("tp", 4),))
    spec = TensorSpec("emb", (10, 2), "float32")
    ceil = layout(m, TensorLayout(spec, MeshSharding("m", (("tp", Shard(0)),))))
    assert [b.sizes[0] for b, _ in ceil.holdings("emb")] == [3, 3, 3, 1]
    # a padded vocabulary: blocks of 4 rows; rank 3 would hold rows 12..16, all padding -> holds nothing
    padded = layout(m, TensorLayout(spec, MeshSharding("m", (("tp", Shard(0, block=4)),))))
    assert [(b.offsets[0], b.sizes[0], r) for b, r in padded.holdings("emb")] == [
        (0, 4, (0,)),
        (4, 4, (1,)),
        (8, 2, (2,)),
    ]
    assert padded.rank_boxes(3) == {}


def test_parts_smaller_than_mesh_dimension_replicate_chunks():
    # vLLM with TP=4 and 2 KV heads: ranks 0,1 hold head 0 and ranks 2,3 hold head 1
    m = Mesh("m", (("tp", 4),))
    spec = TensorSpec("k", (2 * 8, 16), "bfloat16")
    lay = layout(m, TensorLayout(spec, MeshSharding("m", (("tp", Shard(0, parts=2)),))))
    assert lay.holdings("k") == ((Box((0, 0), (8, 16)), (0, 1)), (Box((8, 0), (8, 16)), (2, 3)))


def test_pins_and_nested_shards():
    m = Mesh("m", (("pp", 2), ("dp", 2), ("tp", 2)))
    spec = TensorSpec("w", (8, 6), "float32")
    sh = MeshSharding("m", (("pp", Pin((1,))), ("tp", Shard(0)), ("dp", Shard(0))))
    lay = layout(m, TensorLayout(spec, sh))
    # dp is outer to tp in the mesh, so dp splits first and tp splits dp's chunk
    got = {r: lay.rank_boxes(r).get("w") for r in range(8)}
    assert all(got[r] is None for r in range(4))
    assert got[4] == (Box((0, 0), (2, 6)),)
    assert got[5] == (Box((2, 0), (2, 6)),)
    assert got[6] == (Box((4, 0), (2, 6)),)
    assert got[7] == (Box((6, 0), (2, 6)),)


def test_explicit_boxes_allow_several_per_rank():
    m = Mesh("m", (("world", 2),))
    spec = TensorSpec("w", (6,), "float32")
    sh = ExplicitSharding(((0, (Box((0,), (2,)), Box((4,), (2,)))), (1, (Box((2,), (2,)),))))
    lay = layout(m, TensorLayout(spec, sh))
    assert lay.rank_boxes(0)["w"] == (Box((0,), (2,)), Box((4,), (2,)))


@pytest.mark.parametrize(
    "tensor, message",
    [
        (TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("nope")), "unknown mesh"),
        (TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("m", (("tp", Shard(1)),))), r"Shard\(dim=1\)"),
        (TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("m", (("tp", Shard(0, parts=3)),))), "3 parts"),
        (TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("m", (("tp", Pin((5,))),))), "Pin"),
        (
            TensorLayout(
                TensorSpec("w", (4,), "float32"), ExplicitSharding(((0, (Box((0,), (3,)), Box((2,), (2,)))),))
            ),
            "overlapping",
        ),
        (TensorLayout(TensorSpec("w", (4,), "float32"), ExplicitSharding(((0, (Box((2,), (3,)),)),))), "does not fit"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_tensor_named(tensor, message):
    with pytest.raises(ValueError, match=message) as err:
        layout(Mesh("m", (("tp", 4),)), tensor)
    assert "w" in str(err.value)


def test_duplicate_tensor_and_bad_dtype():
    m = Mesh("m", (("tp", 1),))
    t = TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("m"))
    with pytest.raises(ValueError, match="listed twice"):
        layout(m, t, t)
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorSpec("w", (4,), "float33")
    assert TensorSpec("w", (4,), "torch.bfloat16").dtype == "bfloat16"


def test_renamed_layout_shares_tables():
    m = Mesh("m", (("tp", 2),))
    lay = layout(m, TensorLayout(TensorSpec("w", (4,), "float32"), MeshSharding("m", (("tp", Shard(0)),))))
    other = lay.renamed("y")
    assert other.instance == "y" and other.tensors is lay.tensors
    assert other.holdings("w") == lay.holdings("w")
