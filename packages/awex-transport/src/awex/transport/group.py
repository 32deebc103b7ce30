"""A process group for the weight sync alone.

It has its own TCP store and is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so it never
touches ``torch.distributed``'s default group or the engines' own groups, and a trainer that already runs
``init_process_group`` keeps its world untouched. Rank numbers are the plan's sync-world ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("awex.transport")


@dataclass
class SyncGroup:
    """A process group over the sync world, with the store that holds it together."""

    rank: int
    world_size: int
    backend: str
    process_group: dist.ProcessGroup
    store: dist.Store

    def send(self, tensor, peer: int, tag: int = 0):
        return self.process_group.send([tensor], peer, tag)

    def recv(self, tensor, peer: int, tag: int = 0):
        return self.process_group.recv([tensor], peer, tag)


def create_sync_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "gloo",
    timeout: float = 60.0,
    prefix: str = "awex",
) -> SyncGroup:
    """Join the sync world: rank 0 hosts the TCP store at ``host:port``, every rank connects within ``timeout``.

    ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    wait = timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=wait)
    except (RuntimeError, TimeoutError) as e:  # torch raises DistStoreError (a RuntimeError) on timeouts
        raise TimeoutError(f"rank {rank}: could not join the sync store at {host}:{port} within {timeout:g} s: {e}") from e
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, wait)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' or 'nccl'")
    log.info("rank %d/%d joined the %s sync group at %s:%d", rank, world_size, backend, host, port)
    return SyncGroup(rank, world_size, backend, pg, store)
