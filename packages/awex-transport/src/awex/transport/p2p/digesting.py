"""Verify mode over point to point (:class:`WaveDigests`): each side digests what a wave moved while later waves
are on the wire, instead of digesting everything after the transfer. A sender digests the regions it originates
(``awex.meta.origins``) as it posts the wave that first sends each, from its own views (frozen for the version); a
receiver digests what it got as each wave is unpacked, in its views. On CUDA and NPU the digests run on a stream of
their own behind the packing and unpacking streams; on CPU in line, after each wave. The sums are those
``awex.engines.sync.verify`` takes after the transfer, region for region (``awex.transport.digest``)."""

from __future__ import annotations

import torch

from awex.meta import Plan
from awex.meta.origins import transfer_origins
from awex.transport.accelerator import device_api, is_accelerator
from awex.transport.digest import MOD, Digest, grouped
from awex.transport.digest_batch import DigestBatch, Piece, batch_pieces, plan_region, region_pieces
from awex.transport.shards import LocalShards

RegionKey = tuple[int, tuple[int, ...], tuple[int, ...]]  # (plan tensor index, offsets, sizes)


class WaveDigests:
    """One rank's digests of one plan over its views ``shards``, taken wave by wave (built once per plan and
    views). :meth:`zero` before a run, :meth:`sent` / :meth:`received` as the executor posts and unpacks each wave,
    :meth:`wait` at its end; then :meth:`read` once."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards):
        self.device = shards.device
        index: dict[RegionKey, int] = {}
        first_sent: dict[RegionKey, int] = {}
        for b in plan.buckets:
            if b.src == rank:
                for t in b.transfers:
                    key = (t.tensor, t.offsets, t.sizes)
                    first_sent[key] = min(first_sent.get(key, b.wave), b.wave)
        self.sends: dict[int, list[int]] = {}  # receiving sync rank -> regions this rank originates for it
        self.receives: dict[int, list[int]] = {}  # origin sync rank -> regions this rank got from it
        at: dict[tuple[str, int], list[Piece]] = {}  # ("sent" or "got", wave) -> pieces to digest then
        for b, t, o in transfer_origins(plan):
            if o != rank and b.dst != rank:
                continue
            key = (t.tensor, t.offsets, t.sizes)
            fresh = key not in index
            i = index.setdefault(key, len(index))
            when = ("sent", first_sent[key]) if o == rank else ("got", b.wave)
            (self.sends.setdefault(b.dst, []) if o == rank else self.receives.setdefault(o, [])).append(i)
            if fresh:
                at.setdefault(when, []).extend(region_pieces(shards, i, plan_region(plan, key)))
        self.count = len(index)
        self.sums = torch.zeros(max(1, self.count), 2, dtype=torch.int64, device=self.device)
        self._at: dict[tuple[str, int], DigestBatch] = {
            when: batch_pieces(self.device, self.count, pieces) for when, pieces in at.items()
        }
        self.views = {when: [p[1] for p in pieces] for when, pieces in at.items()}  # what each hook digests
        self._shards = shards  # kept alive: the batches hold its views' addresses
        accelerated = is_accelerator(self.device)
        self._api = device_api(self.device) if accelerated else None
        self.stream = self._api.Stream(self.device) if accelerated else None
        self.fresh = False

    def zero(self, stream=None) -> None:
        """Before a run: the sums start at zero once what ``stream`` (the caller's) enqueued so far is done."""
        self.fresh = False
        if self.stream is None or stream is None:
            self.sums.zero_()
            return
        self.stream.wait_stream(stream)
        with self._api.stream(self.stream):
            self.sums.zero_()

    def sent(self, wave: int, stream=None) -> None:
        """Wave ``wave`` is posted (its packing enqueued on ``stream``): digest the regions it first sends."""
        self._digest(("sent", wave), stream)

    def received(self, wave: int, stream=None) -> None:
        """Wave ``wave``'s unpacking is enqueued on ``stream``: digest what it brought once it is in the views."""
        self._digest(("got", wave), stream)

    def _digest(self, when: tuple[str, int], stream) -> None:
        laid_out = self._at.get(when)
        if laid_out is None:
            return
        if self.stream is None or stream is None:
            laid_out.add_into(self.sums)
            return
        self.stream.wait_stream(stream)
        with self._api.stream(self.stream):
            laid_out.add_into(self.sums)

    def wait(self, stream=None) -> None:
        """The run's end: ``stream`` (the caller's) waits for every digest; :meth:`read` may follow."""
        if self.stream is not None and stream is not None:
            stream.wait_stream(self.stream)
        self.fresh = True

    def read(self) -> tuple[dict[int, Digest], dict[int, Digest]]:
        """``(sent, received)``: per receiving sync rank, the digest of the regions this rank originates for it;
        per origin, of the regions it got from it (the views' device waits for the sums)."""
        values = [(a % MOD, b % MOD) for a, b in self.sums.tolist()]
        self.fresh = False
        return grouped(self.sends, values), grouped(self.receives, values)
