"""Merged copies equal the copies they replace; IPC exports cross process boundaries as plain data."""

from __future__ import annotations

import json

import pytest
import torch

from awex.meta import Box
from awex.transport import LocalShards
from awex.transport.copies import copier, merge_copies, wide_views
from awex.transport.ipc import ExportedView, IpcExport, export_shards
from awex.transport.ipc.scheduling import interleave_by_source, interleave_sources, paces_local, ring_slots
from awex.transport.ipc.spans import extent as _extent
from awex.transport.ipc.spans import in_chunks
from awex.transport.ipc.spans import rows_within as _rows_within


def _apply(copies):
    for d, s in copies:
        d.copy_(s)


@pytest.mark.parametrize("seed", range(5))
def test_merged_copies_write_exactly_what_the_separate_copies_write(seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(64, 16, generator=g)
    a, b = torch.zeros(48, 16), torch.zeros(48, 16)
    groups, rows, skip = 4, 6, 10  # a Megatron-like fused source: `rows` useful rows every `skip`
    copies = []
    for dst in (a, b):
        pieces = [(dst[i * rows : (i + 1) * rows], src[i * skip : i * skip + rows]) for i in range(groups)]
        pieces += [(dst[30:31], src[63:64]), (dst[40:48, 2:5], src[0:8, 0:3])]  # irregular tail
        copies.append(pieces)
    _apply(copies[0])
    merged = merge_copies(copies[1])
    _apply(merged)
    assert torch.equal(a, b)
    assert len(merged) == 3  # the regular run became one strided copy


def test_ipc_export_round_trips_through_json_without_pickle():
    handle = bytes(range(64))
    export = IpcExport(
        storages=((0, handle, 4096, 0, b"ref", 8, b"evt", True),),
        pointers=(1234,),
        views=(ExportedView("w", Box((0, 0), (4, 8)), 0, 16, (8, 1), "bfloat16"),),
    )
    wire = json.loads(json.dumps(export.to_wire()))
    assert IpcExport.from_wire(wire) == export
    with pytest.raises(ValueError, match="malformed IPC export"):
        IpcExport.from_wire({"storages": []})


def _hostile(edit):
    handle = bytes(range(64))
    export = IpcExport(
        storages=((0, handle, 4096, 0, b"ref", 8, b"evt", True),),
        pointers=(1234,),
        views=(ExportedView("w", Box((0, 0), (4, 8)), 0, 16, (8, 1), "bfloat16"),),
    )
    wire = json.loads(json.dumps(export.to_wire()))
    edit(wire)
    return wire


HOSTILE = [
    (lambda w: w["views"][0].__setitem__(3, -1), "storage index"),  # used to pick another storage silently
    (lambda w: w["views"][0].__setitem__(3, 1), "names storage 1 of 1"),
    (lambda w: w["views"][0].__setitem__(4, -16), "element offset"),
    (lambda w: w["views"][0].__setitem__(5, ["8", 1]), "stride"),
    (lambda w: w["views"][0].__setitem__(6, "complex1024"), "unknown dtype"),
    (lambda w: w["views"][0].__setitem__(4, 4096), "beyond its storage"),  # offsets past the handle's memory
    (lambda w: w["views"][0].__setitem__(2, [4, 8, 2]), "different lengths"),
    (lambda w: w["storages"][0].__setitem__(2, -1), "storage field"),
    (lambda w: w["storages"][0].__setitem__(1, {"b64": "!!!"}), "malformed"),
    (lambda w: w["storages"][0].__setitem__(1, {"b64": "A" * 8000}), "handle of"),
    (lambda w: w.__setitem__("pointers", []), "0 pointers for 1 storages"),
    (lambda w: w.__setitem__("views", {"a": 1}), "views"),
    (lambda w: w["storages"][0].__setitem__(0, "gpu0"), "storage field"),
    # what PyTorch returns, exactly: eight fields of their kinds, within bounds
    (lambda w: w["storages"][0].pop(), "list of 8 fields"),
    (lambda w: w["storages"][0].extend([1, 2, 3, 4]), "list of 8 fields"),
    (lambda w: w["storages"][0].__setitem__(0, True), "storage field device: bool"),
    (lambda w: w["storages"][0].__setitem__(7, 1), "storage field event_sync: int"),
    (lambda w: w["storages"][0].__setitem__(4, 8), "storage field ref_handle: int"),
    (lambda w: w["storages"][0].__setitem__(3, 1 << 61), "out of range"),
    (lambda w: w["storages"][0].__setitem__(0, 1 << 20), "out of range"),
    # an empty view's offset lies inside its storage too
    (lambda w: w["views"][0].__setitem__(2, [0, 8]) or w["views"][0].__setitem__(4, 1 << 61), "beyond its storage"),
]


@pytest.mark.parametrize("edit, why", HOSTILE)
def test_hostile_ipc_exports_are_refused_before_anything_is_opened(edit, why):
    IpcExport.from_wire(_hostile(lambda w: None))  # the untouched one parses
    with pytest.raises(ValueError, match="malformed IPC export") as err:
        IpcExport.from_wire(_hostile(edit))
    assert why in str(err.value)


@pytest.mark.parametrize("edit, why", HOSTILE)
def test_hostile_exports_after_a_good_one_are_refused_alike(edit, why):
    """Read with the export before it as ``last`` (whose views a moved trainer's new export keeps), every hostile
    export is refused as it is alone: only values equal to what was checked are taken from ``last``."""
    good = IpcExport.from_wire(_hostile(lambda w: None))
    with pytest.raises(ValueError, match="malformed IPC export") as err:
        IpcExport.from_wire(_hostile(edit), last=good)
    assert why in str(err.value)


def test_an_export_of_the_same_views_over_new_storages_keeps_them_and_checks_their_bounds():
    """A trainer's memory moved whole: its new export holds the same views over other storages. The reader keeps
    the views it checked (the same objects: the IPC executor re-points its copies storage by storage) and checks
    only that each new storage holds what its views reach; views that differ are read anew."""
    first = IpcExport.from_wire(_hostile(lambda w: None))
    moved = _hostile(lambda w: w["storages"][0].__setitem__(1, {"b64": "QUJD" * 16}) or w["pointers"].__setitem__(0, 8))
    again = IpcExport.from_wire(moved, last=first)
    assert again.views is first.views and again == IpcExport.from_wire(moved) and again.pointers == (8,)
    # the view reaches (16 + 3 * 8 + 7 + 1) * 2 = 96 bytes of its storage
    exact = IpcExport.from_wire(_hostile(lambda w: w["storages"][0].__setitem__(2, 96)), last=first)
    assert exact.views is first.views
    for alone in (None, first):
        with pytest.raises(ValueError, match="beyond"):
            IpcExport.from_wire(_hostile(lambda w: w["storages"][0].__setitem__(2, 95)), last=alone)
        with pytest.raises(ValueError, match="1 of 1|storage 1"):
            IpcExport.from_wire(_hostile(lambda w: w["views"][0].__setitem__(3, 1)), last=alone)
    other = IpcExport.from_wire(_hostile(lambda w: w["views"][0].__setitem__(4, 32)), last=first)
    assert other.views is not first.views and other.views[0].offset == 32
    assert json.loads(json.dumps(again.to_wire())) == moved


def test_ipc_export_needs_cuda_views():
    shards = LocalShards({"w": [(Box((0,), (4,)), torch.zeros(4))]})
    with pytest.raises(ValueError, match="CUDA IPC needs CUDA views"):
        export_shards(shards)


@pytest.mark.parametrize("branches", [1, 2, 3, 5])
def test_local_copies_dealt_to_branches_once_each_in_order_and_balanced(branches):
    from awex.transport.ipc.spans import balance as _balance

    g = torch.Generator().manual_seed(branches)
    sizes = [int(x) for x in torch.randint(1, 1000, (40,), generator=g)]
    copies = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    dealt = _balance(copies, branches)
    assert len(dealt) == branches
    seen = [id(d) for part in dealt for d, _ in part]
    assert sorted(seen) == sorted(id(d) for d, _ in copies)  # every copy exactly once
    order = {id(d): i for i, (d, _) in enumerate(copies)}
    for part in dealt:
        idx = [order[id(d)] for d, _ in part]
        assert idx == sorted(idx)  # plan order kept within a branch
    loads = [sum(d.numel() for d, _ in part) for part in dealt]
    assert max(loads) - min(loads) <= max(sizes)


def test_mapped_shards_find_the_region_an_address_lies_in():
    from awex.transport.ipc import MappedShards

    shards = MappedShards({"w": [(Box((0,), (4,)), torch.zeros(4))]}, [(5000, 6000), (1000, 2000)])
    assert shards.regions == ((1000, 2000), (5000, 6000))
    assert shards.region_of(1000) == (1000, 2000)
    assert shards.region_of(1999) == (1000, 2000)
    assert shards.region_of(5500) == (5000, 6000)
    for outside in (999, 2000, 4999, 6000):
        assert shards.region_of(outside) is None


@pytest.mark.parametrize("first", [0, 1])
def test_spans_from_several_sources_are_read_evenly_and_receivers_start_apart(first):
    # two source GPUs with spans of different sizes, each in address order
    a = [(10, ("a", i)) for i in range(6)]  # 60 bytes
    b = [(30, ("b", i)) for i in range(2)]  # 60 bytes
    order = interleave_sources([a, b], first=first)
    assert sorted(order) == sorted(x for _, x in a + b)  # each span once
    assert [x for x in order if x[0] == "a"] == [x for _, x in a]  # each source keeps its order
    assert order[0][0] == "ab"[first]  # receivers begin at different sources
    # at every point neither source is more than one span ahead of the other in the share of its bytes taken
    taken = {"a": 0, "b": 0}
    for src, _ in order:
        taken[src] += 10 if src == "a" else 30
        assert abs(taken["a"] - taken["b"]) <= 30
    # one source after the other (what plain address order gives) would fail that
    assert interleave_sources([a], first=first) == [x for _, x in a]
    assert interleave_sources([], first=first) == []
    # the same, the items grouped by their source first (as the executor's spans and kernel reads are)
    mixed = [x for pair in zip([x for _, x in a], [x for _, x in b] + [None] * 4) for x in pair if x is not None]
    size = {"a": 10, "b": 30}
    assert interleave_by_source(mixed, lambda x: x[0], lambda x: size[x[0]], first) == order


def test_query_rows_out_of_a_fused_qkv_are_copied_as_8_byte_words():
    groups, q_rows, kv_rows, hidden = 4, 2, 1, 8
    fused = torch.randn(groups, q_rows + 2 * kv_rows, hidden).to(torch.bfloat16)
    src = fused[:, :q_rows]  # every group's query rows: strided
    dst = torch.empty(groups, q_rows, hidden, dtype=torch.bfloat16)
    wide = wide_views(dst, src)
    assert wide is not None and wide[0].dtype == torch.int64 and wide[0].shape == (groups, q_rows, hidden // 4)
    copier(dst, src)()
    assert torch.equal(dst, src)
    assert wide_views(dst, dst) is None  # both contiguous: a plain copy
    assert wide_views(dst.transpose(1, 2), src.transpose(1, 2)) is None  # innermost dim strided: no wide view


@pytest.mark.parametrize("seed", range(30))
def test_wide_copies_write_exactly_what_copy_writes(seed):
    g = torch.Generator().manual_seed(seed)
    rng = __import__("random").Random(seed)
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32, torch.uint8])
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    shape = (rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 2, 4, 8, 12]))
    pad = (rng.choice([0, 4, 8]), rng.choice([0, 1, 4]))  # extra rows / columns around the views

    def strided():
        base = (
            torch.randint(-100, 100, (shape[0] * (shape[1] + pad[0]) * (shape[2] + pad[1]) + 16,), generator=g)
            .to(bits)
            .view(dtype)
        )  # any bit pattern, NaN payloads included
        off = rng.choice([0, 4, 8])
        stride = ((shape[1] + pad[0]) * (shape[2] + pad[1]), shape[2] + pad[1], 1)
        return base, lambda b: b.as_strided(shape, stride, off)

    (src_base, src_at), (dst_base, dst_at) = strided(), strided()
    expected = dst_base.clone().view(bits)
    dst_at(expected).copy_(src_at(src_base.view(bits)))  # the reference: the same bits, element by element
    copier(dst_at(dst_base), src_at(src_base))()
    assert torch.equal(dst_base.view(bits), expected)  # what the views cover, and nothing around them


