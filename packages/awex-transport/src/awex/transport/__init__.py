"""awex.transport: transports that execute one rank's share of an Awex transfer plan.

- :mod:`awex.transport.shards`: :class:`LocalShards`, the views of a rank's own memory that hold its boxes of
  each canonical tensor (senders read from them, receivers write into them in place).
- :mod:`awex.transport.group`: a process group created for the sync alone, on its own store (never the
  engines' default group); gloo on CPU, NCCL on CUDA, one code path.
- :mod:`awex.transport.p2p`: :class:`WaveExecutor` (and the one-off :func:`run_p2p`): per-peer messages
  packed into a staging buffer (large transfers straight from and into the engines' memory), all of a wave's sends and
  receives posted at once (one NCCL group),
  double-buffered on CUDA, unpacked in place, with a deadline on every wait.
- :mod:`awex.transport.ipc`: engines on one host: the receiver copies straight from the trainer's
  CUDA memory (IPC handles exported once) into its own views.
- :mod:`awex.transport.shm`: CPU engines on one host: each sender writes a version once into a shared-memory
  segment laid out by the plan, receivers copy out in place; no segment outlives a killed creator.
"""

from awex.transport.group import SyncGroup, create_sync_group
from awex.transport.p2p import (
    TransferError,
    TransferStats,
    TransferTimeout,
    WaveExecutor,
    bucket_messages,
    message_offsets,
    run_p2p,
)
from awex.transport.shards import LocalShards, ShardMismatchError

__version__ = "0.1.0"

__all__ = [
    "LocalShards",
    "ShardMismatchError",
    "SyncGroup",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "WaveExecutor",
    "bucket_messages",
    "create_sync_group",
    "message_offsets",
    "run_p2p",
]
