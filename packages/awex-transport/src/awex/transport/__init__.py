"""awex.transport: transports that execute one rank's share of an Awex transfer plan.

- :mod:`awex.transport.shards`: :class:`LocalShards`, the views of a rank's own memory that hold its boxes of
  each canonical tensor (senders read from them, receivers write into them in place).
- :mod:`awex.transport.group`: a process group created for the sync alone, on its own store (never the
  engines' default group); gloo on CPU, NCCL on CUDA, one code path.
- :mod:`awex.transport.p2p`: :func:`run_p2p`, the point-to-point executor: per-peer buckets packed into one
  staging buffer, sent and unpacked in the plan's round order, with a deadline on every wait.
"""

from awex.transport.group import SyncGroup, create_sync_group
from awex.transport.p2p import TransferError, TransferStats, TransferTimeout, bucket_offsets, run_p2p
from awex.transport.shards import LocalShards, ShardMismatchError

__version__ = "0.1.0"

__all__ = [
    "LocalShards",
    "ShardMismatchError",
    "SyncGroup",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "bucket_offsets",
    "create_sync_group",
    "run_p2p",
]