@pytest.mark.parametrize("seed", range(5))
def test_bounce_ring_never_overwrites_bytes_not_yet_placed(seed):
    """Replays the ring in order: a span may land only where every earlier span has been placed, which waiting
    for ``after`` (and, placements being in order, everything before it) guarantees; spans stay inside."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 100, (40,), generator=g)]
    capacity = 4 * max(sizes)
    slots = ring_slots(sizes, capacity, align=16)
    for i, ((offset, after), n) in enumerate(zip(slots, sizes)):
        assert offset % 16 == 0 and offset + n <= capacity
        placed_before = after if after is not None else -1  # every span <= after is placed when i starts
        for j in range(placed_before + 1, i):  # still unplaced (in flight or waiting): must not overlap
            o, m = slots[j][0], sizes[j]
            assert o + m <= offset or offset + n <= o, (i, j)
        if after is not None:  # and waiting is needed: `after` really overlaps
            o, m = slots[after][0], sizes[after]
            assert not (o + m <= offset or offset + n <= o)
    # small spans keep many in flight: with equal spans of a quarter of the ring, 4 at once, then each waits
    # for the one 4 before it
    assert [a for _, a in ring_slots([16] * 8, 64)] == [None, None, None, None, 0, 1, 2, 3]
    with pytest.raises(ValueError):
        ring_slots([65], 64)


def test_large_strided_copies_are_cut_into_rows_that_fit_a_bounce_buffer():
    src = torch.arange(64 * 40, dtype=torch.float32).view(64, 40)[:, :20]  # column half: strided, 3200 B
    dst = torch.zeros(64, 20)
    parts = _rows_within(dst, src, 1000)
    assert len(parts) > 1
    for d, s in parts:
        lo, hi = _extent(s)
        assert hi - lo <= 1000
        d.copy_(s)
    assert torch.equal(dst, src)
    assert len(_rows_within(torch.zeros(64, 40), torch.ones(64, 40), 100)) == 1  # contiguous: one DMA does it
    wide = torch.zeros(2, 1000)[:, :500]  # one row alone is larger than the limit: left whole (a direct copy)
    assert len(_rows_within(wide, torch.ones(2, 500), 100)) == 1


def test_same_gpu_copies_are_paced_only_where_peer_dmas_take_longer():
    gb = 10**9
    assert paces_local(int(8.2 * gb), int(8.2 * gb))  # dense colocated TP=2 -> TP=1: DMAs at 1/5 the rate
    assert not paces_local(int(0.85 * gb), int(15.4 * gb))  # MoE, experts whole on every trainer rank
    assert not paces_local(0, 1)  # nothing from a peer
    assert paces_local(1, 0)


def test_kernel_reads_in_chunks_cover_each_copy_once_at_the_right_source_address():
    """Contiguous copies cut by bytes, row-parallel halves by whole rows; every chunk's read address is its
    source's, shifted as the chunk is; applying the chunks is applying the copies."""
    whole = torch.zeros(40, 64, dtype=torch.bfloat16)
    half = torch.randn(40, 32).to(torch.bfloat16)
    flat_dst, flat_src = torch.zeros(1000, dtype=torch.bfloat16), torch.randn(1000).to(torch.bfloat16)
    copies = [(flat_dst, flat_src), (whole[:, 32:], half)]
    at = [1 << 20, 1 << 30]  # where a kernel would read each source (another process's mapping)
    chunks, chunks_at = in_chunks(copies, at, 512)
    assert [d.nbytes for d, _ in chunks[:4]] == [512, 512, 512, 464]  # 2,000 bytes by 512
    assert [d.shape[0] for d, _ in chunks[4:]] == [8] * 5  # rows of 64 bytes, 8 a chunk
    for (d, s), a in zip(chunks, chunks_at):
        base, origin = (flat_src, at[0]) if d.dim() == 1 else (half, at[1])
        assert a - origin == s.data_ptr() - base.data_ptr()
        d.copy_(s)
    assert torch.equal(flat_dst, flat_src) and torch.equal(whole[:, 32:], half) and not bool(whole[:, :32].any())
