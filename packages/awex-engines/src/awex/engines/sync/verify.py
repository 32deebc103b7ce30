"""Verify mode (``WeightsWriter(verify=True)``): a receiving rank counts a version as applied only when a digest of
every region it got equals the digest its senders took of the same regions in their own memory.

Digests are :mod:`awex.transport.digest`'s: independent of how either side's memory cuts a region, so a trainer
rank digests its views and a receiver its own (the engine's weights in place, or its staging tensors), after the
transfer or, where the transport took them as the bytes moved (``Transport.sent_digests`` / ``received_digests``:
p2p waves, CUDA IPC copies), from it. Regions are grouped by the trainer rank they come from (*origin*): a region a
receiver got through a relay counts as its origin's, so the comparison holds over every transport and plan. Each trainer
rank publishes one record per attempt (``verify/<version>/<count>/<instance>:<rank>``: the plan's digest and, per
receiving sync rank, the digest of the regions it originates for it) through the MetaServer, whose token guards it;
a receiver reads its origins' records, compares, and fails the version (:class:`VerifyError`, reported to the
trainers like any failure) where one differs. Nothing in the bytes that moved, a shared-memory segment's included,
can make a mismatch pass: the expected digests never travel with them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from awex.engines.sync import keys
from awex.engines.sync.manifest import SyncManifest
from awex.meta import Plan
from awex.meta.client import MetaClient, MetaTimeoutError
from awex.meta.origins import transfer_origins
from awex.transport import digest_batch
from awex.transport.base import TransferError
from awex.transport.digest import MOD, Digest, grouped, region_sums
from awex.transport.digest_batch import DigestBatch, plan_region
from awex.transport.shards import LocalShards

log = logging.getLogger("awex.engines")

RegionKey = tuple[int, tuple[int, ...], tuple[int, ...]]  # (plan tensor index, offsets, sizes)
_HEX = re.compile(r"^[0-9a-f]{32}$")
WAIT_SLICE_SECONDS = 1.0  # a receiver waiting for a record checks this often that its origins on its host run


class VerifyError(TransferError):
    """What a receiving rank holds of a version differs from what its senders held (verify mode), or a sender's
    digests never came."""


@dataclass(frozen=True)
class Regions:
    """One sync rank's share of a plan, grouped for verify mode."""

    sends: Mapping[int, tuple[RegionKey, ...]]  # receiving sync rank -> the regions this rank originates for it
    receives: Mapping[int, tuple[RegionKey, ...]]  # origin sync rank -> the regions this rank gets that come from it


def regions(plan: Plan, rank: int) -> Regions:
    """Sync rank ``rank``'s :class:`Regions` of ``plan`` (pure: every rank computes every rank's alike), each
    region under its origin (:func:`awex.meta.origins.transfer_origins`)."""
    sends: dict[int, list[RegionKey]] = {}
    receives: dict[int, list[RegionKey]] = {}
    for b, t, o in transfer_origins(plan):
        key = (t.tensor, t.offsets, t.sizes)
        if o == rank:
            sends.setdefault(b.dst, []).append(key)
        if b.dst == rank:
            receives.setdefault(o, []).append(key)
    return Regions({k: tuple(v) for k, v in sends.items()}, {k: tuple(v) for k, v in receives.items()})


def digests(plan: Plan, shards: LocalShards, groups: Mapping[int, Sequence[RegionKey]]) -> dict[int, Digest]:
    """Per group, the digest of its regions as ``shards`` hold them (a region in several groups is read once; the
    sums stay on the views' device until one read at the end). CUDA views: :class:`Verifier` batches the kernels."""
    index = _order(groups)
    sums = torch.zeros(len(index), 2, dtype=torch.int64, device=shards.device)
    for region, i in index.items():
        region_sums(shards, *plan_region(plan, region), sums[i])
    return _grouped(groups, index, [(a % MOD, b % MOD) for a, b in sums.tolist()])


def _order(groups: Mapping[int, Sequence[RegionKey]]) -> dict[RegionKey, int]:
    index: dict[RegionKey, int] = {}
    for keys_ in groups.values():
        for key in keys_:
            index.setdefault(key, len(index))
    return index


def _grouped(
    groups: Mapping[int, Sequence[RegionKey]], index: Mapping[RegionKey, int], values: Sequence[Digest]
) -> dict[int, Digest]:
    return grouped({group: [index[key] for key in keys_] for group, keys_ in groups.items()}, values)


def record(plan: Plan, sent: Mapping[int, Digest]) -> dict:
    """A trainer rank's record: the plan's digest and the digest per receiving sync rank (32 hex digits)."""
    return {"plan": plan.digest, "digests": {str(dst): f"{a:016x}{b:016x}" for dst, (a, b) in sorted(sent.items())}}


