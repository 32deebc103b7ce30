"""Which piece of a source's memory each piece of a CUDA IPC receiver's views is copied from.

Paired from the plan (:func:`pair_pieces`): every transfer's overlaps of the receiver's pieces with the source's, a
view of each side per overlap (a Qwen3-8B-shaped colocated engine: about 1,700 pairs, each two tensor slices). A
trainer whose weights moved (offloaded and loaded back, say) exports them again; where the new export holds the same
views as the old one (names, boxes, shapes, strides, dtypes, offsets within storages of the same sizes) and only
the storages' addresses changed, the pairs of the last build are re-pointed at the new storages instead
(:func:`rebased`: one view a pair, no box arithmetic), the receiver's own views likewise where its weights moved
too (an engine that re-allocates them between versions); anything else is paired anew. Either way the executor
then merges, batches and captures them as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from awex.meta import Plan
from awex.meta.errors import AwexValueError
from awex.transport.ipc.fp8_on_copy import Piece, quantize_pieces
from awex.transport.ipc.spans import paired_pieces
from awex.transport.shards import LocalShards

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view)


@dataclass
class Paired:
    """A receiver's pieces for one plan: the plain copies (before merging), the pieces quantised on the copy by
    tile block, and the bytes the plan brings it."""

    copies: list[Pair] = field(default_factory=list)
    to_quantize: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)
    nbytes: int = 0


def pair_pieces(
    plan: Plan, rank: int, shards: LocalShards, sources: Mapping[int, LocalShards], digest=None, copies=None
) -> Paired:
    """Sync rank ``rank``'s pieces of ``plan``, each destination view with the source view it is copied from.
    ``digest`` (verify mode's ``ReceivedDigests``) notes every plain piece. ``copies``: pairs of an earlier build
    re-pointed at the sources' new memory (:func:`rebased`; not with quantising or digests), taken as they are:
    only the plan's checks and its byte count run."""
    names = [t.name for t in plan.tensors]
    quantised = {q[0]: (q[2], q[3]) for q in plan.quantized}  # weight -> (scale tensor, tile block)
    out = Paired()
    if copies is not None:
        if quantised or digest is not None:
            raise AwexValueError("re-pointed pairs are for plain copies (no quantising on receive, no digests)")
        out.copies = list(copies)
    for step in plan.schedule(rank):
        if step.op != "recv":
            raise AwexValueError(f"rank {rank} would send over CUDA IPC (a relay): plan CUDA IPC syncs without relay")
        src = sources.get(step.peer)
        if src is None:
            raise KeyError(f"rank {rank}: no IPC export of source rank {step.peer}")
        for t in step.bucket.transfers:
            out.nbytes += t.nbytes
            if copies is not None:
                continue
            if names[t.tensor] in quantised:
                scale, block = quantised[names[t.tensor]]
                pieces = quantize_pieces(plan.tensors[t.tensor], scale, block, t, shards, src)
                out.to_quantize.setdefault(block, []).extend(pieces)
                continue
            for d, s, within in paired_pieces(names[t.tensor], t, shards, src):
                out.copies.append((d, s))
                if digest is not None:  # each piece digested on its own: not merged
                    digest.note(d, step.peer, plan.tensors[t.tensor], t.offsets, within)
    return out


def rebased(
    pairs: list[Pair],
    old: Mapping[int, LocalShards],
    new: Mapping[int, LocalShards],
    views: tuple[LocalShards, LocalShards] | None = None,
) -> list[Pair] | None:
    """``pairs`` (built over the sources ``old``) with each source view re-pointed at the storage that holds the
    same view in ``new``; with ``views`` (the receiver's own views then and now, where they moved too) each
    destination view likewise. ``None`` where the new views are not the same (:func:`storage_moves`) or a view of
    ``pairs`` lies in no storage of the old ones."""
    if set(old) != set(new):
        return None
    moves: dict[int, torch.UntypedStorage] = {}
    for peer, before in old.items():
        if storage_moves(before, new[peer], into=moves) is None:
            return None
    mine: dict[int, torch.UntypedStorage] | None = None
    if views is not None and views[0] is not views[1]:
        mine = storage_moves(*views)
        if mine is None:
            return None
    bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    out = []
    for d, s in pairs:
        s = _moved(s, moves, bases)
        d = _moved(d, mine, bases) if mine is not None else d
        if s is None or d is None:
            return None
        out.append((d, s))
    return out


def _moved(t: torch.Tensor, moves: dict, bases: dict) -> torch.Tensor | None:
    """View ``t`` at the same place of the storage its own moved to (``None``: its storage is not in ``moves``)."""
    address = t.untyped_storage().data_ptr()
    storage = moves.get(address)
    if storage is None:
        return None
    base = bases.get((storage.data_ptr(), t.dtype))
    if base is None:
        base = torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, 0, (0,), (1,))
        bases[(storage.data_ptr(), t.dtype)] = base
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def storage_moves(
    old: LocalShards, new: LocalShards, into: dict[int, torch.UntypedStorage] | None = None
) -> dict[int, torch.UntypedStorage] | None:
    """Where each storage of ``old``'s views lies now (its address -> ``new``'s storage), where ``new`` holds the
    same views: the same names, each with the same boxes, shapes, strides, dtypes, devices and offsets within
    storages of the same sizes, two views sharing a storage in ``old`` sharing one in ``new``; else ``None``.
    ``into``: moves found before (other sources'), added to and returned; a storage they move elsewhere: ``None``."""
    out: dict[int, torch.UntypedStorage] = {} if into is None else into
    exports = getattr(old, "export", None), getattr(new, "export", None)
    if exports[0] is not None and exports[1] is not None and exports[0].views is exports[1].views:
        # two opened exports of the same views (awex.transport.ipc.wire: the second kept the first's), each over
        # its own storages in order: the same views by construction, each storage's move read off its index
        if len(old.storages) != len(new.storages):
            return None
        for sa, sb in zip(old.storages, new.storages):
            if sa.nbytes() != sb.nbytes() or sa.device != sb.device:
                return None
            if out.setdefault(sa.data_ptr(), sb).data_ptr() != sb.data_ptr():
                return None
        return out
    if set(old.names()) != set(new.names()):
        return None
    for name in old.names():
        before, now = old.pairs(name), new.pairs(name)
        if len(before) != len(now):
            return None
        for (box_a, a), (box_b, b) in zip(before, now):
            if (
                box_a != box_b
                or a.shape != b.shape
                or a.stride() != b.stride()
                or a.dtype != b.dtype
                or a.device != b.device
                or a.storage_offset() != b.storage_offset()
            ):
                return None
            sa, sb = a.untyped_storage(), b.untyped_storage()
            if sa.nbytes() != sb.nbytes() or out.setdefault(sa.data_ptr(), sb).data_ptr() != sb.data_ptr():
                return None
    return out
