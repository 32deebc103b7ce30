"""A CUDA IPC receiver's pairs (each destination view with the source view it is copied from) and their re-pointing
at a source's new memory when the trainer's weights moved (``awex.transport.ipc.pairing``). Pure tensor views: on
the CPU here; the GPU test ``moved-colocated-1gpu-ipc`` runs them through the executor, every byte checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.meta import Box, PlanOptions, canonical_tensors, plan_transfers
from awex.meta.errors import AwexValueError
from awex.meta.layouts import VllmParallel, hf_layout, vllm_layout
from awex.transport.ipc.mapping import MappedShards, views_over
from awex.transport.ipc.pairing import pair_pieces, rebased, storage_moves
from awex.transport.ipc.wire import ExportedView, IpcExport
from awex.transport.shards import LocalShards

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def _world():
    """A trainer rank holding every tensor of a tiny Qwen2 and a TP=2 engine's rank 1, planned: the plan, the
    engine rank's sync rank, the trainer's, the engine rank's views, the trainer's layout, the tensors' shapes."""
    tensors = canonical_tensors(CONFIG, dtype="float32")
    trainer_layout = hf_layout(tensors, "trainer", "trainer")
    engine_layout = vllm_layout(tensors, VllmParallel(tp=2), instance="eng")
    held: dict = {}

    def view_of(name, box):
        return held.setdefault((name, box), torch.zeros(box.sizes))

    mine = LocalShards.from_layout(engine_layout, 1, view_of)
    plan = plan_transfers([trainer_layout], [engine_layout], PlanOptions(relay=False))
    rank = next(i for i, r in enumerate(plan.ranks) if r.instance == "eng" and r.local_rank == 1)
    origin = next(i for i, r in enumerate(plan.ranks) if r.instance == "trainer")
    shapes = {t.name: t.spec.shape for t in tensors}
    return plan, rank, origin, mine, trainer_layout, shapes


def _flat(shapes, seed: int) -> dict[str, torch.Tensor]:
    """Every weight a view of one flat buffer (as a trainer's contiguous parameter buffer)."""
    total = sum(torch.Size(s).numel() for s in shapes.values())
    flat = torch.randn(total, generator=torch.Generator().manual_seed(seed))
    out, at = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = flat[at : at + n].view(shape)
        at += n
    return out


def _source(layout, weights) -> LocalShards:
    return LocalShards.from_layout(layout, 0, lambda name, box: weights[name][box.slices()])


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def test_pairs_re_pointed_at_moved_memory_are_the_pairs_made_anew():
    """The trainer's weights moved to a new buffer laid out alike: every re-pointed source view lies exactly where
    pairing anew over the new memory puts it, and copies the new weights' values."""
    plan, rank, origin, mine, layout, shapes = _world()
    before, after = _source(layout, _flat(shapes, 1)), _source(layout, _flat(shapes, 2))
    pairs = pair_pieces(plan, rank, mine, {origin: before}).copies
    assert len(pairs) > 20
    moved = rebased(pairs, {origin: before}, {origin: after})
    fresh = pair_pieces(plan, rank, mine, {origin: after}).copies
    assert moved is not None and len(moved) == len(fresh)
    for (d, s), (d2, s2) in zip(moved, fresh):
        assert _where(d) == _where(d2) and _where(s) == _where(s2)
        assert torch.equal(s, s2)
    again = pair_pieces(plan, rank, mine, {origin: after}, copies=moved)
    assert again.copies == moved and again.nbytes == pair_pieces(plan, rank, mine, {origin: after}).nbytes


def test_sources_laid_out_otherwise_are_paired_anew():
    """``None`` (pair anew) where the new memory does not hold the same views: the weights in separate tensors where
    they shared one buffer; one weight transposed in place (another stride); a source rank more or less."""
    plan, rank, origin, mine, layout, shapes = _world()
    before = _source(layout, _flat(shapes, 1))
    pairs = pair_pieces(plan, rank, mine, {origin: before}).copies
    apart = {name: torch.randn(shape) for name, shape in shapes.items()}
    assert rebased(pairs, {origin: before}, {origin: _source(layout, apart)}) is None
    assert storage_moves(before, _source(layout, apart)) is None
    square = next(n for n, s in shapes.items() if len(s) == 2 and s[0] == s[1])
    turned = _flat(shapes, 3)
    turned[square] = turned[square].t()  # same shape, other strides
    assert rebased(pairs, {origin: before}, {origin: _source(layout, turned)}) is None
    assert rebased(pairs, {origin: before}, {origin: before, origin + 100: before}) is None