def expected(doc: object, plan: Plan, origin: int, rank: int) -> Digest:
    """What origin ``origin``'s record ``doc`` says receiving sync rank ``rank`` must hold of its regions; raises
    :class:`VerifyError` for a record that is malformed, made for another plan, or silent about this rank."""
    who = _who(plan, origin)
    if not isinstance(doc, dict) or set(doc) != {"plan", "digests"} or not isinstance(doc["digests"], dict):
        raise VerifyError(f"the verify record of {who} is malformed: {str(doc)[:200]}")
    if doc["plan"] != plan.digest:
        raise VerifyError(f"the verify record of {who} is for plan {str(doc['plan'])[:12]}, not {plan.digest[:12]}")
    value = doc["digests"].get(str(rank))
    if not isinstance(value, str) or _HEX.match(value) is None:
        raise VerifyError(f"the verify record of {who} has no digest for sync rank {rank}: {str(value)[:80]}")
    return int(value[:16], 16), int(value[16:], 16)


def _who(plan: Plan, rank: int) -> str:
    r = plan.ranks[rank]
    return f"sync rank {rank} ({r.instance}:{r.local_rank})"


class Verifier:
    """One rank's side of verify mode; keeps the last plan's :class:`Regions` and, for CUDA views, their regions
    laid out for a few kernel launches (``awex.transport.digest_batch``; again for views of memory that moved)."""

    def __init__(self, client: MetaClient):
        self.client = client
        self._regions: tuple[Plan, int, Regions] | None = None
        self._batch: tuple[Plan, LocalShards, dict[RegionKey, int], DigestBatch] | None = None

    def _of(self, plan: Plan, rank: int) -> Regions:
        if self._regions is None or self._regions[0] is not plan or self._regions[1] != rank:
            self._regions = (plan, rank, regions(plan, rank))
            self._batch = None
        return self._regions[2]

    def _digests(self, plan: Plan, shards: LocalShards, groups: Mapping[int, Sequence[RegionKey]]) -> dict[int, Digest]:
        if shards.device.type != "cuda" or shards.on_host or not digest_batch.available():
            return digests(plan, shards, groups)
        if self._batch is None or self._batch[0] is not plan or self._batch[1] is not shards:
            index = _order(groups)
            self._batch = (plan, shards, index, digest_batch.batch(shards, [plan_region(plan, k) for k in index]))
        _, _, index, laid_out = self._batch
        return _grouped(groups, index, laid_out.sums())

    def publish(
        self,
        plan: Plan,
        rank: int,
        manifest: SyncManifest,
        shards: LocalShards,
        taken: Mapping[int, Digest] | None = None,
    ) -> None:
        """A trainer rank, after its transfer: digest what it sent per receiving rank and publish the record.
        ``taken``: the digests the transport took of the same regions while the bytes moved
        (``Transport.sent_digests``), used where they name the same receiving ranks."""
        me = plan.ranks[rank]
        sends = self._of(plan, rank).sends
        sent = taken if taken is not None and set(taken) == set(sends) else self._digests(plan, shards, sends)
        self.client.put(keys.verify(manifest.version, manifest.seq, me.instance, me.local_rank), record(plan, sent))

    def check(
        self,
        plan: Plan,
        rank: int,
        manifest: SyncManifest,
        shards: LocalShards,
        deadline: float,
        check_senders: Callable[[Sequence[int]], None] | None = None,
        taken: Mapping[int, Digest] | None = None,
    ) -> None:
        """A receiving rank, after its transfer: digest what it holds per origin and compare with each origin's
        record (waiting for it until ``deadline``, ``time.monotonic()``; ``check_senders(origins)`` every second
        raises if one on this host is gone). Raises :class:`VerifyError` naming each origin whose regions differ.
        ``taken``: the digests the transport took of what it wrote as it copied
        (``Transport.received_digests``), used where they name the same origins."""
        receives = self._of(plan, rank).receives
        mine = taken if taken is not None and set(taken) == set(receives) else None
        if mine is None:
            mine = self._digests(plan, shards, receives)
        wrong = []
        for origin, got in sorted(mine.items()):
            o = plan.ranks[origin]
            key = keys.verify(manifest.version, manifest.seq, o.instance, o.local_rank)
            want = expected(self._wait(key, origin, plan, deadline, check_senders), plan, origin, rank)
            if got != want:
                n = len(self._of(plan, rank).receives[origin])
                wrong.append(
                    f"{n} region(s) from {_who(plan, origin)} hold other bytes than it sent "
                    f"(digest {got[0]:016x}{got[1]:016x}, sent {want[0]:016x}{want[1]:016x})"
                )
        if wrong:
            raise VerifyError(f"{_who(plan, rank)}, version {manifest.version!r}: " + "; ".join(wrong))

    def _wait(
        self,
        key: str,
        origin: int,
        plan: Plan,
        deadline: float,
        check_senders: Callable[[Sequence[int]], None] | None,
    ) -> object:
        while True:
            left = deadline - time.monotonic()
            try:
                return self.client.get(key, timeout=max(0.001, min(WAIT_SLICE_SECONDS, left)))
            except MetaTimeoutError:
                if left <= WAIT_SLICE_SECONDS:
                    raise VerifyError(f"no verify record from {_who(plan, origin)} before the deadline") from None
                if check_senders is not None:
                    check_senders([origin])
