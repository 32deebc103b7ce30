"""Point-to-point execution of one rank's share of a plan.

For every step of :meth:`awex.meta.Plan.schedule` (rounds in order, buckets in order), a sender packs the
bucket's regions from its views into one staging buffer and sends it; the receiver receives into its staging
buffer and copies each region into its views (in place). Every wait has a deadline: a peer that dies or never
arrives makes this rank raise :class:`TransferError` / :class:`TransferTimeout`, never hang.

Staging is one buffer per rank, as large as the rank's largest bucket (bounded by the plan's ``bucket_bytes``).
Regions inside a bucket start at 16-byte-aligned offsets (:func:`bucket_offsets`), computed the same way on
both sides.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from awex.meta import Bucket, Plan
from awex.transport.group import SyncGroup
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")

ALIGN = 16


class TransferError(RuntimeError):
    """A send or receive failed (peer gone, connection closed, backend error)."""


class TransferTimeout(TransferError, TimeoutError):
    """The sync did not finish before its deadline."""


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    seconds: float = 0.0


def bucket_offsets(bucket: Bucket) -> tuple[list[int], int]:
    """Byte offset of each transfer inside the staging buffer, and the buffer size (aligned to ``ALIGN``)."""
    offsets = []
    pos = 0
    for t in bucket.transfers:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += t.nbytes
    return offsets, pos


def run_p2p(plan: Plan, rank: int, shards: LocalShards, group: SyncGroup, timeout: float = 300.0) -> TransferStats:
    """Execute ``rank``'s sends and receives of ``plan`` over ``group`` within ``timeout`` seconds."""
    started = time.monotonic()
    deadline = started + timeout
    steps = plan.schedule(rank)
    dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
    names = [t.name for t in plan.tensors]
    layouts = [bucket_offsets(s.bucket) for s in steps]  # (offsets, size) per step, computed once
    size = max((n for _, n in layouts), default=0)
    staging = torch.empty(size, dtype=torch.uint8, device=shards.device)
    stats = TransferStats()
    for step, (offsets, nbytes) in zip(steps, layouts):
        bucket = step.bucket
        buf = staging[:nbytes]
        what = f"rank {rank}: {step.op} of {nbytes} bytes {'to' if step.op == 'send' else 'from'} rank {step.peer} (round {bucket.round})"
        if step.op == "send":
            for t, off in zip(bucket.transfers, offsets):
                region = buf[off:off + t.nbytes].view(dtypes[t.tensor]).view(t.sizes)
                shards.copy_out(names[t.tensor], t.offsets, t.sizes, region)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what}: the sync's {timeout:g} s deadline passed")
        try:
            work = group.send(buf, step.peer) if step.op == "send" else group.recv(buf, step.peer)
            work.wait(timedelta(seconds=left))
        except RuntimeError as e:
            text = str(e).lower()
            late = time.monotonic() >= deadline or "timed out" in text or "timeout" in text
            raise (TransferTimeout if late else TransferError)(f"{what} failed: {e}") from e
        if step.op == "recv":
            for t, off in zip(bucket.transfers, offsets):
                region = buf[off:off + t.nbytes].view(dtypes[t.tensor]).view(t.sizes)
                shards.copy_in(names[t.tensor], t.offsets, t.sizes, region)
            stats.bytes_received += bucket.nbytes
        else:
            stats.bytes_sent += bucket.nbytes
        stats.buckets += 1
    stats.seconds = time.monotonic() - started
    log.debug("rank %d: %d buckets, sent %d B, received %d B in %.3f s", rank, stats.buckets, stats.bytes_sent,
              stats.bytes_received, stats.seconds)
    return stats
