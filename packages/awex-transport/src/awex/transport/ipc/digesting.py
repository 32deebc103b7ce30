"""Verify mode in the CUDA IPC executor: a receiver's digest of what it got, per origin (the sync rank each region
comes from), taken as it copies where a copy allows (:class:`~awex.transport.copy_digest.DigestingCopy`) and of
the destination after the copy for the rest. The sums are the same as
:mod:`awex.engines.sync.verify` takes of the receiver's views after the transfer, piece for piece."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from awex.transport.batched_copy import BatchedCopy
from awex.transport.copy_digest import DigestingCopy, Hashed, contiguous_positions, hashable
from awex.transport.digest import MOD, Digest, piece_sums, salt
from awex.transport.shards import torch_dtype

Copy = tuple[torch.Tensor, torch.Tensor]


class ReceivedDigests:
    """One executor's digests of what it copied, a row of sums per origin. :meth:`note` every copy as it is
    planned; :meth:`batched` makes the launches that copy and digest; :meth:`zero` is enqueued before every run;
    :meth:`read` after it (the copies not digested as they copied are digested then)."""

    def __init__(self, device: torch.device, origins: Sequence[int]):
        self.origins = list(origins)
        self.sums = torch.zeros(len(self.origins), 2, dtype=torch.int64, device=device)
        # id(destination view) -> (the view, its row, offsets in the canonical tensor, tensor shape, salt, plan dtype)
        self._pieces: dict[int, tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...], int, torch.dtype]] = {}
        self._fused: set[int] = set()
        self.fresh = False  # a run's copies finished since the last read

    def note(self, dst: torch.Tensor, origin: int, tensor, offsets: tuple[int, ...], within) -> None:
        """Copy into ``dst`` of a region of plan tensor ``tensor`` (a :class:`~awex.meta.TensorSpec`) that starts at
        ``offsets``; ``within``: the piece's slices inside that region (``()`` for all of it)."""
        starts = tuple(o + s.start for o, s in zip(offsets, within)) if within else tuple(offsets)
        row, want = self.origins.index(origin), torch_dtype(tensor.dtype)
        self._pieces[id(dst)] = (dst, row, starts, tuple(tensor.shape), salt(tensor.name), want)

    def _hashed(self, dst: torch.Tensor) -> Hashed | None:
        found = self._pieces.get(id(dst))
        if found is None or found[0] is not dst:
            return None
        view, row, starts, shape, key, want = found
        pos = contiguous_positions(view, starts, shape, key) if view.dtype == want else None
        return None if pos is None else Hashed(pos, row)

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

    def zero(self) -> None:
        """Enqueue zeroing the sums (before a run's copies, on the stream they follow)."""
        self.sums.zero_()

    @property
    def fused_bytes(self) -> int:
        """Bytes digested as they are copied."""
        return sum(self._pieces[i][0].nbytes for i in self._fused)

    def read(self) -> dict[int, Digest]:
        """Per origin, the digest of every copy of the last run (the views' device waits for it; the copies not
        digested as they copied are digested now)."""
        for i, (view, row, starts, shape, key, want) in self._pieces.items():
            if i not in self._fused:  # read as the plan's dtype, as the trainer's digest is
                piece_sums(view if view.dtype == want else view.to(want), starts, shape, key, self.sums[row])
        values = self.sums.tolist()
        self.fresh = False
        return {origin: (a % MOD, b % MOD) for origin, (a, b) in zip(self.origins, values)}
