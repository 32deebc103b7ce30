"""awex.transport: transports that execute one rank's share of an Awex transfer plan.

- :mod:`awex.transport.base`: :class:`Transport`, the one interface every transport implements (prepare per
  plan, run per version under a deadline, abort, close), the :class:`PeerLink` it talks to its peers through, and
  :class:`TransferStats` / :class:`TransferError` / :class:`TransferTimeout`.
- :mod:`awex.transport.registry`: transports by name (``p2p``, ``ipc``, ``shm``, ``rdma``),
  :func:`make_transport`.

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
- :mod:`awex.transport.pull.shm`: CPU engines on one host: each sender writes a version once into a shared-memory
  segment laid out by the plan, receivers copy out in place; no segment outlives a killed creator.
- :mod:`awex.transport.pull.rdma`: one-sided reads of the senders' registered memory through Mooncake's transfer
  engine (RDMA NICs, TCP where none exist).

``__all__`` is the public API; anything else is reached through its module and may change between minor versions.
"""

from awex.transport.base import PeerLink, TransferError, TransferStats, TransferTimeout, Transport
from awex.transport.group import SyncGroup, create_sync_group
from awex.transport.p2p import WaveExecutor, run_p2p
from awex.transport.registry import TRANSPORTS, make_transport, register, transport_class
from awex.transport.shards import LocalShards, ShardMismatchError

__version__ = "0.1.0"

__all__ = [
    "TRANSPORTS",
    "LocalShards",
    "PeerLink",
    "ShardMismatchError",
    "SyncGroup",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "Transport",
    "WaveExecutor",
    "create_sync_group",
    "make_transport",
    "register",
    "run_p2p",
    "transport_class",
]
