"""A process group for the weight sync alone.

It has its own TCP store and is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so it never
touches ``torch.distributed``'s default group or the engines' own groups, and a trainer that already runs
``init_process_group`` keeps its world untouched. Rank numbers are the plan's sync-world ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
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

    device: torch.device | None = None
    timeout: float = 60.0
    _subgroups: dict = field(default_factory=dict, repr=False)

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        """Post all ``(tensor, peer)`` sends and receives at once; returns the works to wait on.

        On NCCL they form one group (``ncclGroupStart/End``), so transfers to and from different peers run
        concurrently and their order cannot deadlock; on gloo each is its own asynchronous operation. Several
        messages to one peer are matched in order (the k-th send with the peer's k-th receive; on gloo each
        gets its own tag).
        """
        pg = self.process_group
        if self.backend == "nccl":
            pg._start_coalescing()  # the NCCL backend object (not the ProcessGroup wrapper) takes no device
            for tensor, peer in sends:
                pg.send([tensor], peer, 0)
            for tensor, peer in recvs:
                pg.recv([tensor], peer, 0)
            work = pg._end_coalescing()
            return [work] if work is not None else []
        works = []
        for op, items in (("send to", sends), ("recv from", recvs)):
            count: dict[int, int] = {}
            for tensor, peer in items:
                tag = count[peer] = count.get(peer, -1) + 1
                try:
                    works.append((pg.send if op == "send to" else pg.recv)([tensor], peer, tag))
                except RuntimeError as e:  # name the peer: "connection closed" alone does not say who died
                    raise RuntimeError(f"{op} rank {peer}: {e}") from e
        return works

    def subgroup(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """A process group over ``members`` (sorted sync-world ranks, this one among them; rank ``i`` in it is
        ``members[i]``), built once on the sync store. Every member must ask for the same subgroups in the same
        order (an NCCL one is initialised eagerly, like the sync group)."""
        pg = self._subgroups.get(members)
        if pg is not None:
            return pg
        if self.rank not in members or list(members) != sorted(set(members)):
            raise ValueError(f"rank {self.rank}: subgroup {members} must be sorted, distinct and include this rank")
        store = dist.PrefixStore("sub/" + ",".join(map(str, members)), self.store)
        wait = timedelta(seconds=self.timeout)
        me = members.index(self.rank)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = wait
            pg = dist.ProcessGroupNCCL(store, me, len(members), options)
            probe = torch.ones(1, device=self.device)
            pg.allreduce([probe]).wait()
        else:
            pg = dist.ProcessGroupGloo(store, me, len(members), wait)
        self._subgroups[members] = pg
        return pg

    def broadcast(self, members: tuple[int, ...], tensor: torch.Tensor, root: int):
        """Broadcast ``tensor`` from sync-world rank ``root`` to the other ``members`` (asynchronous: the work)."""
        options = dist.BroadcastOptions()
        options.rootRank = members.index(root)
        return self.subgroup(members).broadcast([tensor], options)

    def abort(self) -> None:
        """Abort the group after a failure (unblocks NCCL kernels waiting on a dead peer); best effort."""
        for pg in (self.process_group, *self._subgroups.values()):
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - aborting is a last resort; the caller raises the real error
                log.warning("aborting the sync group failed: %s", e)


def create_sync_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "gloo",
    timeout: float = 60.0,
    prefix: str = "awex",
    device: torch.device | str | None = None,
) -> SyncGroup:
    """Join the sync world: rank 0 hosts the TCP store at ``host:port``, every rank connects within ``timeout``.

    ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors on ``device``, default the current
    one). An NCCL group is initialised eagerly (one tiny all-reduce), so the first sync does not pay for it
    and a rank that has nothing to move cannot leave the others waiting for the communicator.
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
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        probe = torch.ones(1, device=dev)
        pg.allreduce([probe]).wait()
        torch.cuda.synchronize(dev)
        if probe.item() != world_size:
            raise RuntimeError(f"NCCL sync group check failed: all-reduce gave {probe.item()}, expected {world_size}")
        log.info("rank %d/%d joined the nccl sync group at %s:%d on %s", rank, world_size, host, port, dev)
        return SyncGroup(rank, world_size, backend, pg, store, dev, timeout)
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' or 'nccl'")
    log.info("rank %d/%d joined the %s sync group at %s:%d", rank, world_size, backend, host, port)
    return SyncGroup(rank, world_size, backend, pg, store, torch.device("cpu"), timeout)