def test_a_pair_whose_source_is_not_among_the_old_views_is_paired_anew():
    plan, rank, origin, mine, layout, shapes = _world()
    before, after = _source(layout, _flat(shapes, 1)), _source(layout, _flat(shapes, 2))
    pairs = pair_pieces(plan, rank, mine, {origin: before}).copies
    d, s = pairs[0]
    assert rebased([*pairs, (d, s.clone())], {origin: before}, {origin: after}) is None


def test_re_pointed_pairs_are_refused_with_quantising_or_digests():
    plan, rank, origin, mine, layout, shapes = _world()
    before = _source(layout, _flat(shapes, 1))
    pairs = pair_pieces(plan, rank, mine, {origin: before}).copies
    with pytest.raises(AwexValueError, match="plain copies"):
        pair_pieces(plan, rank, mine, {origin: before}, digest=object(), copies=pairs)


def test_the_receivers_own_views_re_pointed_where_they_moved_too():
    """Both sides moved (the engine re-allocated its weights as well): with the engine's views then and now, every
    destination view is re-pointed too, to where pairing anew puts it; engine views laid out otherwise (one weight in
    a tensor of other strides) are paired anew."""
    plan, rank, origin, mine, layout, shapes = _world()
    before, after = _source(layout, _flat(shapes, 1)), _source(layout, _flat(shapes, 2))
    pairs = pair_pieces(plan, rank, mine, {origin: before}).copies
    again = LocalShards({n: [(box, torch.zeros_like(v)) for box, v in mine.pairs(n)] for n in mine.names()})
    moved = rebased(pairs, {origin: before}, {origin: after}, (mine, again))
    fresh = pair_pieces(plan, rank, again, {origin: after}).copies
    assert moved is not None and len(moved) == len(fresh)
    assert all(_where(d) == _where(d2) and _where(s) == _where(s2) for (d, s), (d2, s2) in zip(moved, fresh))
    assert {d.untyped_storage().data_ptr() for d, _ in moved}.isdisjoint(
        {d.untyped_storage().data_ptr() for d, _ in pairs}
    )
    name = next(n for n in mine.names() if mine.pairs(n)[0][1].dim() == 2)
    box, view = mine.pairs(name)[0]
    other = {n: list(again.pairs(n)) for n in again.names()}
    other[name][0] = (box, torch.zeros(view.shape[1], view.shape[0]).t())  # same shape, other strides
    assert rebased(pairs, {origin: before}, {origin: after}, (mine, LocalShards(other))) is None


def _opened(views, sizes) -> tuple[MappedShards, LocalShards]:
    """An export of ``views`` over new storages of ``sizes`` bytes, opened as ``open_export`` opens one (its views
    made by ``views_over``; on the CPU here); and the same views without the export."""
    storages = [torch.UntypedStorage(n) for n in sizes]
    fields = tuple((0, b"h", n, 0, b"r", 0, b"e", True) for n in sizes)
    export = IpcExport(fields, tuple(st.data_ptr() for st in storages), views)
    shards = views_over(export, storages)
    return MappedShards(shards, [], {}, export, storages), LocalShards(shards)


def test_opened_exports_of_the_same_views_move_storage_by_storage(monkeypatch):
    """A trainer's new export that kept its last one's views (``awex.transport.ipc.wire``) moves each storage by its
    index, looking at no view: the moves the view-by-view check finds; none where a storage's size or the number
    of storages differs."""
    views = (
        ExportedView("a", Box((0,), (8,)), 0, 0, (1,), "float32"),
        ExportedView("b", Box((0, 0), (2, 4)), 1, 4, (4, 1), "float32"),
        ExportedView("c", Box((0,), (4,)), 1, 0, (1,), "float32"),
    )
    (old, old_plain), (new, new_plain) = _opened(views, (32, 48)), _opened(views, (32, 48))
    slow = {k: v.data_ptr() for k, v in storage_moves(old_plain, new_plain).items()}
    with monkeypatch.context() as m:
        m.setattr(MappedShards, "pairs", lambda *_: pytest.fail("a view looked at"))
        fast = storage_moves(old, new)
        assert fast is not None and {k: v.data_ptr() for k, v in fast.items()} == slow
        assert storage_moves(old, _opened(views, (32, 64))[0]) is None  # a storage of another size
        assert storage_moves(old, _opened(views, (32, 48, 16))[0]) is None  # a storage more
    other = tuple([*views])  # equal views, another object: the view-by-view check
    assert storage_moves(old, _opened(other, (32, 48))[0]) is not None
