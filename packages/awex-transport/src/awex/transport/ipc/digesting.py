"""Verify mode in the CUDA IPC executor: a receiver's digest of what it got, per origin (the sync rank each region
comes from), taken as it copies where a copy allows (:class:`~awex.transport.copy_digest.DigestingCopy`), of what
DMAs from other GPUs bring a group at a time as each group lands (:meth:`ReceivedDigests.landed`), and of the
destination after the copy for the rest. The sums are the same as
:mod:`awex.engines.sync.verify` takes of the receiver's views after the transfer, piece for piece."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from awex.transport.batched_copy import BatchedCopy
from awex.transport.copy_digest import DigestingCopy, Hashed, contiguous_positions, hashable
from awex.transport.digest import MOD, Digest, salt
from awex.transport.digest_batch import DigestBatch, Piece, batch_pieces
from awex.transport.shards import torch_dtype

Copy = tuple[torch.Tensor, torch.Tensor]
T = TypeVar("T")

DIGEST_GROUPS = 8
"""Verify mode: each stream of copies from other GPUs is digested in this many groups, each as soon as its copies
are done, so only the last group's digest follows the transfer."""


class ReceivedDigests:
    """One executor's digests of what it copied, a row of sums per origin. :meth:`note` every copy as it is
    planned (and :meth:`split` one cut into several copies); :meth:`batched` makes the launches that copy and
    digest; :meth:`landed` the digests of copies from other GPUs, each group run as soon as its copies are done
    while the later ones still move (prepared by :meth:`group` before the first run, then :meth:`seal`);
    :meth:`zero` is enqueued before every run, :meth:`read` after it (what was digested neither as it copied nor
    as it landed is digested then, in one batch)."""

    def __init__(self, device: torch.device, origins: Sequence[int]):
        self.origins = list(origins)
        self.device = device
        self.sums = torch.zeros(len(self.origins), 2, dtype=torch.int64, device=device)
        # id(destination view) -> (the view, its row, offsets in the canonical tensor, tensor shape, salt, plan dtype)
        self._pieces: dict[int, tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...], int, torch.dtype]] = {}
        self._fused: set[int] = set()
        self._parts: dict[int, list[torch.Tensor]] = {}  # id(noted view) -> the copies it was cut into
        self._early: set[int] = set()  # ids of parts digested as they landed (by a group's batch)
        self._groups: list[DigestBatch] = []
        self._streams: dict[int, torch.cuda.Stream] = {}  # id(copy stream) -> the stream digesting behind it
        self._rest: DigestBatch | None = None
        self.fresh = False  # a run's copies finished since the last read

    def note(self, dst: torch.Tensor, origin: int, tensor, offsets: tuple[int, ...], within) -> None:
        """Copy into ``dst`` of a region of plan tensor ``tensor`` (a :class:`~awex.meta.TensorSpec`) that starts at
        ``offsets``; ``within``: the piece's slices inside that region (``()`` for all of it)."""
        starts = tuple(o + s.start for o, s in zip(offsets, within)) if within else tuple(offsets)
        row, want = self.origins.index(origin), torch_dtype(tensor.dtype)
        self._pieces[id(dst)] = (dst, row, starts, tuple(tensor.shape), salt(tensor.name), want)

    def split(self, dst: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """The copy into noted ``dst`` goes as copies into ``parts`` (``dst`` itself, or runs of its first dim)."""
        if id(dst) in self._pieces:
            self._parts[id(dst)] = list(parts)

    def _item(self, i: int, part: torch.Tensor | None = None) -> Piece:
        view, row, starts, shape, key, want = self._pieces[i]
        if part is not None and part is not view:  # rows [r, r + n) of the view
            r, left = divmod(part.data_ptr() - view.data_ptr(), view.stride(0) * view.element_size())
            if left or r < 0:
                raise AssertionError(f"a part of a copy that is not a run of its rows (at {r}, {left} bytes in)")
            starts = (starts[0] + r, *starts[1:])
        return (row, view if part is None else part, starts, shape, key, want)

    def group(self, parts: Sequence[torch.Tensor]) -> int | None:
        """Lay out the digests of these copies (parts of noted pieces) for :meth:`landed` (before the first run,
        outside any capture); ``None`` where none of them is digested this way."""
        owner = {id(p): i for i, ps in self._parts.items() for p in ps} if parts else {}
        items = [self._item(owner[id(p)], p) for p in parts if id(p) in owner and owner[id(p)] not in self._fused]
        laid_out = batch_pieces(self.device, len(self.origins), items)
        if not laid_out.launches:
            return None
        self._early.update(id(it[1]) for it in items if not any(it[1] is lo[1] for lo in laid_out.loose))
        laid_out.loose = []  # those are digested by :meth:`read`
        self._groups.append(laid_out)
        return len(self._groups) - 1

    def seal(self) -> None:
        """After every :meth:`group`: lay out the rest (digested by :meth:`read`) and compile the kernels (a
        first launch, into scratch sums, outside any capture)."""
        rest: list[Piece] = []
        for i in self._pieces:
            if i in self._fused:
                continue
            parts = self._parts.get(i)
            if parts is None:
                rest.append(self._item(i))
            else:
                rest.extend(self._item(i, p) for p in parts if id(p) not in self._early)
        self._rest = batch_pieces(self.device, len(self.origins), rest)
        scratch = torch.zeros_like(self.sums)
        for laid_out in self._groups:
            laid_out.add_into(scratch, loose=False)

    def landed(self, group: int | None, stream: torch.cuda.Stream) -> torch.cuda.Stream | None:
        """Enqueue the digests of ``group`` (:meth:`group`) once what is enqueued on ``stream`` so far is done, on
        the stream that digests behind it (returned: the run waits for it too)."""
        if group is None:
            return None
        behind = self._streams.get(id(stream))
        if behind is None:
            behind = self._streams[id(stream)] = torch.cuda.Stream(self.device)
        behind.wait_stream(stream)
        with torch.cuda.stream(behind):
            self._groups[group].add_into(self.sums, loose=False)
        return behind

    def batched(self, copies: Sequence[Copy], spread: Sequence[Copy], spread_sources: Sequence[int]) -> Callable | None:
        """What copies ``copies`` and ``spread`` (as :class:`~awex.transport.batched_copy.BatchedCopy` would): those
        whose words can be digested as they copy in a :class:`DigestingCopy`, the others in a ``BatchedCopy``
        (digested by :meth:`read`). ``None`` where there is nothing to copy."""
        fused, plain, fused_far, plain_far, fused_at, plain_at = [], [], [], [], [], []
        for (d, s), at in [*((c, None) for c in copies), *zip(spread, spread_sources)]:
            h = self._hashed(d) if hashable(d, s, peer=at is not None) else None
            if h is None:
                (plain if at is None else plain_far).append((d, s))
                plain_at.extend([] if at is None else [at])
            else:
                (fused if at is None else fused_far).append((d, s, h))
                fused_at.extend([] if at is None else [at])
                self._fused.add(id(d))
        launches: list[Callable[[], None]] = []
        if fused or fused_far:
            launches.append(DigestingCopy(fused, self.sums, spread=fused_far, spread_sources=fused_at))
        if plain or plain_far:
            launches.append(BatchedCopy(plain, spread=plain_far, spread_sources=plain_at))
        if not launches:
            return None
        return launches[0] if len(launches) == 1 else lambda: [launch() for launch in launches]

    def _hashed(self, dst: torch.Tensor) -> Hashed | None:
        found = self._pieces.get(id(dst))
        if found is None or found[0] is not dst:
            return None
        view, row, starts, shape, key, want = found
        pos = contiguous_positions(view, starts, shape, key) if view.dtype == want else None
        return None if pos is None else Hashed(pos, row)

    def zero(self) -> None:
        """Enqueue zeroing the sums (before a run's copies, on the stream they follow)."""
        self.sums.zero_()

    @property
    def fused_bytes(self) -> int:
        """Bytes digested as they are copied."""
        return sum(self._pieces[i][0].nbytes for i in self._fused)

    @property
    def landed_bytes(self) -> int:
        """Bytes digested as they land (by :meth:`landed`)."""
        return sum(p.nbytes for ps in self._parts.values() for p in ps if id(p) in self._early)

    def read(self) -> dict[int, Digest]:
        """Per origin, the digest of every copy of the last run (the views' device waits for it; the copies digested
        neither as they copied nor as they landed are digested now)."""
        if self._rest is None:
            self.seal()
        self._rest.add_into(self.sums)
        values = self.sums.tolist()
        self.fresh = False
        return {origin: (a % MOD, b % MOD) for origin, (a, b) in zip(self.origins, values)}


def byte_groups(items: Sequence[T], parts: int, size: Callable[[T], int] = lambda c: c[0].nbytes) -> list[list[T]]:
    """``items`` (copies: their destination's bytes) in order, cut into at most ``parts`` runs of about equal
    ``size`` (an item is never cut)."""
    total = sum(size(x) for x in items)
    out: list[list[T]] = [[]]
    done = 0
    for x in items:
        out[-1].append(x)
        done += size(x)
        if done * parts >= total * len(out) and len(out) < parts:
            out.append([])
    return [g for g in out if g]
